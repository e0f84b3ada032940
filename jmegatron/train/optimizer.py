"""Learning-rate schedules and the optimizer of a training run."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import optax

from jmegatron.analysis.cost_model import hardware
from jmegatron.optim import ADAMW, AdamW, Routing, ShardingPlan, TensorParallel, make_plan
from jmegatron.optim.auto_layout import STATE_BYTES, LayoutEstimate, estimate, preset_of
from jmegatron.optim.owners import ns_cost
from jmegatron.optim.tensor_parallel import tp_note
from jmegatron.sharding import rules as ax
from jmegatron.sharding.layouts import LAYOUT_CLASSES, Layout
from jmegatron.sharding.rules import logical_axes_of
from jmegatron.train.config import ScheduleConfig, TrainConfig
from jmegatron.train.registry import OPTIMIZERS


def make_schedule(cfg: ScheduleConfig, peak: float, steps: int) -> optax.Schedule:
    """Linear warmup to ``peak`` (step s of the warmup uses (s+1)/warmup of it, so no
    step is wasted at zero), then cosine, linear, warmup-stable-decay or constant."""
    floor = peak * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, steps)
    rest = max(steps - warmup, 1)
    if cfg.kind == "cosine":
        decay = optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio)
    elif cfg.kind == "linear":
        decay = optax.linear_schedule(peak, floor, rest)
    elif cfg.kind == "wsd":
        decay_steps = max(int(steps * cfg.decay_fraction), 1)
        decay = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay_steps)],
            [max(rest - decay_steps, 0)])
    elif cfg.kind == "constant":
        decay = optax.constant_schedule(peak)
    else:
        raise ValueError(f"unknown schedule {cfg.kind!r}")
    warm = lambda step: peak * jnp.minimum(1.0, (step + 1) / max(warmup, 1))
    return optax.join_schedules([warm, decay], [warmup])


def decay_mask(params):
    """True for parameters that take weight decay: everything but norm scales."""
    return jax.tree.map(lambda v: ax.NORM not in (logical_axes_of(v) or ()), params,
                        is_leaf=lambda v: logical_axes_of(v) is not None)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The transformation with what the loop reports about it."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule
    leaf_groups: tuple[str, ...]    # the optimizer's name or "adamw" per trained leaf, in order
    flops_per_step: int             # matrix-optimizer matmul FLOPs of one step (0 for AdamW)
    routing_table: str              # who gets which optimizer (``describe``), who owns what
    plan: ShardingPlan              # where every leaf of params and state lives


def routing_of(cfg: TrainConfig) -> Routing:
    return Routing(split_qkv=cfg.muon.split_qkv, per_head=cfg.muon.per_head)


# XLA's GPU scheduler that moves a collective's start ahead of independent work (off
# by default in XLA; docs.jax.dev's "GPU performance tips" recommend it): without it
# nothing prefetch issues early overlaps the layers' compute.
LATENCY_HIDING = "--xla_gpu_enable_latency_hiding_scheduler=true"


def rank_layouts(cfg: TrainConfig, abstract_params, mesh_shape, device
                 ) -> tuple[list[LayoutEstimate], str]:
    """``--layout auto``'s comparison: the candidates the mesh and ``cfg`` allow (an
    owner group or prefetch ``cfg`` fixes is kept, and owner's options, given, keep it
    to owner; prefetch for dense models, under
    XLA's latency-hiding scheduler), modelled (``optim.auto_layout.estimate``) for
    ``cfg``'s optimizer and batch on the preset of ``device``, shortest first; and
    the preset's name as the log states it."""
    entry = OPTIMIZERS.get(cfg.optim)   # None: adamw
    preset, label = preset_of(device)
    model = cfg.model
    # Tokens per device in one microbatch: what one pass of the layers computes on.
    ranks = ax.axis_roles(ax.DEFAULT_RULES).ranks(mesh_shape)   # every layout's batch split
    tokens = cfg.batch_size * cfg.seq_len / cfg.microbatches / ranks
    hides = hardware(preset).overlaps and LATENCY_HIDING in os.environ.get("XLA_FLAGS", "")
    prefetch = not any(model.moe_layers) and (hides or model.prefetch)

    given = {f for f, on in (("owner_group", cfg.owner_group), ("prefetch", model.prefetch),
                             ("keep_gathered", model.keep_gathered)) if on}

    def kept(c) -> bool:   # options given keep auto to the layouts that take them, as given
        return (given <= set(LAYOUT_CLASSES[c.layout].options)
                and cfg.owner_group in (None, c.owner_group) and (c.prefetch or not model.prefetch))

    ranked = estimate(abstract_params, mesh_shape, preset,
                      cost=entry.matrix_flops(cfg) if entry else None, routing=routing_of(cfg),
                      keep_gathered=model.keep_gathered,
                      state_bytes=STATE_BYTES if entry else (8, 8),
                      prefetch=prefetch, tokens=tokens if hides else 0.0)
    return [e for e in ranked if kept(e.candidate)], label


