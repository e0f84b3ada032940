"""Muon: momentum orthogonalized by Newton-Schulz, as optax transformations."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmegatron.optim.coefficients import CoefficientSet, coefficient_set
from jmegatron.optim.newton_schulz import newton_schulz, ns_flops
from jmegatron.optim.routing import (ADAMW, MATRIX, MatrixSpec, Routing, labels, leaf_routes,
                                     map_matrices, matrix_pieces)

ScaleMode = Literal["spectral", "shape", "unit_rms", "none"]
MOONLIGHT_RMS = 0.2   # spectral x 0.2 gives updates with AdamW's typical RMS


class MuonState(NamedTuple):
    count: jax.Array              # int32 scalar
    momentum: optax.Updates


def update_scale(mode: ScaleMode, fan_in: int, fan_out: int, rms_factor: float = 1.0) -> float:
    """Multiplier of an orthogonalized fan_in x fan_out update.

    spectral: sqrt(max(fan_in, fan_out)), unit RMS (Moonlight with rms_factor 0.2);
    shape: sqrt(max(1, fan_out / fan_in)) (Keller Jordan's Muon);
    unit_rms: sqrt(fan_out / fan_in) (unit RMS-to-RMS operator norm); none: 1.
    """
    base = {"spectral": math.sqrt(max(fan_in, fan_out)),
            "shape": math.sqrt(max(1.0, fan_out / fan_in)),
            "unit_rms": math.sqrt(fan_out / fan_in),
            "none": 1.0}
    if mode not in base:
        raise ValueError(f"unknown scale mode {mode!r}; one of {sorted(base)}")
    return base[mode] * rms_factor


def _momentum_step(g, m, count, beta, momentum, nesterov, bias_correction):
    """New momentum and the direction to orthogonalize (fp32)."""
    if momentum == "ema":
        m = beta * m + (1 - beta) * g
        if bias_correction:
            look_ahead = beta * m / (1 - beta ** (count + 1)) + (1 - beta) * g / (1 - beta ** count)
            return m, look_ahead if nesterov else m / (1 - beta ** count)
        return m, beta * m + (1 - beta) * g if nesterov else m
    if momentum == "sum":
        m = beta * m + g
        return m, g + beta * m if nesterov else m
    raise ValueError(f"momentum must be 'ema' or 'sum', got {momentum!r}")


def scale_by_muon(*, coefficients: str | CoefficientSet | tuple = "quintic",
                  steps: int | None = None, beta: float = 0.95, nesterov: bool = True,
                  momentum: Literal["ema", "sum"] = "ema", bias_correction: bool = False,
                  momentum_dtype=None, scale: ScaleMode = "spectral",
                  rms_factor: float = MOONLIGHT_RMS, matmul_dtype=jnp.float32,
                  routing: Routing = Routing()) -> optax.GradientTransformation:
    """Muon's direction: momentum, Newton-Schulz orthogonalization, shape scale.

    Every leaf it sees must be a matrix (or a stack of them) under ``routing``;
    fused QKV/SwiGLU weights are split into blocks, each orthogonalized with
    its own scale. ``muon`` combines this with AdamW for the other leaves.
    Momentum is an EMA (``g`` weighted ``1 - beta``) or a sum; with
    ``bias_correction`` the EMA form equals ``optax.contrib.scale_by_muon``.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural
        networks", 2024 (kellerjordan.github.io/posts/muon).
      Liu et al., "Muon is Scalable for LLM Training", arXiv:2502.16982, 2025.
      Bernstein & Newhouse, "Old Optimizer, New Norm: An Anthology",
        arXiv:2409.20325, 2024.
    """
    def orthogonalize(u: jax.Array, spec: MatrixSpec) -> jax.Array:
        def block(stack, fan_in, fan_out):
            ortho = newton_schulz(stack, steps=steps, coefficients=coefficients,
                                  matmul_dtype=matmul_dtype)
            return ortho * update_scale(scale, fan_in, fan_out, rms_factor)
        return map_matrices(block, u, spec)

    def init_fn(params):
        _matrix_routes(params, routing)   # fail early on a leaf that is no matrix
        dtype = lambda x: momentum_dtype or x.dtype
        return MuonState(jnp.zeros([], jnp.int32),
                         jax.tree.map(lambda x: jnp.zeros(x.shape, dtype(x)), params))

    def update_fn(updates, state, params=None):
        del params
        routes = _matrix_routes(updates, routing)
        count = optax.safe_increment(state.count)
        flat, treedef = jax.tree.flatten(updates)
        moms = treedef.flatten_up_to(state.momentum)
        new_updates, new_moms = [], []
        for g, m, route in zip(flat, moms, routes):
            m32, direction = _momentum_step(g.astype(jnp.float32), m.astype(jnp.float32), count,
                                            beta, momentum, nesterov, bias_correction)
            new_updates.append(orthogonalize(direction, route.spec).astype(g.dtype))
            new_moms.append(m32.astype(m.dtype))
        return (treedef.unflatten(new_updates),
                MuonState(count, treedef.unflatten(new_moms)))

    return optax.GradientTransformation(init_fn, update_fn)


def _matrix_routes(tree, routing: Routing) -> list:
    """The Route of every leaf; each must be a matrix."""
    for path, route in (pairs := leaf_routes(tree, routing)):
        if route.kind != MATRIX:
            raise ValueError(f"scale_by_muon got {path}, which routing sends to AdamW "
                             f"({route.rule}); use jmegatron.optim.muon to split the tree")
    return [route for _, route in pairs]


def muon(learning_rate: optax.ScalarOrSchedule, *,
         coefficients: str | CoefficientSet | tuple = "quintic", steps: int | None = None,
         beta: float = 0.95, nesterov: bool = True, momentum: Literal["ema", "sum"] = "ema",
         bias_correction: bool = False, momentum_dtype=None, scale: ScaleMode = "spectral",
         rms_factor: float = MOONLIGHT_RMS, weight_decay: float = 0.0,
         matmul_dtype=jnp.float32, routing: Routing = Routing(),
         adam_learning_rate: optax.ScalarOrSchedule | None = None, adam_b1: float = 0.9,
         adam_b2: float = 0.95, adam_eps: float = 1e-8, adam_weight_decay: float = 0.0,
         adam_weight_decay_mask=None) -> optax.GradientTransformation:
    """Muon for hidden matrices, AdamW for every other leaf (see ``routing``).

    Matrices get ``-lr * (scale * NS(momentum) + weight_decay * W)`` (decoupled
    decay); with the default spectral scale x 0.2 (Moonlight), one learning rate
    suits both groups. ``describe(params, routing)`` prints who gets what.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural
        networks", 2024 (kellerjordan.github.io/posts/muon).
      Liu et al., "Muon is Scalable for LLM Training", arXiv:2502.16982, 2025.
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
        arXiv:1711.05101, 2017.
    """
    matrix = optax.chain(
        scale_by_muon(coefficients=coefficients, steps=steps, beta=beta, nesterov=nesterov,
                      momentum=momentum, bias_correction=bias_correction,
                      momentum_dtype=momentum_dtype, scale=scale, rms_factor=rms_factor,
                      matmul_dtype=matmul_dtype, routing=routing),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate))
    adam = optax.adamw(learning_rate if adam_learning_rate is None else adam_learning_rate,
                       b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=adam_weight_decay,
                       mask=adam_weight_decay_mask)
    return optax.partition({"muon": matrix, ADAMW: adam},
                           lambda params: labels(params, routing, "muon"))


def muon_flops(params, routing: Routing = Routing(), steps: int | None = None,
               coefficients: str | CoefficientSet | tuple = "quintic", syrk: bool = False) -> int:
    """Newton-Schulz FLOPs of one Muon step on ``params``."""
    n = steps or coefficient_set(coefficients).default_steps
    return sum(p.count * ns_flops(p.fan_in, p.fan_out, n, syrk)
               for p in matrix_pieces(params, routing))
