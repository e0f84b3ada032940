"""Optimizer layouts: where params, gradients and matrix-optimizer state live,
and which device computes each matrix's update.

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
import math
from typing import ClassVar, Mapping

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jmegatron.sharding.pipeline import PipelineRunner
from jmegatron.sharding.rules import (BATCH, DEFAULT_RULES, EMBED, EXPERTS, LAYER_GROUPS, LAYERS,
                                     STAGES, Rules, logical_to_spec, mesh_axes_of, spec_axes,
                                     split_size, with_rules)
from jmegatron.sharding.runners import ScanRunner, ScatterRunner, StackRunner, default_runner

LAYOUTS = ("replicated", "layerwise", "fsdp", "owner")
ASSIGNMENTS = ("round_robin", "balanced")
# The owner layout's group, the ranks that each hold whole matrices of every group of
# layers: the ZeRO-3 axis (``fsdp``; the data ranks hold copies, as hybrid-sharded
# FSDP), or every batch rank but the experts' (``data+fsdp``: one group, as FSDP over
# both axes).
OWNER_GROUPS = ("fsdp", "data+fsdp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout resolved for a mesh shape: a small strategy object, one subclass per
    layout, that says where params and each matrix stack's state live. The plan
    (``jmegatron.optim.plan``) asks it and nothing else compares layout names."""

    name: ClassVar[str]
    rules: Rules                        # params and activations
    owner_axes: tuple[str, ...] = ()    # mesh axes a matrix stack is split over for its state
    owner_sizes: tuple[int, ...] = ()   # their sizes
    assignment: str = "round_robin"     # which owner gets which matrix (layerwise)
    stages: int = 1                     # pipeline stages (the mesh axes ``stages`` maps to)
    repeats: int = 1                    # chunks per stage of a circular pipeline
    schedule: str = "gpipe"             # the pipeline's (sharding.pipeline.SCHEDULES)

    @property
    def owners(self) -> int:
        """Ranks that own whole matrices (1: nobody does)."""
        return math.prod(self.owner_sizes)

    @property
    def layer_group(self) -> int:
        """Block weights stacked [G, g, ...] with g this; 1: [L, ...]."""
        return 1

    @property
    def label(self) -> str:
        """The layout as a log names it."""
        return self.name

    @property
    def stack_fields(self) -> dict[str, int]:
        """How the model must stack its blocks for this layout: the ``GPTConfig``
        fields ``layer_group``, ``stages`` and ``repeats``
        (``dataclasses.replace(cfg, **these)``)."""
        return {"layer_group": self.layer_group, "stages": self.stages,
                "repeats": self.repeats}

    def runner(self, prefetch: bool = False, keep_gathered: bool = False,
               microbatches: int = 1) -> StackRunner:
        """How the model's layer stacks run under this layout (``sharding.runners``):
        through the pipeline of ``microbatches`` where there are stages, each stage's
        layers by this layout's own runner. ``prefetch`` and ``keep_gathered`` are the
        owner layout's options (``GPTConfig``)."""
        inner = self.stage_runner(prefetch, keep_gathered)
        if self.stages == 1:
            return inner
        return PipelineRunner(stages=self.stages, microbatches=microbatches, inner=inner,
                              repeats=self.repeats, schedule=self.schedule)

    def stage_runner(self, prefetch: bool, keep_gathered: bool) -> StackRunner:
        """The runner of one stage's layers (all of them without a pipeline)."""
        return ScanRunner()

    def param_spec(self, logical: tuple) -> P:
        return logical_to_spec(logical, self.rules)

    def state_spec(self, logical: tuple, batch_dims: tuple[int, ...]) -> P:
        """Sharding of a matrix stack's optimizer state (``batch_dims``: the axes
        stacking its matrices): the param's."""
        return self.param_spec(logical)

    def stack_dim(self, logical: tuple, batch_dims: tuple[int, ...]) -> int | None:
        """The dim of a matrix stack that owners share out (None: no stack): the first
        of ``batch_dims``, or after the pipeline stages' dim."""
        if not batch_dims:
            return None
        return batch_dims[1] if logical[batch_dims[0]] == STAGES else batch_dims[0]

    def stack_owners(self, state: P, stack_dim: int) -> int:
        """Ranks a stack's matrices are shared out over in ``state``, each holding whole
        matrices of its own and the stack padded to a multiple of them (1: none)."""
        return 1

    def check_matrix(self, path: str, logical: tuple) -> None:
        """Raises ValueError if a matrix leaf with ``logical`` axes cannot live here."""

    def masters_on_owners(self, compute_dtype, grad_dtype, stack_owners: int,
                          dealt: bool) -> bool:
        """Whether a matrix stack's fp32 params live with its state on its
        ``stack_owners`` (split in contiguous blocks, not ``dealt``), the train step
        gathering them once, cast to ``compute_dtype``, for the model
        (``ShardingPlan.model_weights``), whose gradients are in ``grad_dtype``;
        else they live as ``param_spec`` says."""
        return False


