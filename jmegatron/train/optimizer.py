"""Learning-rate schedules and the optimizer of a training run."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmegatron.optim import ADAMW, MATRIX, Routing, describe, leaf_routes, muon, muon_flops
from jmegatron.sharding import rules as ax
from jmegatron.train.config import OptimConfig


def make_schedule(cfg: OptimConfig, steps: int) -> optax.Schedule:
    """Linear warmup to ``lr`` (step s of the warmup uses (s+1)/warmup of it, so no
    step is wasted at zero), then cosine, linear, warmup-stable-decay or constant."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, steps)
    rest = max(steps - warmup, 1)
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, rest, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, floor, rest)
    elif cfg.schedule == "wsd":
        decay_steps = max(int(steps * cfg.decay_fraction), 1)
        decay = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay_steps)],
            [max(rest - decay_steps, 0)])
    elif cfg.schedule == "constant":
        decay = optax.constant_schedule(peak)
    else:
        raise ValueError(f"unknown schedule {cfg.schedule!r}")
    warm = lambda step: peak * jnp.minimum(1.0, (step + 1) / max(warmup, 1))
    return optax.join_schedules([warm, decay], [warmup])


def decay_mask(params):
    """True for parameters that take weight decay: everything but norm scales."""
    return jax.tree.map(lambda v: ax.NORM not in (v.get_metadata().get("out_sharding") or ()),
                        params, is_leaf=lambda v: isinstance(v, nnx.Variable))


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The transformation with what the loop reports about it."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule
    leaf_groups: tuple[str, ...]    # "muon" or "adamw" per param leaf, in leaf order
    flops_per_step: int             # Newton-Schulz FLOPs of one step (0 for AdamW)
    routing_table: str              # who gets which optimizer (``describe``)


def make_optimizer(cfg: OptimConfig, steps: int, abstract_params: nnx.State) -> Optimizer:
    """Global-norm clipping, then Muon + AdamW (``name="muon"``) or AdamW alone."""
    schedule = make_schedule(cfg, steps)
    routing = Routing(split_qkv=cfg.split_qkv, per_head=cfg.per_head)
    if cfg.name == "muon":
        main = muon(schedule, coefficients=cfg.ns_coefficients, steps=cfg.ns_steps,
                    beta=cfg.momentum, scale=cfg.muon_scale, rms_factor=cfg.rms_factor,
                    weight_decay=cfg.weight_decay, matmul_dtype=jnp.dtype(cfg.ns_dtype),
                    routing=routing, adam_b1=cfg.b1, adam_b2=cfg.b2, adam_eps=cfg.eps,
                    adam_weight_decay=cfg.weight_decay, adam_weight_decay_mask=decay_mask)
        groups = tuple("muon" if r.kind == MATRIX else ADAMW
                       for _, r in leaf_routes(abstract_params, routing))
        flops = muon_flops(abstract_params, routing, cfg.ns_steps, cfg.ns_coefficients)
        table = describe(abstract_params, routing)
    elif cfg.name == "adamw":
        main = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=decay_mask)
        groups, flops = (ADAMW,) * len(jax.tree.leaves(abstract_params)), 0
        table = "every leaf: adamw"
    else:
        raise ValueError(f"unknown optimizer {cfg.name!r}")
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return Optimizer(optax.chain(clip, main), schedule, groups, flops, table)


def group_update_rms(updates, leaf_groups: tuple[str, ...]) -> dict[str, jax.Array]:
    """Root-mean-square of the updates of each group ("update_rms_muon", ...)."""
    leaves = jax.tree.leaves(updates)
    out = {}
    for group in sorted(set(leaf_groups)):
        mine = [x for x, g in zip(leaves, leaf_groups) if g == group]
        total = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in mine)
        out[f"update_rms_{group}"] = jnp.sqrt(total / sum(x.size for x in mine))
    return out
