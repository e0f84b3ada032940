"""Adaptive Muon: a second moment on Muon's orthogonalized update (AdaMuon, NorMuon, NAMO).

Per block, with O = NS(direction) (Newton-Schulz, no scale), G the gradient,
D the momentum direction that was orthogonalized and v the second moment:

  adamuon: v <- lerp(v, O^2, 1 - beta2);                   O / (sqrt(v) + eps)
  normuon: v <- lerp(v, mean of O^2 over the shorter side, 1 - beta2)
           (over fan_in when square; v holds one value per row or column);
           O * rsqrt(max(v, eps)), rescaled to O's Frobenius norm
  namo:    v <- lerp(v, ||G||_F^2, 1 - beta2);              O * ||D||_F / (sqrt(v) + eps)

then Muon's shape scale. Newton-Schulz runs as Muon's does (tensor-parallel
modes, layouts); the statistics are plain array code on the update as its
owners hold it, so under the owner layout they are local, and a matrix split
over the tensor axis is reduced where XLA places it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from jmegatron.optim import checks
from jmegatron.optim.coefficients import CoefficientSet
from jmegatron.optim.matrix import (AdamW, PlanLike, PlanSource, WeightDecayMethod, descend,
                                    held_zeros, scale_by_matrix_optimizer, with_adamw)
from jmegatron.optim.muon import (ScaleMode, check_momentum_args, momentum_step,
                                  newton_schulz_blocks, update_scale)
from jmegatron.optim.newton_schulz import NSMethod
from jmegatron.optim.plan import BLOCKS, HELD, LeafPlan, matrix_state
from jmegatron.optim.routing import from_matrices, to_matrices
from jmegatron.optim.tensor_parallel import TPMode

SecondMoment = Literal["adamuon", "normuon", "namo"]


@matrix_state(momentum=HELD, nu=HELD)
class AdaMuonState(NamedTuple):
    count: jax.Array              # int32 scalar
    momentum: optax.Updates       # mirrors the params, held as the owners hold them
    nu: optax.Updates             # element-wise second moment, likewise


@matrix_state(momentum=HELD, nu=BLOCKS)
class ReducedMomentState(NamedTuple):
    count: jax.Array
    momentum: optax.Updates
    nu: optax.Updates             # per leaf a tuple per block: [*stack, 1, n] / [*stack, m, 1]
                                  # (normuon) or [*stack, 1, 1] (namo)


def _normuon_axis(fan_in: int, fan_out: int) -> int:
    """The axis NorMuon averages over: the shorter side's, fan_in when square."""
    return -2 if fan_in <= fan_out else -1


def _frobenius(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))


def _reduced_zeros(stack: jax.Array, second_moment: SecondMoment) -> jax.Array:
    """The second moment of a block stack [*stack, m, n] under normuon or namo."""
    *batch, m, n = stack.shape
    if second_moment == "namo":
        return jnp.zeros((*batch, 1, 1), jnp.float32)
    axis = _normuon_axis(m, n)
    return jnp.zeros((*batch, 1, n) if axis == -2 else (*batch, m, 1), jnp.float32)


def normalize(o, v, g, d, second_moment: SecondMoment, beta2: float, eps: float):
    """(normalized update, new v) of one block stack; see the module docstring."""
    if second_moment == "adamuon":
        v = beta2 * v + (1 - beta2) * jnp.square(o)
        return o / (jnp.sqrt(v) + eps), v
    if second_moment == "normuon":
        axis = _normuon_axis(*o.shape[-2:])
        v = beta2 * v + (1 - beta2) * jnp.mean(jnp.square(o), axis=axis, keepdims=True)
        u = o * jax.lax.rsqrt(jnp.maximum(v, eps))
        return u * (_frobenius(o) / jnp.maximum(_frobenius(u), eps)), v
    v = beta2 * v + (1 - beta2) * jnp.sum(jnp.square(g), axis=(-2, -1), keepdims=True)
    return o * (_frobenius(d) / (jnp.sqrt(v) + eps)), v


