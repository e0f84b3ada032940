"""Optimizer layouts: where params, gradients and matrix-optimizer state live,
and which device computes each matrix's update; one class each (``base.Layout``),
in a module of its own:

  replicated  plain data parallelism (``replicated.py``);
  layerwise   Megatron's distributed optimizer: each whole matrix's state on one
              data rank (``layerwise.py``);
  fsdp        ZeRO-3, element-wise over ``fsdp`` (``fsdp.py``);
  owner       MatrixFSDP: each whole matrix on one ``fsdp`` rank, so the optimizer
              step needs no communication (``owner.py``).

Each module's docstring says where its params, gradients and state live.
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
           "owner_group_axes", "takers"]

# Every layout by name, as --layout names it.
LAYOUT_CLASSES: dict[str, type[Layout]] = {
    cls.name: cls for cls in (Replicated, Layerwise, FSDP, Owner)}
LAYOUTS = tuple(LAYOUT_CLASSES)


def takers(option: str) -> str:
    """The layouts that take run option ``option`` (``Layout.options``), as an error
    message names them: "owner (or auto)"."""
    names = [name for name, cls in LAYOUT_CLASSES.items() if option in cls.options]
    return " or ".join(names) + " (or auto)"


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
