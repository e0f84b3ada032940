"""Optimizer layouts: where params, gradients and matrix-optimizer state live,
and which device computes each matrix's update; one class each (``base.Layout``),
in a module of its own:

  replicated  params and state replicated over the data axes (plain data
              parallelism); every rank runs every Newton-Schulz.
  layerwise   Megatron's distributed optimizer: params replicated; the state
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
  fsdp        ZeRO-3: params and state split element-wise over ``fsdp``
              (along ``embed``); Newton-Schulz first gathers each whole
              matrix on every rank ("stock FSDP-Muon", the baseline).
  owner       MatrixFSDP: params and state of each whole matrix live on one
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

Tensor parallelism composes with all four (the tensor axis keeps Megatron's
rules; see ``jmegatron.optim.tensor_parallel``), and so do pipeline stages:
each layout's ``runner`` then runs the stacks through the pipeline
(``jmegatron.sharding.pipeline``), each stage's layers as the layout runs a
stack, and its matrices' owners are ranks of that stage's own group.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jmegatron.sharding.layouts.base import (ASSIGNMENTS, MODEL_FLAGS, OWNER_GROUPS, Layout,
                                            layout_label)
from jmegatron.sharding.layouts.fsdp import FSDP
from jmegatron.sharding.layouts.layerwise import Layerwise
from jmegatron.sharding.layouts.owner import Owner, owner_group_axes
from jmegatron.sharding.layouts.replicated import Replicated
from jmegatron.sharding.rules import DEFAULT_RULES, Rules

__all__ = ["ASSIGNMENTS", "FSDP", "LAYOUTS", "LAYOUT_CLASSES", "Layerwise", "Layout",
           "MODEL_FLAGS", "OWNER_GROUPS", "Owner", "Replicated", "layout_label", "make_layout",
           "owner_group_axes"]

# Every layout by name, as --layout names it.
LAYOUT_CLASSES: dict[str, type[Layout]] = {
    cls.name: cls for cls in (Replicated, Layerwise, FSDP, Owner)}
LAYOUTS = tuple(LAYOUT_CLASSES)


def make_layout(name: str, mesh_shape: Mapping[str, int], rules: Rules = DEFAULT_RULES,
                assignment: str = "round_robin", repeats: int = 1,
                schedule: str | None = None, owner_group: str = "fsdp") -> Layout:
    """The layout ``name`` for a mesh of ``mesh_shape``, built on Megatron's ``rules``;
    under layerwise, matrices are owned by ``assignment`` (round_robin, or
    balanced: see ``jmegatron.optim.owners.stack_offsets``); under owner, by the
    ranks of ``owner_group`` (``OWNER_GROUPS``); with pipeline stages, ``repeats``
    chunks per stage make the pipeline circular, and ``schedule`` (None: circular
    with repeats, else gpipe) may choose 1f1b."""
    if name not in LAYOUT_CLASSES:
        raise ValueError(f"unknown layout {name!r}; choose one of {LAYOUTS}")
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"unknown assignment {assignment!r}; choose one of {ASSIGNMENTS}")
    if owner_group not in OWNER_GROUPS:
        raise ValueError(f"unknown owner group {owner_group!r}; choose one of {OWNER_GROUPS}")
    layout = LAYOUT_CLASSES[name].for_mesh(mesh_shape, rules, assignment, owner_group)
    if repeats == 1 and schedule is None:
        return layout
    return dataclasses.replace(layout, repeats=repeats,
                               schedule=schedule or ("circular" if repeats > 1 else "gpipe"))