def scale_by_adaptive_muon(*, second_moment: SecondMoment = "adamuon", beta2: float = 0.95,
                           eps: float = 1e-8, beta: float = 0.95, nesterov: bool = False,
                           coefficients: str | CoefficientSet | tuple = "quintic",
                           steps: int | None = None, scale: ScaleMode = "spectral",
                           rms_factor: float | None = None, momentum_dtype=None,
                           matmul_dtype="float32", tp_mode: TPMode = "auto",
                           syrk: bool | str = False, ns_method: NSMethod = "standard",
                           plan: PlanLike = None) -> optax.GradientTransformation:
    """Adaptive Muon's direction for matrix leaves: Muon's, normalized by a second moment.

    EMA momentum (``g`` weighted ``1 - beta``), Newton-Schulz, ``second_moment``
    normalization (module docstring), then ``update_scale(scale, ...)``.
    Newton-Schulz, ``mesh``, ``layout`` and ``plan`` as for ``scale_by_muon``.

    Arguments, leaves and ``plan`` are checked as for ``scale_by_muon``. A NaN
    or an inf in a block's gradient enters the momentum and v and makes the
    block's whole update NaN, on that step and every later one.

    Args:
      second_moment: "adamuon" (element-wise v), "normuon" (v per row or column)
        or "namo" (one v per matrix, of the gradient's squared norm).
      beta2: the second moment's decay.
      eps: for "adamuon" and "namo" added to sqrt(v); for "normuon" the floor of v
        and of the normalized update's norm.
      beta: the momentum's decay.
      nesterov: orthogonalize the Nesterov look-ahead ``beta * m + (1 - beta) * g``
        instead of the momentum m.
      coefficients: Newton-Schulz's per-iteration (a, b, c): a set's name, tuples or
        a ``CoefficientSet`` (see ``coefficient_set``).
      steps: Newton-Schulz iterations; None: the set's ``default_steps``.
      scale: the multiplier of each normalized block (``update_scale``):
        "spectral", "shape", "unit_rms" or "none".
      rms_factor: a factor on ``scale``; None: 0.2 for "spectral", 1 for the others.
      momentum_dtype: the dtype the momentum is stored in; None: the param's (the
        second moment is fp32).
      matmul_dtype: the dtype of Newton-Schulz's matmul operands.
      tp_mode: Newton-Schulz of matrices split over the tensor axis (see
        ``scale_by_muon``).
      syrk: Newton-Schulz's symmetric products on the SYRK kernel: False, True or a
        backend name.
      ns_method: "standard", "gram" or "auto" (see ``newton_schulz``).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.

    Returns:
      An ``optax.GradientTransformation`` whose updates are the scaled normalized
      directions, before the learning rate and sign; its state holds the
      momentum and v (element-wise for "adamuon", per block otherwise).

    References:
      Si et al., "AdaMuon: Adaptive Muon Optimizer", arXiv:2507.11005, 2025.
      Li et al., "NorMuon: Making Muon more efficient and scalable",
        arXiv:2510.05491, 2025.
      NAMO, arXiv:2602.17080, 2026; NVIDIA Emerging-Optimizers 0.3.0,
        ``AdaptiveMuon``.
    """
    if second_moment not in get_args(SecondMoment):
        raise ValueError(f"unknown second_moment {second_moment!r}; "
                         f"one of {get_args(SecondMoment)}")
    checks.fraction("beta2", beta2)
    checks.positive("eps", eps)   # a zero gradient gives O = 0 and v = 0: 0 / 0
    check_momentum_args(beta, rms_factor, momentum_dtype)
    checks.one_of("scale", scale, get_args(ScaleMode))
    source = PlanSource.of(plan)
    orthogonal_blocks = newton_schulz_blocks(coefficients, steps, matmul_dtype, syrk, ns_method,
                                             tp_mode, source.placed_on)
    elementwise = second_moment == "adamuon"
    state_type = AdaMuonState if elementwise else ReducedMomentState

    def init_stack(x, leaf: LeafPlan):
        momentum = held_zeros(x, leaf, momentum_dtype or x.dtype)
        if elementwise:
            return momentum, held_zeros(x, leaf, jnp.float32)
        return momentum, tuple(_reduced_zeros(b, second_moment)
                               for b in to_matrices(momentum, leaf.route.spec))

    def update_stack(g, fields, count, leaf: LeafPlan):
        m, nu = fields
        m32, d = momentum_step(g, m.astype(jnp.float32), count, beta, "ema", nesterov, False)
        spec = leaf.route.spec
        nus = to_matrices(nu, spec) if elementwise else nu
        out, new_nu = [], []
        for (o, fan_in, fan_out), v, gb, db in zip(orthogonal_blocks(d, leaf), nus,
                                                   to_matrices(g, spec), to_matrices(d, spec)):
            u, v = normalize(o, v, gb, db, second_moment, beta2, eps)
            out.append(u * update_scale(scale, fan_in, fan_out, rms_factor))
            new_nu.append(v)
        nu = from_matrices(new_nu, spec, g.shape) if elementwise else tuple(new_nu)
        return from_matrices(out, spec, g.shape), (m32.astype(m.dtype), nu)

    return scale_by_matrix_optimizer("scale_by_adaptive_muon", state_type, init_stack,
                                     update_stack, source)


