"""Optimizer layouts: where params, gradients and matrix-optimizer state live,
and which device computes each matrix's update.

  replicated  params and state replicated over the data axes (plain data
              parallelism); every rank runs every Newton-Schulz.
  layerwise   Megatron's distributed optimizer: params replicated; the state
              of each whole matrix lives on one data rank (the stack axis of
              every matrix stack split over the data axes, padded when it
              does not divide); gradients reach the owners (reduce-scatter),
              owners compute the update, updated params are all-gathered.
  fsdp        ZeRO-3: params and state split element-wise over ``fsdp``
              (along ``embed``); Newton-Schulz first gathers each whole
              matrix on every rank ("stock FSDP-Muon", the baseline).
  owner       MatrixFSDP: params and state of each whole matrix live on one
              ``fsdp`` rank. Block weights are stacked [L/f, f, ...] with the
              f axis split over ``fsdp`` (round-robin: layer l on rank l % f);
              the forward gathers one group of f layers at a time and the
              backward reduce-scatters their gradients back to the owners, so
              the optimizer step needs no communication. Non-matrix params
              (embedding, head, norms) stay element-wise ZeRO-3.

Tensor parallelism composes with all four (the tensor axis keeps Megatron's
rules; see ``jmegatron.optim.tensor_parallel``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from jax.sharding import PartitionSpec as P

from jmegatron.sharding.mesh import BATCH_AXES
from jmegatron.sharding.rules import DEFAULT_RULES, LAYERS, Rules, logical_to_spec, with_rules

LAYOUTS = ("replicated", "layerwise", "fsdp", "owner")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout resolved for a mesh shape."""

    name: str
    rules: Rules                    # params and activations
    owner_axes: tuple[str, ...]     # mesh axes a matrix stack is split over for its state
    layer_group: int                # block weights stacked [L/g, g, ...]; 1: [L, ...]
    owners: int                     # ranks that own whole matrices (1: nobody does)

    def param_spec(self, logical: tuple) -> P:
        return logical_to_spec(logical, self.rules)

    def state_spec(self, logical: tuple, batch_dims: tuple[int, ...]) -> P:
        """Sharding of a matrix stack's optimizer state: the param's, except that
        under ``layerwise`` the leading batch dim is split over the owners."""
        if self.name != "layerwise" or not batch_dims:
            return self.param_spec(logical)
        entries = list(logical_to_spec(logical, self.rules))
        entries += [None] * (len(logical) - len(entries))
        taken = {a for e in entries for a in ((e,) if isinstance(e, str) else e or ())}
        if taken & set(self.owner_axes):
            raise ValueError(f"the layerwise layout splits each matrix stack over "
                             f"{self.owner_axes}, but a stack with axes {logical} already "
                             f"uses {sorted(taken & set(self.owner_axes))} (MoE experts over "
                             "`expert`): use the fsdp or replicated layout for MoE models")
        entries[batch_dims[0]] = self.owner_axes or None
        return P(*entries)


def make_layout(name: str, mesh_shape: Mapping[str, int], rules: Rules = DEFAULT_RULES) -> Layout:
    """The layout ``name`` for a mesh of ``mesh_shape``, built on Megatron's ``rules``."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose one of {LAYOUTS}")
    live = lambda axes: tuple(a for a in axes if mesh_shape.get(a, 1) > 1)
    size = lambda axes: math.prod(mesh_shape[a] for a in axes)
    replicated_params = with_rules(rules, embed=None)
    if name == "replicated":
        return Layout(name, replicated_params, (), 1, 1)
    if name == "layerwise":
        owners = live(BATCH_AXES)
        return Layout(name, replicated_params, owners, 1, size(owners))
    if name == "fsdp":
        return Layout(name, rules, (), 1, 1)
    owners = live(("fsdp",))
    # The stack axis takes fsdp; block weights' embed axis then stays whole
    # (a mesh axis splits an array once), while the embedding and head keep
    # their element-wise fsdp split.
    return Layout(name, with_rules(rules, **{LAYERS: "fsdp"}), owners, size(owners), size(owners))


