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
                                     STAGES, VOCAB, Rules, check_vocab_apart_from_batch,
                                     indivisible, logical_to_spec, mesh_axes_of,
                                     only_batch_axes_live, spec_axes, split_size, with_rules)
from jmegatron.sharding.runners import ScanRunner, ScatterRunner, StackRunner, default_runner
from jmegatron.sharding.traffic import (LeafTraffic, RunOptions, Transfer, all_reduced, ring,
                                        sharded)

ASSIGNMENTS = ("round_robin", "balanced")
# The owner layout's group, the ranks that each hold whole matrices of every group of
# layers: the ZeRO-3 axis (``fsdp``; the data ranks hold copies, as hybrid-sharded
# FSDP), or every batch rank but the experts' (``data+fsdp``: one group, as FSDP over
# both axes).
OWNER_GROUPS = ("fsdp", "data+fsdp")
# The option that sets each logical axis a model splits (in a layout's refusals).
MODEL_FLAGS = {"embed": "--model.d-model", "mlp": "--model.d-ff (or --model.moe.d-ff)",
               "heads": "--model.n-heads", "kv_heads": "--model.n-kv-heads",
               "head_dim": "--model.head-dim", "experts": "--model.moe.n-experts",
               "layer_groups": "--model.n-layers", "layers": "--model.n-layers"}