def adaptive_muon(learning_rate: optax.ScalarOrSchedule, *,
                  second_moment: SecondMoment = "adamuon", beta2: float = 0.95,
                  eps: float = 1e-8, beta: float = 0.95, nesterov: bool = False,
                  coefficients: str | CoefficientSet | tuple = "quintic",
                  steps: int | None = None, scale: ScaleMode = "spectral",
                  rms_factor: float | None = None, weight_decay: float = 0.0,
                  weight_decay_method: WeightDecayMethod = "decoupled", momentum_dtype=None,
                  matmul_dtype="float32", tp_mode: TPMode = "auto",
                  syrk: bool | str = False, ns_method: NSMethod = "standard", plan: PlanLike = None,
                  adamw: AdamW = AdamW()) -> optax.GradientTransformation:
    """Adaptive Muon for hidden matrices, AdamW for the other leaves.

    Matrices get ``-lr * scale * normalized(NS(momentum))`` and weight decay by
    ``weight_decay_method`` (``jmegatron.optim.matrix.descend``); the other leaves
    get ``adamw``'s. "namo" refuses nonzero "l2" decay (its v would see the
    decayed gradient, as Emerging-Optimizers says).

    Args:
      learning_rate: a number or an optax schedule of the step; also AdamW's
        unless ``adamw.learning_rate`` is set.
      second_moment: "adamuon", "normuon" or "namo" (see
        ``scale_by_adaptive_muon``).
      beta2: the second moment's decay.
      eps: the second moment's epsilon (see ``scale_by_adaptive_muon``).
      beta: the momentum's decay.
      nesterov: orthogonalize the Nesterov look-ahead instead of the momentum.
      coefficients: Newton-Schulz's coefficient set (see ``coefficient_set``).
      steps: Newton-Schulz iterations; None: the set's ``default_steps``.
      scale: the multiplier of each normalized block (``update_scale``).
      rms_factor: a factor on ``scale``; None: 0.2 for "spectral", 1 for the others.
      weight_decay: the matrices' weight decay coefficient (0: none); the other
        leaves take ``adamw.weight_decay``.
      weight_decay_method: "decoupled", "independent", "l2" or "palm" (see
        ``descend``).
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      matmul_dtype: the dtype of Newton-Schulz's matmul operands.
      tp_mode: Newton-Schulz of matrices split over the tensor axis.
      syrk: Newton-Schulz's symmetric products on the SYRK kernel.
      ns_method: "standard", "gram" or "auto".
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.
      adamw: the AdamW of the other leaves (``AdamW``).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "adaptive_muon") and the AdamW leaves.

    References:
      Si et al., "AdaMuon", arXiv:2507.11005, 2025; Li et al., "NorMuon",
        arXiv:2510.05491, 2025.
    """
    if second_moment == "namo" and weight_decay_method == "l2" and weight_decay:
        raise ValueError('second_moment="namo" does not combine with weight_decay_method="l2"')
    direction = scale_by_adaptive_muon(
        second_moment=second_moment, beta2=beta2, eps=eps, beta=beta, nesterov=nesterov,
        coefficients=coefficients, steps=steps, scale=scale, rms_factor=rms_factor,
        momentum_dtype=momentum_dtype, matmul_dtype=matmul_dtype, tp_mode=tp_mode, syrk=syrk,
        ns_method=ns_method, plan=plan)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method)
    return with_adamw("adaptive_muon", matrix, plan, learning_rate, adamw)
