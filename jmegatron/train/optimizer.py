"""Learning-rate schedules and the optimizer of a training run."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from jmegatron.sharding import rules as ax
from jmegatron.train.config import OptimConfig


def make_schedule(cfg: OptimConfig, steps: int) -> optax.Schedule:
    """Linear warmup to ``lr``, then cosine, linear, warmup-stable-decay or constant."""
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
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decay_mask(abstract_params: nnx.State) -> nnx.State:
    """True for parameters that take weight decay: everything but norm scales."""
    return jax.tree.map(lambda v: ax.NORM not in (v.get_metadata().get("out_sharding") or ()),
                        abstract_params, is_leaf=lambda v: isinstance(v, nnx.Variable))


def make_optimizer(cfg: OptimConfig, steps: int,
                   abstract_params: nnx.State) -> tuple[optax.GradientTransformation,
                                                        optax.Schedule]:
    """The optimizer (global-norm clipping, then AdamW) and its schedule."""
    schedule = make_schedule(cfg, steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask(abstract_params))
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return optax.chain(clip, adamw), schedule

