"""The fsdp layout.

ZeRO-3: params and state split element-wise over ``fsdp``
(along ``embed``); Newton-Schulz first gathers each whole
matrix on every rank ("stock FSDP-Muon", the baseline).
"""

from __future__ import annotations

from jmegatron.sharding.layouts.base import Layout, live_axes
from jmegatron.sharding.rules import EMBED, STAGES, mesh_axes_of, split_size
from jmegatron.sharding.traffic import LeafTraffic, RunOptions, Transfer, ring, sharded


class FSDP(Layout):
    name = "fsdp"

    @classmethod
    def for_mesh(cls, mesh_shape, rules, assignment, owner_group) -> Layout:
        return cls(rules, stages=split_size(mesh_shape, rules, STAGES))

    @classmethod
    def variants(cls, mesh_shape, rules, prefetch) -> list[dict]:
        """Where a ZeRO-3 axis is live (else it is replicated)."""
        return [{}] if live_axes(mesh_shape, mesh_axes_of(EMBED, rules)) else []

    def traffic(self, leaf: LeafTraffic, run: RunOptions) -> list[Transfer]:
        """Per layer: gathered for the forward and again for the backward in the compute
        dtype, gradients reduce-scattered, then all-reduced over the other batch ranks;
        matrices gathered once more, whole, for the optimizer ("stock FSDP-Muon")."""
        out = sharded(leaf, 2, leaf.layers, leaf.used)
        if leaf.matrix_flops:
            out += ring("all-gather", leaf.gathered, leaf, leaf.used, leaf.master, 1)
        return out
