"""The owner layout.

MatrixFSDP: params and state of each whole matrix live on one
``fsdp`` rank. Block weights are stacked [G, f, ...] with the
f axis split over ``fsdp`` (round-robin: layer l on rank l % f;
G = ceil(L / f), the last group padded with layers the forward
skips); the forward gathers one group of f layers at a time and
the backward reduce-scatters their gradients back to the owners
(MoE stacks: XLA's collectives, see ``rules.run_constrained``),
so the optimizer step needs no communication. Non-matrix params
(embedding, head, norms) stay element-wise ZeRO-3: for AdamW's
element-wise step, whole "tail" owners would only hold and move
more (``experiments.bench_layouts`` prints both).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jmegatron.sharding.layouts.base import (Layout, alternating, axes_named, layout_label,
                                            live_axes)
from jmegatron.sharding.rules import (BATCH, DEFAULT_RULES, EMBED, EXPERTS, LAYER_GROUPS, LAYERS,
                                     STAGES, Rules, mesh_axes_of, only_batch_axes_live,
                                     split_size, with_rules)
from jmegatron.sharding.runners import StackRunner, default_runner
from jmegatron.sharding.traffic import LeafTraffic, RunOptions, Transfer, sharded


@dataclasses.dataclass(frozen=True)
class Owner(Layout):
    name = "owner"
    options = ("owner_group", "prefetch", "keep_gathered")
    group: str = "fsdp"    # the owner group as --owner-group names it (OWNER_GROUPS)

    @classmethod
    def for_mesh(cls, mesh_shape, rules, assignment, owner_group) -> Layout:
        """The ZeRO-3 axes (or the ``data+fsdp`` group) own whole matrices. The stack
        axis takes them; block weights' embed axis then stays whole (a mesh axis
        splits an array once), while the embedding and head keep their element-wise
        split."""
        zero3 = mesh_axes_of(EMBED, rules)
        if owner_group == "data+fsdp":
            zero3 = owner_group_axes(mesh_shape, rules)
            rules = with_rules(rules, **{EMBED: zero3 or None})
        owners = live_axes(mesh_shape, zero3)
        return cls(with_rules(rules, **{LAYERS: zero3 or None}), owners,
                   tuple(mesh_shape[a] for a in owners),
                   stages=split_size(mesh_shape, rules, STAGES), group=owner_group)

    @classmethod
    def variants(cls, mesh_shape, rules, prefetch) -> list[dict]:
        """Over ``fsdp`` where a ZeRO-3 axis is live; over ``data+fsdp`` where that group
        has another live axis; with ``prefetch``, each also prefetched where only
        batch axes are live (``rules.only_batch_axes_live``)."""
        zero3 = mesh_axes_of(EMBED, rules)
        wider = set(owner_group_axes(mesh_shape, rules)) - set(zero3)
        groups = [g for g, axes in (("fsdp", zero3), ("data+fsdp", wider))
                  if live_axes(mesh_shape, axes)]
        fetch = (False, True) if prefetch and only_batch_axes_live(mesh_shape, rules) else (False,)
        return [{"owner_group": g, "prefetch": f} for g in groups for f in fetch]

    @property
    def layer_group(self) -> int:
        return self.owners

    @property
    def label(self) -> str:
        return layout_label(self.name, self.group)

    def _stacking_refusal(self, model, microbatches: int) -> str | None:
        if why := super()._stacking_refusal(model, microbatches):
            return why
        if self.layer_group > 1 and alternating(model):
            return (f"the owner layout gathers each group of {self.layer_group} layers whole, "
                    f"but the MoE layers alternate with dense ones (--model.moe.every "
                    f"{model.moe.every}): set --model.moe.every 1, or --layout layerwise, "
                    "fsdp or replicated")
        return None

    def _options_refusal(self, model, mesh_shape: Mapping[str, int]) -> str | None:
        """Prefetch issues each group's gather from a ``shard_map`` manual over the batch
        axes (``rules.only_batch_axes_live``) and needs groups to gather."""
        if not model.prefetch:
            return None
        batch = set(mesh_axes_of(BATCH, self.rules))
        others = [a for a, n in mesh_shape.items() if n > 1 and a not in batch]
        if others:
            return (f"--model.prefetch gathers each owner group from a map manual over the "
                    f"batch axes, so every other mesh axis must be 1: set "
                    + " and ".join(f"--mesh.{a} 1" for a in others)
                    + f" (got {axes_named(mesh_shape, others)}), or drop --model.prefetch")
        if self.layer_group == 1:
            return ("--model.prefetch prefetches owner groups, but this mesh's owner group "
                    f"({self.group}) has one rank: drop --model.prefetch")
        return None

    def stage_runner(self, prefetch: bool, keep_gathered: bool) -> StackRunner:
        return default_runner(self.layer_group, prefetch, keep_gathered)

    def sums_gradients_manually(self, mesh_shape: Mapping[str, int]) -> bool:
        return only_batch_axes_live(mesh_shape, self.rules)

    def traffic(self, leaf: LeafTraffic, run: RunOptions) -> list[Transfer]:
        """Like fsdp, but a group of f layers is gathered at once; the backward gathers
        again with more than one group (not with ``keep_gathered``), and always where
        the groups move by XLA's sharding constraints or are prefetched (prefetch
        gathers every group in both passes, ``sharding.prefetch``; so does
        ``run_constrained``, even one group: measured on the default run's compiled
        step); the optimizer gathers nothing."""
        stack = leaf.owners > 1
        again = ((stack and (run.prefetch or not run.manual))
                 or (leaf.groups > 1 and not run.keep_gathered))
        return sharded(leaf, 2 if again else 1, leaf.groups, leaf.used * leaf.padding)

    def check_matrix(self, path: str, logical: tuple) -> None:
        if self.owners > 1 and LAYER_GROUPS not in logical[:2]:
            raise ValueError(f"the owner layout needs block weights stacked [L/f, f, ...], but "
                             f"{path} has logical axes {logical}: build the model with "
                             f"GPTConfig(layer_group={self.layer_group})")


def owner_group_axes(mesh_shape: Mapping[str, int], rules: Rules = DEFAULT_RULES
                     ) -> tuple[str, ...]:
    """The mesh axes of the ``data+fsdp`` owner group, in the mesh's order: the ZeRO-3
    axes and every other live batch axis but the experts'."""
    zero3, experts = mesh_axes_of(EMBED, rules), mesh_axes_of(EXPERTS, rules)
    return tuple(a for a in mesh_axes_of(BATCH, rules)
                 if a in zero3 or (a not in experts and mesh_shape.get(a, 1) > 1))
