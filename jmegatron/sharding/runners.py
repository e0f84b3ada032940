"""How a stack of layers runs: one strategy per layout, chosen by the layout.

The model hands each run of consecutive layers of one kind (dense or MoE) to a
``StackRunner`` as a ``Stack``: one layer's function, the stack's weights and
which layers to run. The runner decides how the weights reach the layers and
how their gradients come back:

  ScanRunner      a scan over [L, ...] weights placed as the rules say; XLA
                  partitions it (replicated, fsdp; and every layout on one
                  device unless the stack is grouped; stages run in turn).
  ScatterRunner   layerwise: a whole dense stack on replicated weights, each
                  rank's gradients reduce-scattered onto the ranks that own
                  them (``sharding.scatter``); otherwise a scan.
  GroupedRunner   owner: weights stacked [G, g, ...], g layers owned by g ranks;
                  each group is gathered, run, and its gradients sent back to
                  the owners (``rules.run_gathered``, ``rules.run_constrained``,
                  or ``sharding.prefetch`` with the gather one group ahead).
  PipelineRunner  a stack [S, L/S, ...] over pipeline stages, each stage's
                  layers by the layout's runner (``sharding.pipeline``); the
                  model runs under it with its loss (``sharding.own_backward``).

The layout makes its runner (``Layout.runner``), and the loss function hands
it to the model with the mesh and rules (``running`` beside
``rules.activation_sharding``); without one, a model runs its stacks by the
``default_runner`` of its config, as on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jmegatron.sharding.prefetch import run_prefetched
from jmegatron.sharding.rules import (LAYERS, active_mesh_and_rules, compute_dtype_of,
                                     grad_dtype_of, logical_axes_of, mesh_axes_of,
                                     only_batch_axes_live, run_constrained, run_gathered)
from jmegatron.sharding.scatter import run_stack
from jmegatron.sharding.stacks import StackShape, stack_of

# One layer: (x, its weights' state) -> (x, stats per example [B, ...]).
LayerFn = Callable[[jax.Array, nnx.State], tuple[jax.Array, dict]]


class Stack(NamedTuple):
    """One run of consecutive layers of a stack, as the model hands it to a runner."""

    layer: LayerFn                   # one layer (remat applied)
    state: nnx.State                 # the whole stack's weights: [L, ...], [G, g, ...],
                                     # [S, L/S, ...] or [S, G, g, ...] (sharding.stacks)
    start: int                       # the first layer to run
    n: int                           # how many
    summed: tuple[str, ...]          # stats the layer sums over the whole batch (MoE loads)
    self_sharded: bool               # the layers run a shard_map of their own (MoE)

    @property
    def leaves(self) -> list[jax.Array]:
        return jax.tree.leaves(self.state)

    @property
    def dtypes(self) -> tuple[jnp.dtype, ...]:
        """Per leaf, the dtype it computes in (``rules.compute_dtype_of``)."""
        return tuple(compute_dtype_of(v)
                     for v in jax.tree.leaves(self.state, is_leaf=_is_variable))

    @property
    def grad_dtypes(self) -> tuple[jnp.dtype, ...]:
        """Per leaf, the dtype its gradient is computed and summed in
        (``rules.grad_dtype_of``)."""
        return tuple(grad_dtype_of(v)
                     for v in jax.tree.leaves(self.state, is_leaf=_is_variable))

    @property
    def shape(self) -> StackShape | None:
        """Where the layers sit in a stack [*dims, ...] (None: [L, ...]), from what its
        weights declare (``real_layers``, their logical axes)."""
        return stack_of(jax.tree.leaves(self.state, is_leaf=_is_variable)[0])

    @property
    def staged(self) -> bool:
        """Split into pipeline stages [S, ...]."""
        return self.shape is not None and self.shape.staged

    @property
    def group(self) -> int:
        """g of a stack grouped [(S,) G, g, ...]; 1 for [L, ...] and [S, L/S, ...]."""
        shape = self.shape
        grouped = shape is not None and len(shape.dims) > (2 if shape.staged else 1)
        return shape.dims[-1] if grouped else 1

    @property
    def whole(self) -> bool:
        """Whether every layer of an [L, ...] stack runs."""
        return self.n == self.leaves[0].shape[0]

    def scan(self, x: jax.Array, leaves: Sequence[jax.Array], unroll: int | bool = 1):
        """The layers on ``leaves`` (the stack's leaves, [n, ...] each) in turn."""
        weights = jax.tree.structure(self.state).unflatten(list(leaves))
        return jax.lax.scan(self.layer, x, weights, unroll=unroll)


@dataclasses.dataclass(frozen=True)
class StackRunner:
    """A scan over [L, ...] weights, placed and partitioned as the rules say."""

    group: int = 1   # the stack shape it runs: [L, ...] (1) or [G, g, ...]

    def __call__(self, stack: Stack, x: jax.Array) -> tuple[jax.Array, dict]:
        """x through ``stack``'s layers start..start+n: (x, stats [n, ...])."""
        leaves = stack.leaves
        if stack.staged:   # [S, ...] on one device: the layers in order, padding dropped
            return stack.scan(x, [stack.shape.to_canonical(leaf) for leaf in leaves])
        self.check(stack)
        if not stack.whole:
            leaves = [leaf[stack.start:stack.start + stack.n] for leaf in leaves]
        return stack.scan(x, leaves)

    def check(self, stack: Stack) -> None:
        """Raises ValueError if the stack is not shaped as this runner runs it."""
        if stack.group != self.group:
            raise ValueError(f"this layout runs stacks in groups of {self.group}, but the "
                             f"model's are grouped by {stack.group}: build it with "
                             f"GPTConfig(layer_group={self.group})")


ScanRunner = StackRunner


@dataclasses.dataclass(frozen=True)
class ScatterRunner(StackRunner):
    """Layerwise: weights whole on every rank, each matrix's state on one of the
    ``owners`` ranks; a whole dense stack's gradients are reduce-scattered onto them
    (``scatter.run_stack``), other runs are scanned."""

    owners: tuple[str, ...] = ()

    def __call__(self, stack: Stack, x: jax.Array) -> tuple[jax.Array, dict]:
        if not stack.whole or stack.self_sharded:
            return super().__call__(stack, x)
        self.check(stack)
        return run_stack(stack.scan, x, stack.leaves, stack.grad_dtypes, self.owners)


@dataclasses.dataclass(frozen=True)
class GroupedRunner(StackRunner):
    """Owner: weights [G, g, ...], each group of g whole layers (one per owner rank)
    gathered, run and its gradients sent back to the owners; the last group may end
    in padding slots, which it skips. With ``prefetch``, group i+1's gather is issued
    before group i runs (dense stacks; ``sharding.prefetch``); with ``keep``, the
    backward keeps the gathered weights instead of gathering them again."""

    prefetch: bool = False
    keep: bool = False

    def __call__(self, stack: Stack, x: jax.Array) -> tuple[jax.Array, dict]:
        self.check(stack)   # (GPTConfig keeps a grouped stack's layers in one run)
        leaves = stack.leaves
        axes = [logical_axes_of(v)[1:]
                for v in jax.tree.leaves(stack.state, is_leaf=_is_variable)]
        full, last = divmod(stack.n, self.group)
        sizes = [self.group] * full + ([last] if last else [])

        def run(x, whole, size, unroll=1):
            return stack.scan(x, [w[:size] for w in whole], unroll=unroll)

        # In a shard_map manual over the batch axes only where no other axis is live
        # (there MoE layers also run on their local blocks); by sharding constraints
        # otherwise (rules.only_batch_axes_live).
        active = active_mesh_and_rules()
        manual = active is None or only_batch_axes_live(active[0].shape, active[1])
        if self.prefetch and not stack.self_sharded:
            if not manual:
                raise ValueError("prefetch runs the groups manual over the batch axes: "
                                 "with tensor parallelism (tensor > 1) leave it off")
            # Unrolled: XLA copies a carried group into a nested loop (prefetch.py).
            return run_prefetched(functools.partial(run, unroll=True), x, leaves, axes,
                                  LAYERS, sizes, stack.dtypes, stack.grad_dtypes)
        runner = (functools.partial(run_gathered, summed=stack.summed, keep=self.keep,
                                    dtypes=stack.dtypes, grad_dtypes=stack.grad_dtypes)
                  if manual else functools.partial(run_constrained, keep=self.keep))
        if active is not None and not any(active[0].shape[a] > 1
                                          for a in mesh_axes_of(LAYERS, active[1])):
            # The groups arrive whole: a pipeline stage gathered its weights once for
            # the step (pipeline.over_stages, with keep_gathered).
            runner = lambda fn, x, group, axes, name: fn(x, group)

        def run_group(x, group, size=self.group):
            return runner(lambda x, whole: run(x, whole, size), x, group, axes, LAYERS)

        stats = []
        if full:
            x, full_stats = jax.lax.scan(run_group, x, [leaf[:full] for leaf in leaves])
            stats.append(jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), full_stats))
        if last:
            x, last_stats = run_group(x, [leaf[full] for leaf in leaves], last)
            stats.append(last_stats)
        return x, jax.tree.map(lambda *s: jnp.concatenate(s), *stats)


def default_runner(group: int, prefetch: bool = False, keep: bool = False,
                   stages: int = 1) -> StackRunner:
    """The runner of a model built with ``layer_group=group`` and ``stages`` where no
    layout gave one (one device; a mesh without a layout): stacks split into
    pipeline stages run slot by slot (``ScanRunner``), owner groups by a
    ``GroupedRunner``."""
    return GroupedRunner(group, prefetch, keep) if group > 1 and stages == 1 else ScanRunner()


_RUNNER: contextvars.ContextVar[StackRunner | None] = contextvars.ContextVar(
    "jmegatron_stack_runner", default=None)


@contextlib.contextmanager
def running(runner: StackRunner | None):
    """Within this context (while tracing), models run their stacks with ``runner``."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)


def active_runner() -> StackRunner | None:
    """The runner of the enclosing ``running``, if any."""
    return _RUNNER.get()


def _is_variable(v) -> bool:
    return isinstance(v, nnx.Variable)

