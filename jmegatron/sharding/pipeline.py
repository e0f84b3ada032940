"""Pipeline stages: a layer stack split over the ``stage`` mesh axis, run by a
schedule's tables (``sharding.schedules``) in one interpreter
(``sharding.own_backward``), each stage on its own blocks.

A stack stored [S, L/S, ...] with its first dim split over the mesh axes the
rules map ``stages`` to holds stage s's layers on the devices of stage s; with V
chunks a stage (circular, interleaved-1f1b: MaxText's and Megatron's
interleaving) a stack [S, V c, ...] holds S V chunks of c layers, chunk j on
stage j % S (``sharding.stacks``), and a microbatch goes around the stages V
times. ``PipelineRunner`` holds the schedule and runs a stage's chunk of layers
(``run_chunk``); ``over_stages`` runs the loss function manual over the stages
(and, where the layout sums a stage's gradients once a step, over the batch
axes), each stage on its own blocks.

References:
  Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism", arXiv:1811.06965, 2019.
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", arXiv:2104.04473, 2021.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jmegatron.sharding import nested
from jmegatron.sharding.rules import (STAGES, active_mesh_and_rules, compute_dtype_of,
                                     gather_in, grad_dtype_of, logical_axes_of, mesh_axes_of,
                                     scatter_to_owners, spec_axes)
from jmegatron.sharding.runners import ScanRunner, Stack, StackRunner
from jmegatron.sharding.schedules import Schedule, make_schedule
from jmegatron.sharding.stacks import StackShape

@dataclasses.dataclass(frozen=True)
class PipelineRunner(StackRunner):
    """A stack [S, L/S, ...] as ``stages`` pipeline stages over ``microbatches`` under
    ``schedule`` (module docstring), ``repeats`` chunks a stage; each chunk's layers
    by ``inner``. The model runs under it with its loss (``train.make_loss_fn``)."""

    stages: int = 2
    microbatches: int = 2
    inner: StackRunner = ScanRunner()
    repeats: int = 1
    schedule: str = "gpipe"   # a name in sharding.schedules.SCHEDULES

    def __post_init__(self):
        if self.microbatches < self.stages:
            raise ValueError(f"{self.microbatches} microbatches for {self.stages} pipeline "
                             f"stages: every stage would idle; use --microbatches "
                             f">= {self.stages}")
        self.table_for(1)   # an unknown schedule, or repeats it does not take, refused here

    def table_for(self, stacks: int) -> Schedule:
        """The schedule's tables for a model of ``stacks`` stacks (``make_schedule``)."""
        return make_schedule(self.schedule, self.stages, self.microbatches, self.repeats,
                             stacks)

    def __call__(self, stack: Stack, x: jax.Array) -> tuple[jax.Array, dict]:
        raise ValueError("a pipeline runs the model with its loss, not a stack alone: "
                         "build the loss with train.make_loss_fn")

    def check(self, stack: Stack):
        """The stage axes this stage runs ``stack`` manual over; ValueError where
        ``stack`` or the context does not fit the pipeline."""
        if stack.shape.repeats != self.repeats:
            raise ValueError(f"a pipeline of {self.repeats} chunks a stage got a stack of "
                             f"{stack.shape.repeats}: build the model with "
                             f"GPTConfig(repeats={self.repeats})")
        if stack.start or stack.n != stack.shape.layers:
            raise ValueError(f"a pipeline runs whole stacks, not layers {stack.start}.."
                             f"{stack.start + stack.n - 1} of {stack.shape.layers}: keep each "
                             f"kind of layer in one run (GPTConfig: moe.every=1)")
        active = active_mesh_and_rules()
        if active is None:
            raise ValueError("a pipeline runs on a mesh: build the loss with "
                             "train.make_loss_fn")
        axis = tuple(mesh_axes_of(STAGES, active[1]))
        if not set(axis) <= set(jax.sharding.get_abstract_mesh().manual_axes):
            raise ValueError("a pipeline runs inside a map manual over the stages, each stage "
                             "on its own blocks: run the model through train.make_loss_fn "
                             "(sharding.pipeline.over_stages)")
        if stack.leaves[0].shape[0] != 1:   # this stage's [1, L/S, ...] blocks
            raise ValueError(f"a pipeline of {self.stages} stages got a stack split "
                             f"{stack.leaves[0].shape[0]} to a stage: build the model with "
                             f"GPTConfig(stages={self.stages})")
        return axis

    def chunk_size(self, stack: Stack) -> int:
        """Layer slots of one chunk (a stage's, without repeats; from the whole stack:
        this stage's dims[0] is 1)."""
        return StackShape(stack.n, (self.stages,), True, self.repeats).per_stage // self.repeats

    def run_chunk(self, stack: Stack, blocks, x: jax.Array, r=0):
        """x through this stage's chunk ``r`` of ``blocks`` (its [L/S, ...] or
        [G, g, ...] weights; each block's dim 0 in V parts) by ``inner``: (y, stats
        [c, ...])."""
        v = self.repeats
        weights = blocks if v == 1 else [
            jax.lax.dynamic_slice_in_dim(b, r * (b.shape[0] // v), b.shape[0] // v)
            for b in blocks]
        chunk = self.chunk_size(stack)
        local = stack._replace(state=_one_stage(stack.state, weights, chunk), start=0, n=chunk)
        return self.inner(local, x)

    def in_model_order(self, stats: dict, stack: Stack, axis) -> dict:
        """This stage's stats [1, V, M, c, ...] -> the stack's [L, ...] (those the
        layers sum over the batch: their mean over the microbatches, as the train
        step's accumulation takes it) or [L, B, ...] (per example), on every stage."""
        m = self.microbatches
        # Every stage's stats on every stage: one stats-sized all-reduce.
        stats = jax.tree.map(lambda a: _from_every_stage(a, axis, self.stages), stats)

        def in_layer_order(s):   # [S, V, M, c, ...] -> [L, M, ...]: layer (v S + s) c + i
            # in order (only the last chunks end in padding, whose stats are dropped)
            s = s.transpose(1, 0, 3, 2, *range(4, s.ndim))
            return s.reshape(-1, m, *s.shape[4:])[:stack.n]

        def in_batch_order(s):   # [L, M, b, ...] -> [L, B, ...]: the batch's rows
            return s.swapaxes(1, 2).reshape(stack.n, -1, *s.shape[3:])

        return {k: in_layer_order(v).mean(axis=1) if k in stack.summed
                else jax.tree.map(lambda a: in_batch_order(in_layer_order(a)), v)
                for k, v in stats.items()}


def over_stages(fn, mesh: jax.sharding.Mesh, rules, batch_axes: tuple[str, ...] = (),
                combine: Callable = lambda out: out,
                param_spec: Callable[[tuple], P] | None = None,
                gradient_spec: Callable[[tuple, tuple], P] | None = None) -> Callable:
    """``fn(mesh, params, *args)`` run manual over the stage axis, as
    ``(params, *args) -> fn's outputs``: the leaves of ``params`` stacked over
    ``stages`` arrive as this stage's blocks [1, ...], every other leaf and
    argument whole; ``fn`` gets the stage's abstract mesh, and its outputs must be
    the same on every stage.

    The loss function runs so with pipeline stages (``train.make_loss_fn``): the
    embedding, head and loss are then one replicated computation per stage that
    XLA cannot split over the stage axis (left to it, it did, and moved weight-
    sized buffers across stages), and the pipeline inside runs on the blocks
    it is given (``PipelineRunner``).

    With ``batch_axes`` (``Layout.pipeline_batch_axes``) the map is manual over them
    too: the arguments arrive split over them along dim 0 (each rank's own rows).
    The params arrive as the layout places them (``param_spec`` of their logical
    axes); those split over batch axes (fsdp, owner) are gathered whole once, in
    the dtype they compute in (``rules.gather_in``), and all are cast to varying
    over the batch axes before ``fn`` runs, so that autodiff sums their gradients
    once a step, at the gather's and the cast's transposes (a reduce-scatter back
    to the owners, an all-reduce over the other batch axes), not at every tick of
    the pipeline; ``combine`` makes ``fn``'s outputs the same on every batch rank.
    A whole param whose gradient the layout wants split over batch axes
    (``gradient_spec`` of its logical axes and shape: layerwise's owners) also
    arrives as that view, and its gradient is reduce-scattered onto the view
    instead of all-reduced. ``fn`` then runs its stage as one device would: it
    must not constrain activations over ``batch_axes``."""
    axis = mesh_axes_of(STAGES, rules)
    manual = set(axis) | set(batch_axes)
    nested.nested_maps_differentiate()   # the layers' own maps differentiate inside

    inside = lambda spec: P(*(tuple(a for a in spec_axes(e) if a in manual) or None
                              for e in spec))

    def placed(v, leaf) -> tuple[P, P]:   # where leaf v arrives, and where its gradient leaves
        if not batch_axes:
            return (P(axis) if staged(v) else P(),) * 2
        logical = logical_axes_of(v)
        return (inside(param_spec(logical)), inside(
            gradient_spec(logical, leaf.shape) if gradient_spec else param_spec(logical)))

    def mapped(params, *args):
        variables = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
        leaves = jax.tree.leaves(params)
        specs, views = zip(*map(placed, variables, leaves))
        treedef = jax.tree.structure(params)

        def body(leaves, views_in, *args):
            if batch_axes:   # each rank's own gradients from here: summed once, at the gather
                leaves = [whole_on_every_rank(leaf, view, spec, view_spec, v, batch_axes)
                          for leaf, view, spec, view_spec, v
                          in zip(leaves, views_in, specs, views, variables)]
            return combine(fn(jax.sharding.get_abstract_mesh(), treedef.unflatten(leaves),
                              *args))

        # The views only where a gradient may leave split otherwise than its param.
        rows, seen = (P(batch_axes), leaves) if batch_axes else (P(), [])
        return jax.shard_map(body, mesh=mesh,
                             in_specs=(list(specs), list(views[:len(seen)]),
                                       *[rows] * len(args)),
                             out_specs=P(), axis_names=manual)(leaves, seen, *args)
    return mapped


def whole_on_every_rank(block: jax.Array, view: jax.Array, spec: P, view_spec: P, variable,
                        batch_axes: tuple[str, ...]):
    """``block`` (placed by ``spec``) whole and varying over ``batch_axes``: gathered over
    the batch axes that split it (at most one dim: a layout splits a weight once over
    them), in the dtype it computes in, after a cast to varying over the others; or,
    whole already and with a ``view`` that ``view_spec`` splits over batch axes, its
    gradient reduce-scattered onto that view. ``view`` is ``block`` again, placed by
    ``view_spec``: unused, but for its gradient."""
    split = split_dims(spec, batch_axes) or split_dims(view_spec, batch_axes)
    if not split:
        return jax.lax.pcast(block, batch_axes, to="varying")
    (dim, owners), = split.items()
    others = tuple(a for a in batch_axes if a not in owners)
    dtype, wide = compute_dtype_of(variable), grad_dtype_of(variable)
    if split_dims(spec, batch_axes):
        whole = gather_in(jnp.moveaxis(block, dim, 0), dtype, owners, others, wide)
        return jnp.moveaxis(whole, 0, dim)

    @jax.custom_vjp
    def scattered(block, view):
        return jax.lax.pcast(block, batch_axes, to="varying")

    shape, master, stages = block.shape, block.dtype, tuple(nested.varying_axes(block))

    def backward(_, g):   # this rank's whole gradient -> the view's part, summed
        d = scatter_to_owners(jnp.moveaxis(g, dim, 0).astype(wide), owners, others, master)
        none = jnp.zeros(shape, master)   # the block's, typed as it is (varying over stages)
        return (jax.lax.pcast(none, stages, to="varying") if stages else none,
                jnp.moveaxis(d, 0, dim))

    scattered.defvjp(lambda block, view: (scattered(block, view), None), backward)
    return scattered(block, view)


def split_dims(spec: P, axes: tuple[str, ...]) -> dict[int, tuple[str, ...]]:
    """{dim: the axes of ``axes`` that split it} for the dims of ``spec`` they split."""
    return {d: tuple(a for a in spec_axes(e) if a in axes) for d, e in enumerate(spec)
            if set(spec_axes(e)) & set(axes)}


def staged(v) -> bool:
    """Whether ``v`` is a variable stacked over the pipeline stages [S, ...]."""
    return isinstance(v, nnx.Variable) and (logical_axes_of(v) or (None,))[0] == STAGES


def staged_leaves(params):
    """(leaves outside the stages' stacks, stacked leaves, rebuild): ``rebuild(rest,
    stacked)`` puts such lists back into ``params``' structure."""
    leaves, treedef = jax.tree.flatten(params)
    flags = [staged(v) for v in jax.tree.leaves(params, is_leaf=lambda v: isinstance(
        v, nnx.Variable))]

    def rebuild(rest, stacked):
        rest, stacked = iter(rest), iter(stacked)
        return treedef.unflatten([next(stacked) if f else next(rest) for f in flags])

    return ([x for x, f in zip(leaves, flags) if not f], [x for x, f in zip(leaves, flags) if f],
            rebuild)


def varying(tree):
    """The arrays of ``tree`` typed as varying over every manual axis of the enclosing
    map they do not vary over yet (a tick loop's carry: the ticks' values vary over
    all of them)."""
    manual = jax.sharding.get_abstract_mesh().manual_axes

    def cast(a):
        missing = tuple(axis for axis in manual if axis not in nested.varying_axes(a))
        return jax.lax.pcast(a, missing, to="varying") if missing else a
    return jax.tree.map(cast, tree)


def at(buf: jax.Array, i) -> jax.Array:
    """Slot ``i`` of a tick loop's buffer [N, ...]."""
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def keep(buf: jax.Array, new: jax.Array, ok, i) -> jax.Array:
    """``buf`` with ``new`` in slot ``i`` where ``ok`` (a tick with work), else as it was."""
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(ok, new, at(buf, i)), i, 0)


def _from_every_stage(a: jax.Array, axis, stages: int) -> jax.Array:
    """This stage's [1, ...] -> every stage's [S, ...], the same on all (a psum of each
    stage's own slot; an all-gather's result would still count as varying)."""
    whole = jnp.zeros((stages, *a.shape[1:]), a.dtype)
    return jax.lax.psum(jax.lax.dynamic_update_index_in_dim(
        whole, a[0], jax.lax.axis_index(axis), 0), axis)


def _one_stage(state, blocks, layers: int):
    """The stack's state with one stage's weights ``blocks`` (each [L/S, ...] or
    [G, g, ...]) of ``layers`` real layers, its variables named as such a stack."""
    is_var = lambda v: isinstance(v, nnx.Variable)
    variables = jax.tree.leaves(state, is_leaf=is_var)
    return jax.tree.structure(state, is_leaf=is_var).unflatten(
        [v.replace(b, out_sharding=logical_axes_of(v)[1:], real_layers=layers, repeats=1)
         for v, b in zip(variables, blocks)])
