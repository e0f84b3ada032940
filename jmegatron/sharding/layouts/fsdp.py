"""The fsdp layout.

ZeRO-3: params and state split element-wise over ``fsdp``
(along ``embed``); Newton-Schulz first gathers each whole
matrix on every rank ("stock FSDP-Muon", the baseline).
With pipeline stages and ``--model.keep-gathered``, a stage's
weights are gathered once a step and their gradients
reduce-scattered once (``Layout.pipeline_batch_axes``);
without it, once per microbatch.
"""

from __future__ import annotations

from jmegatron.sharding.layouts.base import Layout, live_axes
from jmegatron.sharding.rules import EMBED, STAGES, mesh_axes_of, split_size
from jmegatron.sharding.traffic import LeafTraffic, RunOptions, Transfer, ring, sharded


class FSDP(Layout):
    name = "fsdp"
    options = ("keep_gathered",)

    @classmethod
    def for_mesh(cls, mesh_shape, rules, assignment, owner_group) -> Layout:
        return cls(rules, stages=split_size(mesh_shape, rules, STAGES))

    @classmethod
    def variants(cls, mesh_shape, rules, prefetch) -> list[dict]:
        """Where a ZeRO-3 axis is live (else it is replicated)."""
        return [{}] if live_axes(mesh_shape, mesh_axes_of(EMBED, rules)) else []

    def _options_refusal(self, model, mesh_shape) -> str | None:
        """``keep_gathered`` keeps a pipeline stage's weights gathered for the step, which
        needs a stage map manual over the batch axes (``pipeline_batch_axes``)."""
        if model.keep_gathered and not self.pipeline_batch_axes(model, mesh_shape):
            return ("--model.keep-gathered under fsdp keeps each pipeline stage's weights "
                    "gathered for the step: it needs --mesh.stage > 1, no live mesh axis but "
                    "the stage and batch axes, and experts not split (--mesh.expert 1)")
        return super()._options_refusal(model, mesh_shape)

    def traffic(self, leaf: LeafTraffic, run: RunOptions) -> list[Transfer]:
        """Per layer: gathered for the forward and again for the backward in the compute
        dtype, gradients reduce-scattered, then all-reduced over the other batch ranks;
        matrices gathered once more, whole, for the optimizer ("stock FSDP-Muon")."""
        out = sharded(leaf, 2, leaf.layers, leaf.used)
        if leaf.matrix_flops:
            out += ring("all-gather", leaf.gathered, leaf, leaf.used, leaf.master, 1)
        return out
