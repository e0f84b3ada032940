"""The layerwise layout.

Megatron's distributed optimizer: params replicated; the state
of each whole matrix lives on one data rank (the stack axis of
every matrix stack split over the data axes, padded when it
does not divide, and Muon skips the padding; MoE expert stacks
keep `expert` and split their layers over the other data axes);
``assignment`` says which rank owns which matrix where the owners
do not divide a stack; gradients reach the owners (a dense stack
the owners divide by one reduce-scatter: ``sharding.scatter``),
owners compute the update, updated params are all-gathered. A
model computing in bf16 keeps the fp32 params of stacks their
owners divide on those owners, with their state (Megatron's
fp32 masters), and each step gathers them once, in bf16
(``masters_on_owners``, ``ShardingPlan.model_weights``).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jmegatron.sharding.layouts.base import Layout, live_axes, params_replicated
from jmegatron.sharding.rules import (BATCH, STAGES, axis_roles, logical_to_spec, mesh_axes_of,
                                     only_batch_axes_live, spec_axes, split_size)
from jmegatron.sharding.runners import ScatterRunner, StackRunner
from jmegatron.sharding.traffic import LeafTraffic, RunOptions, Transfer, all_reduced, ring


class Layerwise(Layout):
    name = "layerwise"

    @classmethod
    def for_mesh(cls, mesh_shape, rules, assignment, owner_group) -> Layout:
        """The ranks that hold different data own the matrices."""
        owners = live_axes(mesh_shape, mesh_axes_of(BATCH, rules))
        return cls(params_replicated(rules), owners, tuple(mesh_shape[a] for a in owners),
                   assignment, split_size(mesh_shape, rules, STAGES))

    @classmethod
    def variants(cls, mesh_shape, rules, prefetch) -> list[dict]:
        """Where a batch axis is live (else it is replicated)."""
        return [{}] if live_axes(mesh_shape, axis_roles(rules).batch) else []

    def stage_runner(self, prefetch: bool, keep_gathered: bool) -> StackRunner:
        # The layers send their gradients to the owners (sharding.scatter).
        return ScatterRunner(owners=self.owner_axes)

    def sums_gradients_manually(self, mesh_shape: Mapping[str, int]) -> bool:
        return only_batch_axes_live(mesh_shape, self.rules)

    def traffic(self, leaf: LeafTraffic, run: RunOptions) -> list[Transfer]:
        """Matrix stacks: gradients reduce-scattered to their owners (all-reduced where
        dealt round-robin, each owner keeping its own), updated params all-gathered in
        the master dtype, or the masters on their owners in the compute dtype
        (``masters_on_owners``); other leaves as replicated."""
        if leaf.owners <= 1:
            return all_reduced(leaf)
        width = leaf.wire if leaf.masters_on_owners else leaf.master
        gather = ring("all-gather", leaf.reduced, leaf, leaf.used * leaf.padding, width, 1)
        if leaf.layers % leaf.owners:
            return all_reduced(leaf) + gather
        return ring("reduce-scatter", leaf.reduced, leaf, leaf.used, leaf.summed, 1) + gather

    def state_spec(self, logical: tuple, batch_dims: tuple[int, ...]) -> P:
        """The param's, except that the stack dim (``stack_dim``: the first batch dim
        after any pipeline stages) is split over the owner axes the param does not
        already use (MoE experts keep `expert`: each expert rank's
        data ranks then share out its experts' layers)."""
        if not batch_dims:
            return self.param_spec(logical)
        entries = list(logical_to_spec(logical, self.rules))
        entries += [None] * (len(logical) - len(entries))
        taken = {a for e in entries for a in spec_axes(e)}
        free = tuple(a for a in self.owner_axes if a not in taken)
        dim = self.stack_dim(logical, batch_dims)
        if spec_axes(entries[dim]):
            raise ValueError(f"the layerwise layout splits the stack dim of {logical} over "
                             f"{free}, but it is already split over {entries[dim]}")
        entries[dim] = free or None
        return P(*entries)

    def pipeline_gradient_spec(self, logical: tuple, shape: tuple[int, ...]) -> P:
        """A stage's stacked weights [S, n, ...]: their gradient reduce-scattered over the
        owners along n, where they divide it (each then holds its contiguous block, as
        ``state_spec`` places a matrix stack's state: the optimizer slices nothing;
        a norm's, replicated state gathers its block back, an all-reduce's bytes);
        else as the param lies (all-reduced)."""
        owners = math.prod(self.owner_sizes)
        if owners == 1 or len(logical) < 2 or logical[0] != STAGES or shape[1] % owners:
            return self.param_spec(logical)
        return self.state_spec(logical, (0, 1))   # the stack dim after the stages'

    def stack_owners(self, state: P, stack_dim: int) -> int:
        sizes = dict(zip(self.owner_axes, self.owner_sizes))
        entry = tuple(state)[stack_dim] if stack_dim < len(state) else None
        return math.prod(sizes.get(a, 1) for a in spec_axes(entry))

    def masters_on_owners(self, compute_dtype, grad_dtype, stack_owners: int,
                          dealt: bool) -> bool:
        """Megatron's distributed optimizer: where the model computes, and sums its
        gradients, in a narrower dtype than its fp32 masters, those live only on their
        matrices' owners, and the step gathers them in the compute dtype (a bf16
        model: half the bytes of gathering fp32 updates). Not for fp32 gradients (the
        model's bf16 copy would take bf16 ones), nor for stacks dealt round-robin,
        whose state is padded and reordered, nor under pipeline stages, whose stacks
        the stages' runners take whole."""
        narrower = max(jnp.dtype(compute_dtype).itemsize,
                       jnp.dtype(grad_dtype).itemsize) < jnp.dtype(jnp.float32).itemsize
        return narrower and stack_owners > 1 and not dealt and self.stages == 1