class Replicated(Layout):
    name = "replicated"


class FSDP(Layout):
    name = "fsdp"


class Layerwise(Layout):
    name = "layerwise"

    def stage_runner(self, prefetch: bool, keep_gathered: bool) -> StackRunner:
        # The layers send their gradients to the owners (sharding.scatter).
        return ScatterRunner(owners=self.owner_axes)

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


class Owner(Layout):
    name = "owner"

    @property
    def layer_group(self) -> int:
        return self.owners

    @property
    def label(self) -> str:
        return f"{self.name} (owner group: {' x '.join(self.owner_axes) or 'none'})"

    def stage_runner(self, prefetch: bool, keep_gathered: bool) -> StackRunner:
        return default_runner(self.layer_group, prefetch, keep_gathered)

    def check_matrix(self, path: str, logical: tuple) -> None:
        if self.owners > 1 and LAYER_GROUPS not in logical[:2]:
            raise ValueError(f"the owner layout needs block weights stacked [L/f, f, ...], but "
                             f"{path} has logical axes {logical}: build the model with "
                             f"GPTConfig(layer_group={self.layer_group})")


def make_layout(name: str, mesh_shape: Mapping[str, int], rules: Rules = DEFAULT_RULES,
                assignment: str = "round_robin", repeats: int = 1,
                schedule: str | None = None, owner_group: str = "fsdp") -> Layout:
    """The layout ``name`` for a mesh of ``mesh_shape``, built on Megatron's ``rules``;
    under layerwise, matrices are owned by ``assignment`` (round_robin, or
    balanced: see ``jmegatron.optim.owners.stack_offsets``); under owner, by the
    ranks of ``owner_group`` (``OWNER_GROUPS``); with pipeline stages, ``repeats``
    chunks per stage make the pipeline circular, and ``schedule`` (None: circular
    with repeats, else gpipe) may choose 1f1b."""
    if repeats != 1 or schedule is not None:
        return dataclasses.replace(make_layout(name, mesh_shape, rules, assignment,
                                               owner_group=owner_group),
                                   repeats=repeats,
                                   schedule=schedule or ("circular" if repeats > 1 else "gpipe"))
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose one of {LAYOUTS}")
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"unknown assignment {assignment!r}; choose one of {ASSIGNMENTS}")
    if owner_group not in OWNER_GROUPS:
        raise ValueError(f"unknown owner group {owner_group!r}; choose one of {OWNER_GROUPS}")
    live = lambda axes: tuple(a for a in axes if mesh_shape.get(a, 1) > 1)
    sizes = lambda axes: tuple(mesh_shape[a] for a in axes)
    stages = split_size(mesh_shape, rules, STAGES)
    replicated_params = with_rules(rules, embed=None)
    if name == "replicated":
        return Replicated(replicated_params, stages=stages)
    if name == "layerwise":   # the ranks that hold different data own the matrices
        owners = live(mesh_axes_of(BATCH, rules))
        return Layerwise(replicated_params, owners, sizes(owners), assignment, stages)
    if name == "fsdp":
        return FSDP(rules, stages=stages)
    # The ZeRO-3 axes own whole matrices. The stack axis takes them; block weights'
    # embed axis then stays whole (a mesh axis splits an array once), while the
    # embedding and head keep their element-wise split.
    zero3 = mesh_axes_of(EMBED, rules)
    if owner_group == "data+fsdp":
        zero3 = owner_group_axes(mesh_shape, rules)
        rules = with_rules(rules, **{EMBED: zero3 or None})
    return Owner(with_rules(rules, **{LAYERS: zero3 or None}), live(zero3), sizes(live(zero3)),
                 stages=stages)


def owner_group_axes(mesh_shape: Mapping[str, int], rules: Rules = DEFAULT_RULES
                     ) -> tuple[str, ...]:
    """The mesh axes of the ``data+fsdp`` owner group, in the mesh's order: the ZeRO-3
    axes and every other live batch axis but the experts'."""
    zero3, experts = mesh_axes_of(EMBED, rules), mesh_axes_of(EXPERTS, rules)
    return tuple(a for a in mesh_axes_of(BATCH, rules)
                 if a in zero3 or (a not in experts and mesh_shape.get(a, 1) > 1))
