"""The layout strategy object every layout subclasses (``Layout``): where params and
each matrix stack's state live, how the stacks run, what a layout refuses and what
it sends; and the options and names the layouts share."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Mapping

from jax.sharding import PartitionSpec as P

from jmegatron.sharding.pipeline import PipelineRunner
from jmegatron.sharding.rules import (ACTIVATION_AXES, BATCH, EXPERTS, STAGES, VOCAB, Rules,
                                     axis_roles, check_vocab_apart_from_batch, indivisible,
                                     logical_to_spec, mesh_axes_of, split_size, with_rules)
from jmegatron.sharding.runners import ScanRunner, StackRunner
from jmegatron.sharding.schedules import schedule_refusal
from jmegatron.sharding.traffic import LeafTraffic, RunOptions, Transfer

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
    # The run options this layout takes beyond the others' (``TrainConfig.owner_group``,
    # ``GPTConfig.prefetch`` and ``keep_gathered``: owner's; fsdp takes keep_gathered).
    options: ClassVar[tuple[str, ...]] = ()
    rules: Rules                        # params and activations
    owner_axes: tuple[str, ...] = ()    # mesh axes a matrix stack is split over for its state
    owner_sizes: tuple[int, ...] = ()   # their sizes
    assignment: str = "round_robin"     # which owner gets which matrix (layerwise)
    stages: int = 1                     # pipeline stages (the mesh axes ``stages`` maps to)
    repeats: int = 1                    # chunks per stage (circular, interleaved-1f1b)
    schedule: str = "gpipe"             # the pipeline's (sharding.schedules.SCHEDULES)

    @classmethod
    def for_mesh(cls, mesh_shape: Mapping[str, int], rules: Rules, assignment: str,
                 owner_group: str) -> "Layout":
        """This layout on a mesh of ``mesh_shape``, built on ``rules`` (``make_layout``
        checks the options; ``assignment`` is layerwise's, ``owner_group`` owner's)."""
        raise NotImplementedError(f"the {cls.name} layout cannot be built")

    @classmethod
    def variants(cls, mesh_shape: Mapping[str, int], rules: Rules,
                 prefetch: bool) -> list[dict]:
        """The ways ``--layout auto`` may run this layout on a mesh of ``mesh_shape``
        (each the options of an ``optim.auto_layout.Candidate``: owner's group and
        prefetch; ``prefetch`` whether prefetching ones may be among them): none where
        it would only repeat another layout, e.g. fsdp without a live ZeRO-3 axis."""
        return [{}]

    def check(self, model, mesh_shape: Mapping[str, int], batch_size: int,
              microbatches: int = 1) -> str | None:
        """None if this layout can run ``model`` (a ``GPTConfig`` as the user set it:
        not yet stacked for a layout, its ``prefetch`` and ``keep_gathered`` included)
        on a mesh of ``mesh_shape`` with a global batch of ``batch_size`` in
        ``microbatches``; else the one-line reason, naming the option to change. The
        only place a layout refuses a run: the trainer raises it, and ``--layout
        auto`` skips a candidate that has one."""
        checks = (lambda: self._stacking_refusal(model, microbatches),
                  lambda: self._context_refusal(mesh_shape),
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
        if alternating(model):
            return (f"pipeline stages run each kind of layer as one stack, but the MoE layers "
                    f"alternate with dense ones (--model.moe.every {model.moe.every}): set "
                    "--model.moe.every 1 (or --mesh.stage 1)")
        return schedule_refusal(self.schedule, self.stages, microbatches, self.repeats)

    def _context_refusal(self, mesh_shape: Mapping[str, int]) -> str | None:
        """Pipeline stages over a sequence split by a context axis: a stage's pieces
        (``sharding.own_backward``) do not deal the sequence yet."""
        split = live_axes(mesh_shape, axis_roles(self.rules).sequence)
        if self.stages > 1 and split:
            return (f"--mesh.stage {self.stages} cannot yet run a sequence split over "
                    f"{axes_named(mesh_shape, split)}: set --mesh.stage 1 or --mesh.context 1")
        return None

    def _options_refusal(self, model, mesh_shape: Mapping[str, int]) -> str | None:
        """Model options (``GPTConfig.prefetch``, ``keep_gathered``) under a layout that
        does not take them (``options``)."""
        from jmegatron.sharding.layouts import takers   # the registry imports this module
        given = [f for f in ("prefetch", "keep_gathered")
                 if getattr(model, f) and f not in self.options]
        return (f"--model.{given[0].replace('_', '-')} applies to --layout "
                f"{takers(given[0])}, not {self.name}" if given else None)

    def _sharding_refusal(self, model, mesh_shape: Mapping[str, int], batch_size: int,
                          microbatches: int) -> str | None:
        """A dim of the stacked model, or of a microbatch, its mesh axes do not divide."""
        rows = math.prod(mesh_shape.get(a, 1) for a in mesh_axes_of(BATCH, self.rules))
        if (batch_size // microbatches) % rows:
            each = f" in {microbatches} microbatches" if microbatches > 1 else ""
            return (f"--batch-size {batch_size}{each} does not split over the {rows} batch "
                    f"ranks ({axes_named(mesh_shape, mesh_axes_of(BATCH, self.rules))}): "
                    f"use a multiple of {rows * microbatches}")
        found = indivisible(self.model_for(model, mesh_shape).logical_dims(), mesh_shape,
                            self.rules)
        if found:
            logical, size, axes = found
            flags = [f"--mesh.{a}" for a in axes] + [MODEL_FLAGS.get(logical, "the model")]
            return (f"{logical}={size} is not divisible by {axes_named(mesh_shape, axes)}: "
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

    def pipeline_batch_axes(self, model, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
        """The batch axes a pipeline stage's map is manual over besides the stages'
        (``pipeline.over_stages``): there each rank runs its own rows as one device
        would, on its stage's weights whole, and their gradients, unreduced over the
        microbatches, are summed over the batch axes once per step, not at every
        tick. All the live batch axes where, with the stages', they are the only live
        ones, ``model``'s MoE layers, if any, have their experts whole (they then sum
        their routing statistics over the batch ranks themselves; split over a live
        axis, a map manual over it would hold every expert), and the stage's weights
        are whole on every batch rank (replicated, layerwise) or
        ``model.keep_gathered`` keeps them gathered for the step (fsdp, owner:
        gathered once, their gradients reduce-scattered once);
        else none, and XLA sums each tick's gradients as it computes them (ZeRO-3's
        reduce-scatter per microbatch, for fsdp and owner)."""
        roles = axis_roles(self.rules)
        live = {a for a, n in mesh_shape.items() if n > 1}
        batch = tuple(a for a in roles.batch if a in live)
        param_axes = {a for name, entry in self.rules if name not in ACTIVATION_AXES
                      for a in mesh_axes_of(name, self.rules)}
        experts_split = set(mesh_axes_of(EXPERTS, self.rules)) & live
        if (self.stages == 1 or live - set(batch) - set(roles.stages)
                or (param_axes & set(batch) and not model.keep_gathered)
                or (any(model.moe_layers) and experts_split)):
            return ()
        return batch

    def pipeline_gradient_spec(self, logical: tuple, shape: tuple[int, ...]) -> P:
        """Where a pipeline stage's map (manual over ``pipeline_batch_axes``) leaves the
        once-a-step gradient of a param with ``logical`` axes and ``shape``: as the param
        lies (summed over the batch axes it is whole on, reduce-scattered over those that
        split it)."""
        return self.param_spec(logical)

    def masters_on_owners(self, compute_dtype, grad_dtype, stack_owners: int,
                          dealt: bool) -> bool:
        """Whether a matrix stack's fp32 params live with its state on its
        ``stack_owners`` (split in contiguous blocks, not ``dealt``), the train step
        gathering them once, cast to ``compute_dtype``, for the model
        (``ShardingPlan.model_weights``), whose gradients are in ``grad_dtype``;
        else they live as ``param_spec`` says."""
        return False


def alternating(model) -> bool:
    """Whether ``model``'s MoE layers alternate with dense ones (``moe.every`` > 1), so
    that neither kind of layer is one run of layers (``GPTConfig``'s own rule)."""
    return bool(model.moe.n_experts) and model.moe.every > 1


def live_axes(mesh_shape: Mapping[str, int], axes) -> tuple[str, ...]:
    """The axes of ``axes`` of size > 1."""
    return tuple(a for a in axes if mesh_shape.get(a, 1) > 1)


def params_replicated(rules: Rules) -> Rules:
    """``rules`` with the params whole on every batch rank (ZeRO-3's embed split off)."""
    return with_rules(rules, embed=None)


def axes_named(mesh_shape: Mapping[str, int], axes) -> str:
    """``data=2 x fsdp=2``: the live ones of ``axes`` with their sizes."""
    return " x ".join(f"{a}={mesh_shape[a]}" for a in axes if mesh_shape.get(a, 1) > 1) or "none"
