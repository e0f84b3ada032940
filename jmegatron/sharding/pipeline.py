"""Pipeline stages: a layer stack split over the ``stage`` mesh axis, microbatches
passed from stage to stage.

A stack stored [S, L/S, ...] with its first dim split over the mesh axes the
rules map ``stages`` to holds stage s's layers on the devices of stage s. The
``gpipe`` schedule (Huang et al., 2019) runs the M microbatches through the S
stages in M + S - 1 ticks: at tick t stage s runs microbatch t - s (stage 0
takes it from the input, the others from their left neighbour by one
``collective-permute``), and idles (computes on zeros, which nothing reads) on
the S - 1 ticks where it has none: the bubble, (S - 1) / (M + S - 1) of the
step. The backward is the transpose, the same ticks in reverse, so GPipe's
"all forward, then all backward", with each layer's remat as configured.

The embedding, the head and the loss run outside the pipeline, on every stage
(the stage axis splits no activation): stage 0 reads the microbatches from the
replicated input, and the last stage's outputs reach every stage by one
all-reduce over the stage axis (its transpose is free; the input's gradient
comes back by one all-reduce). Their weights' gradients then need no sum over
stages. The price is the head's matmuls run S times (XLA may instead split
that replicated work over the idle stage axis itself: then a few collectives of
the embedding's and head's sizes cross it, once per step, outside the tick
loops); Megatron puts the embedding on the first stage and the head on the
last, which an SPMD program can only approximate by masking.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jmegatron.sharding.rules import (ACT_EMBED, BATCH, SEQ, STAGES, active_mesh_and_rules,
                                     activation_sharding, constrain, logical_axes_of,
                                     mesh_axes_of)
from jmegatron.sharding.runners import ScanRunner, Stack, StackRunner

SCHEDULES = ("gpipe",)


def bubble(stages: int, microbatches: int) -> float:
    """The idle fraction of a GPipe step, (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class PipelineRunner(StackRunner):
    """Runs a stack [S, L/S, ...] as ``stages`` pipeline stages over ``microbatches``
    (the ``gpipe`` schedule: module docstring); each stage's layers by ``inner``."""

    stages: int = 2
    microbatches: int = 2
    inner: StackRunner = ScanRunner()
    schedule: str = "gpipe"

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}; choose one of "
                             f"{SCHEDULES}")
        if self.microbatches < self.stages:
            raise ValueError(f"{self.microbatches} microbatches for {self.stages} pipeline "
                             f"stages: every stage would idle; use --microbatches "
                             f">= {self.stages}")

    def __call__(self, stack: Stack, x: jax.Array) -> tuple[jax.Array, dict]:
        active = active_mesh_and_rules()
        axis = () if active is None else mesh_axes_of(STAGES, active[1])
        # Inside a map manual over the stages already (the loss's: train.step), each
        # device holds its own stage's [1, L/S, ...] blocks.
        inside = bool(axis) and set(axis) <= set(jax.sharding.get_abstract_mesh().manual_axes)
        leaves = stack.leaves
        if leaves[0].shape[0] != (1 if inside else self.stages):
            raise ValueError(f"a pipeline of {self.stages} stages got a stack of "
                             f"{leaves[0].shape[0]}: build the model with "
                             f"GPTConfig(stages={self.stages})")
        if stack.start or stack.n != stack.shape.layers:
            raise ValueError(f"a pipeline runs whole stacks, not layers {stack.start}.."
                             f"{stack.start + stack.n - 1} of {stack.shape.layers}: keep each "
                             f"kind of layer in one run (GPTConfig: moe.every=1)")
        if active is None:   # one device: the stages in turn
            return ScanRunner()(stack, x)
        mesh, rules = active
        m = self.microbatches
        b = x.shape[0] // m
        # Microbatch k takes rows k, k + M, ...: each device's rows split evenly.
        xm = constrain(x.reshape(b, m, *x.shape[1:]).swapaxes(0, 1),
                       (None, BATCH, SEQ, ACT_EMBED))
        per_stage = -(-stack.n // self.stages)   # real layers of a full stage

        def body(xm, blocks):
            with activation_sharding(jax.sharding.get_abstract_mesh(), rules):
                return self._ticks(stack, xm, [blk[0] for blk in blocks], axis, per_stage)

        if inside:   # every stage's stats on every stage: one stats-sized all-reduce
            y, stats = body(xm, leaves)
            stats = jax.tree.map(lambda a: _from_every_stage(a, axis, self.stages), stats)
        else:
            y, stats = jax.shard_map(body, mesh=mesh, in_specs=(P(), [P(axis)] * len(leaves)),
                                     out_specs=(P(), P(axis)), axis_names=set(axis))(xm, leaves)

        def in_layer_order(s):   # [S, M, per_stage, ...] -> [L, M, ...]: the real layers
            # in order (only the last stages end in padding, whose stats are dropped)
            return s.swapaxes(1, 2).reshape(-1, m, *s.shape[3:])[:stack.n]

        def in_batch_order(s):   # [L, M, b, ...] -> [L, B, ...]: the batch's rows
            return s.swapaxes(1, 2).reshape(stack.n, -1, *s.shape[3:])

        # Stats summed over the batch (MoE loads, losses) are per microbatch here:
        # their mean, as the train step's accumulation over microbatches takes it.
        stats = {k: in_layer_order(v).mean(axis=1) if k in stack.summed
                 else jax.tree.map(lambda a: in_batch_order(in_layer_order(a)), v)
                 for k, v in stats.items()}
        return y.swapaxes(0, 1).reshape(x.shape), stats

    def _ticks(self, stack: Stack, xm, blocks, axis, per_stage):
        """One stage's side of the schedule (inside ``shard_map``, manual over ``axis``):
        (the last stage's outputs [M, b, ...] on every stage, this stage's stats
        [1, M, L/S, b, ...])."""
        m, s_count = self.microbatches, self.stages
        stage = jax.lax.axis_index(axis)
        local = stack._replace(state=_one_stage(stack.state, blocks, per_stage), start=0,
                               n=per_stage)
        to_right = [(i, i + 1) for i in range(s_count - 1)]
        varying = lambda a: jax.lax.pcast(a, tuple(axis), to="varying")

        def run_stage(x):
            return self.inner(local, x)

        # Varying from here: the input's gradient is summed over the stages once, not
        # at every tick.
        xm = varying(xm)
        _, stats_shape = jax.eval_shape(run_stage, xm[0])
        outs = jnp.zeros_like(xm)
        stats = jax.tree.map(lambda a: varying(jnp.zeros((m, *a.shape), a.dtype)), stats_shape)

        def tick(carry, t):
            received, outs, stats = carry
            mine = t - stage                      # the microbatch this stage runs now
            valid = (mine >= 0) & (mine < m)
            slot = jnp.clip(mine, 0, m - 1)
            first = jax.lax.dynamic_index_in_dim(xm, jnp.minimum(t, m - 1), keepdims=False)
            y, st = run_stage(jnp.where(stage == 0, first, received))
            keep = lambda buf, new: jax.lax.dynamic_update_index_in_dim(
                buf, jnp.where(valid, new, jax.lax.dynamic_index_in_dim(buf, slot, 0, False)),
                slot, 0)
            outs = keep(outs, y)
            stats = jax.tree.map(keep, stats, st)
            return (jax.lax.ppermute(y, tuple(axis), to_right), outs, stats), None

        start = (jnp.zeros_like(xm[0]), outs, stats)
        (_, outs, stats), _ = jax.lax.scan(tick, start, jnp.arange(m + s_count - 1))
        last = jax.lax.psum(jnp.where(stage == s_count - 1, outs, 0), tuple(axis))
        return last, jax.tree.map(lambda a: a[None], stats)


def over_stages(fn, mesh: jax.sharding.Mesh, rules) -> Callable:
    """``fn(mesh, params, *args)`` run manual over the stage axis, as
    ``(params, *args) -> fn's outputs``: the leaves of ``params`` stacked over
    ``stages`` arrive as this stage's blocks [1, ...], every other leaf and
    argument whole; ``fn`` gets the stage's abstract mesh, and its outputs must be
    the same on every stage.

    The loss function runs so with pipeline stages (``train.make_loss_fn``): the
    embedding, head and loss are then one replicated computation per stage that
    XLA cannot split over the stage axis (left to it, it did, and moved weight-
    sized buffers across stages), and the pipeline inside runs on the blocks
    it is given (``PipelineRunner``)."""
    axis = mesh_axes_of(STAGES, rules)
    is_var = lambda v: isinstance(v, nnx.Variable)
    staged = lambda v: is_var(v) and (logical_axes_of(v) or (None,))[0] == STAGES

    def mapped(params, *args):
        specs = [P(axis) if staged(v) else P()
                 for v in jax.tree.leaves(params, is_leaf=is_var)]
        treedef = jax.tree.structure(params)

        def body(leaves, *args):
            return fn(jax.sharding.get_abstract_mesh(), treedef.unflatten(leaves), *args)

        return jax.shard_map(body, mesh=mesh, in_specs=(specs, *[P()] * len(args)),
                             out_specs=P(), axis_names=set(axis))(jax.tree.leaves(params),
                                                                  *args)
    return mapped


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
        [v.replace(b, out_sharding=logical_axes_of(v)[1:], real_layers=layers)
         for v, b in zip(variables, blocks)])
