"""The replicated layout.

Params and state replicated over the data axes (plain data
parallelism); every rank runs every Newton-Schulz.
"""

from __future__ import annotations

from jmegatron.sharding.layouts.base import Layout, params_replicated
from jmegatron.sharding.rules import STAGES, split_size
from jmegatron.sharding.traffic import LeafTraffic, RunOptions, Transfer, all_reduced


class Replicated(Layout):
    name = "replicated"

    @classmethod
    def for_mesh(cls, mesh_shape, rules, assignment, owner_group) -> Layout:
        return cls(params_replicated(rules), stages=split_size(mesh_shape, rules, STAGES))

    def traffic(self, leaf: LeafTraffic, run: RunOptions) -> list[Transfer]:
        """Gradients all-reduced over the ranks holding copies."""
        return all_reduced(leaf)