# Every --optim but adamw (``registry.OPTIMIZERS``).
MATRIX_OPTIMIZERS = tuple(OPTIMIZERS)


def make_optimizer(cfg: TrainConfig, abstract_params, mesh: jax.sharding.Mesh | None = None,
                   layout: Layout | None = None) -> Optimizer:
    """Global-norm clipping, then a matrix optimizer + AdamW (``--optim``, one of
    ``MATRIX_OPTIMIZERS``) or AdamW, on the plan of ``abstract_params``
    (``make_plan``) made here, once."""
    entry = OPTIMIZERS.get(cfg.optim)   # None: adamw
    plan = make_plan(abstract_params, mesh, layout, routing_of(cfg),
                     cost=entry.matrix_flops(cfg) if entry else ns_cost)
    trained = plan.for_optimizer()
    schedule = make_schedule(cfg.schedule, cfg.lr, cfg.steps)
    adam_schedule = (schedule if cfg.adamw.lr is None
                     else make_schedule(cfg.schedule, cfg.adamw.lr, cfg.steps))
    a, m = cfg.adamw, cfg.muon
    if entry is not None:
        common = dict(weight_decay=cfg.weight_decay, weight_decay_method=cfg.weight_decay_method,
                      plan=trained, adamw=AdamW(adam_schedule, a.b1, a.b2, a.eps,
                                                cfg.weight_decay, decay_mask))
        main = entry.build(cfg, schedule, common)
        groups = tuple(cfg.optim if leaf.is_matrix else ADAMW for leaf in trained.leaves)
        flops = entry.flops(cfg, abstract_params, plan.routing)
        note = None
        if mesh is not None and entry.newton_schulz:
            by_path = {leaf.path: leaf for leaf in trained.leaves}
            note = tp_note(TensorParallel(mesh, m.tp_mode), lambda leaf: by_path[leaf.path].held,
                           m.ns_steps, m.ns_coefficients)
        table = trained.describe(cfg.optim, note)
    elif cfg.optim == "adamw":
        main = optax.adamw(adam_schedule, b1=a.b1, b2=a.b2, eps=a.eps,
                           weight_decay=cfg.weight_decay, mask=decay_mask)
        groups, flops = (ADAMW,) * len(trained.leaves), 0
        table = "every leaf: adamw"
    else:
        raise ValueError(f"unknown optimizer {cfg.optim!r}")
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return Optimizer(optax.chain(clip, main), schedule, groups, flops, table, plan)


def group_update_rms(updates, leaf_groups: tuple[str, ...]) -> dict[str, jax.Array]:
    """Root-mean-square of the updates of each group ("update_rms_muon", ...)."""
    leaves = jax.tree.leaves(updates)
    out = {}
    for group in sorted(set(leaf_groups)):
        mine = [x for x, g in zip(leaves, leaf_groups) if g == group]
        total = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in mine)
        # A float count: an int over 2**31 (a 2.5B-param group) overflows int32 in jit.
        out[f"update_rms_{group}"] = jnp.sqrt(total / float(sum(x.size for x in mine)))
    return out