def layout_label(name: str, owner_group: str = "fsdp", prefetch: bool = False) -> str:
    """A layout as the log, ``--layout auto``'s line and the benchmarks name it: owner
    with its group as ``--owner-group`` spells it where that is not fsdp, and prefetch."""
    if name != "owner":
        return name
    return (name + ("" if owner_group == "fsdp" else f" over {owner_group}")
            + ("+prefetch" if prefetch else ""))


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

    @classmethod
    def for_mesh(cls, mesh_shape: Mapping[str, int], rules: Rules, assignment: str,
                 owner_group: str) -> "Layout":
        """This layout on a mesh of ``mesh_shape``, built on ``rules`` (``make_layout``
        checks the options; ``assignment`` is layerwise's, ``owner_group`` owner's)."""
        raise NotImplementedError(f"the {cls.name} layout cannot be built")

    def check(self, model, mesh_shape: Mapping[str, int], batch_size: int,
              microbatches: int = 1) -> str | None:
        """None if this layout can run ``model`` (a ``GPTConfig`` as the user set it:
        not yet stacked for a layout, its ``prefetch`` and ``keep_gathered`` included)
        on a mesh of ``mesh_shape`` with a global batch of ``batch_size`` in
        ``microbatches``; else the one-line reason, naming the option to change. The
        only place a layout refuses a run: the trainer raises it, and ``--layout
        auto`` skips a candidate that has one."""
        checks = (lambda: self._stacking_refusal(model, microbatches),
                  lambda: self._options_refusal(model, mesh_shape),
                  lambda: self._sharding_refusal(model, mesh_shape, batch_size, microbatches))
        # In order, each only once the earlier ones pass (the last builds the stacked model).
        return next((why for why in (c() for c in checks) if why), None)

    def model_for(self, model, mesh_shape: Mapping[str, int]):
        """``model`` as this layout runs it on a mesh of ``mesh_shape``: its vocabulary
        padded for the vocab-parallel axes, its blocks stacked (``stack_fields``)."""
        padded = model.pad_vocab(split_size(mesh_shape, self.rules, VOCAB))
        return dataclasses.replace(padded, **self.stack_fields)

    def _stacking_refusal(self, model, microbatches: int) -> str | None:
        """What the layout's stacks of layers cannot hold: pipeline stages (or a schedule
        without them) here, and the owner layout's groups."""
        if self.stages == 1:
            return (None if self.schedule == "gpipe" else
                    f"--pipeline.schedule {self.schedule} needs pipeline stages: set "
                    "--mesh.stage 2 or more (or leave --pipeline.schedule gpipe)")
        if microbatches < self.stages:
            return (f"--mesh.stage {self.stages} needs --microbatches >= {self.stages} "
                    f"(got {microbatches}): every stage would idle")
        if self.stages * self.repeats > model.n_layers:
            repeats = f" x --pipeline.repeats {self.repeats}" * (self.repeats > 1)
            return (f"--mesh.stage {self.stages}{repeats} makes {self.stages * self.repeats} "
                    f"pipeline chunks for {model.n_layers} layers: use at most one chunk per "
                    "layer (lower --mesh.stage or --pipeline.repeats, or raise "
                    "--model.n-layers)")
        if _alternating(model):
            return (f"pipeline stages run each kind of layer as one stack, but the MoE layers "
                    f"alternate with dense ones (--model.moe.every {model.moe.every}): set "
                    "--model.moe.every 1 (or --mesh.stage 1)")
        if self.schedule == "1f1b" and len(set(model.moe_layers)) > 1:
            return (f"the 1f1b schedule runs one layer stack, but the first "
                    f"{model.moe.first_dense} layers are dense and the rest MoE: set "
                    "--model.moe.first-dense 0 (or --pipeline.schedule gpipe)")
        return None

    def _options_refusal(self, model, mesh_shape: Mapping[str, int]) -> str | None:
        """The owner layout's options (``GPTConfig.prefetch``, ``keep_gathered``)
        under a layout that has no use for them."""
        given = [f"--model.{f.replace('_', '-')}" for f in ("prefetch", "keep_gathered")
                 if getattr(model, f)]
        return (f"{given[0]} applies to --layout owner (or auto), not {self.name}"
                if given else None)

    def _sharding_refusal(self, model, mesh_shape: Mapping[str, int], batch_size: int,
                          microbatches: int) -> str | None:
        """A dim of the stacked model, or of a microbatch, its mesh axes do not divide."""
        rows = math.prod(mesh_shape.get(a, 1) for a in mesh_axes_of(BATCH, self.rules))
        if (batch_size // microbatches) % rows:
            each = f" in {microbatches} microbatches" if microbatches > 1 else ""
            return (f"--batch-size {batch_size}{each} does not split over the {rows} batch "
                    f"ranks ({_axes_named(mesh_shape, mesh_axes_of(BATCH, self.rules))}): "
                    f"use a multiple of {rows * microbatches}")
        found = indivisible(self.model_for(model, mesh_shape).logical_dims(), mesh_shape,
                            self.rules)
        if found:
            logical, size, axes = found
            flags = [f"--mesh.{a}" for a in axes] + [MODEL_FLAGS.get(logical, "the model")]
            return (f"{logical}={size} is not divisible by {_axes_named(mesh_shape, axes)}: "
                    f"change {' or '.join(flags)}")
        try:
            check_vocab_apart_from_batch(mesh_shape, self.rules)
        except ValueError as err:
            return str(err)
        return None

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

    def traffic(self, leaf: LeafTraffic, run: RunOptions) -> list[Transfer]:
        """The collectives one step runs for ``leaf`` under this layout, as ``--layout
        auto`` models them (``optim.auto_layout.estimate``)."""
        raise NotImplementedError(f"the {self.name} layout has no traffic model")

    def sums_gradients_manually(self, mesh_shape: Mapping[str, int]) -> bool:
        """Whether this layout's runners sum the gradients themselves (a ``shard_map``
        manual over the batch axes), not XLA's partitioner."""
        return False

    def masters_on_owners(self, compute_dtype, grad_dtype, stack_owners: int,
                          dealt: bool) -> bool:
        """Whether a matrix stack's fp32 params live with its state on its
        ``stack_owners`` (split in contiguous blocks, not ``dealt``), the train step
        gathering them once, cast to ``compute_dtype``, for the model
        (``ShardingPlan.model_weights``), whose gradients are in ``grad_dtype``;
        else they live as ``param_spec`` says."""
        return False


def _alternating(model) -> bool:
    """Whether ``model``'s MoE layers alternate with dense ones (``moe.every`` > 1), so
    that neither kind of layer is one run of layers (``GPTConfig``'s own rule)."""
    return bool(model.moe.n_experts) and model.moe.every > 1


def _live(mesh_shape: Mapping[str, int], axes) -> tuple[str, ...]:
    """The axes of ``axes`` of size > 1."""
    return tuple(a for a in axes if mesh_shape.get(a, 1) > 1)


def _params_replicated(rules: Rules) -> Rules:
    """``rules`` with the params whole on every batch rank (ZeRO-3's embed split off)."""
    return with_rules(rules, embed=None)


def _axes_named(mesh_shape: Mapping[str, int], axes) -> str:
    """``data=2 x fsdp=2``: the live ones of ``axes`` with their sizes."""
    return " x ".join(f"{a}={mesh_shape[a]}" for a in axes if mesh_shape.get(a, 1) > 1) or "none"


class Replicated(Layout):
    name = "replicated"

    @classmethod
    def for_mesh(cls, mesh_shape, rules, assignment, owner_group) -> Layout:
        return cls(_params_replicated(rules), stages=split_size(mesh_shape, rules, STAGES))

    def traffic(self, leaf: LeafTraffic, run: RunOptions) -> list[Transfer]:
        """Gradients all-reduced over the ranks holding copies."""
        return all_reduced(leaf)


class FSDP(Layout):
    name = "fsdp"

    @classmethod
    def for_mesh(cls, mesh_shape, rules, assignment, owner_group) -> Layout:
        return cls(rules, stages=split_size(mesh_shape, rules, STAGES))

    def traffic(self, leaf: LeafTraffic, run: RunOptions) -> list[Transfer]:
        """Per layer: gathered for the forward and again for the backward in the compute
        dtype, gradients reduce-scattered, then all-reduced over the other batch ranks;
        matrices gathered once more, whole, for the optimizer ("stock FSDP-Muon")."""
        out = sharded(leaf, 2, leaf.layers, leaf.used)
        if leaf.matrix_flops:
            out += ring("all-gather", leaf.gathered, leaf, leaf.used, leaf.master, 1)
        return out


class Layerwise(Layout):
    name = "layerwise"

    @classmethod
    def for_mesh(cls, mesh_shape, rules, assignment, owner_group) -> Layout:
        """The ranks that hold different data own the matrices."""
        owners = _live(mesh_shape, mesh_axes_of(BATCH, rules))
        return cls(_params_replicated(rules), owners, tuple(mesh_shape[a] for a in owners),
                   assignment, split_size(mesh_shape, rules, STAGES))

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


@dataclasses.dataclass(frozen=True)
class Owner(Layout):
    name = "owner"
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
        owners = _live(mesh_shape, zero3)
        return cls(with_rules(rules, **{LAYERS: zero3 or None}), owners,
                   tuple(mesh_shape[a] for a in owners),
                   stages=split_size(mesh_shape, rules, STAGES), group=owner_group)

    @property
    def layer_group(self) -> int:
        return self.owners

    @property
    def label(self) -> str:
        return layout_label(self.name, self.group)

    def _stacking_refusal(self, model, microbatches: int) -> str | None:
        if why := super()._stacking_refusal(model, microbatches):
            return why
        if self.layer_group > 1 and _alternating(model):
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
                    + f" (got {_axes_named(mesh_shape, others)}), or drop --model.prefetch")
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


def owner_group_axes(mesh_shape: Mapping[str, int], rules: Rules = DEFAULT_RULES
                     ) -> tuple[str, ...]:
    """The mesh axes of the ``data+fsdp`` owner group, in the mesh's order: the ZeRO-3
    axes and every other live batch axis but the experts'."""
    zero3, experts = mesh_axes_of(EMBED, rules), mesh_axes_of(EXPERTS, rules)
    return tuple(a for a in mesh_axes_of(BATCH, rules)
                 if a in zero3 or (a not in experts and mesh_shape.get(a, 1) > 1))
