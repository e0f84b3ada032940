"""MOP: momentum orthogonalized by polar decomposition, exactly (by SVD).

Muon's momentum, then for every block M = U S V^T its polar factor U V^T,
times the nuclear norm sum(S) (PolarGrad's scale) or one of Muon's shape
scales. The SVD needs the whole matrix: under a mesh each block runs in
``jax.shard_map`` on the devices that hold its state (``on_owners``), so the
owner layout's step stays free of collectives and a matrix split over the
tensor axis is gathered and decomposed by every rank of the split
(duplicated).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
import optax

from jmegatron.optim.matrix import (AdamW, PlanLike, PlanSource, WeightDecayMethod, descend,
                                    held_zeros, per_matrix, scale_by_matrix_optimizer, with_adamw)
from jmegatron.optim.muon import MuonState, check_momentum_args, momentum_step, update_scale
from jmegatron.optim.routing import (Routing, flops_over_matrices, from_matrices,
                                     to_matrices)

MopScale = Literal["nuclear_norm", "spectral", "shape", "unit_rms", "none"]


def polar_factor(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The polar factor U V^T and the singular values of every matrix of a stack.

    By thin SVD (on CPU one matrix at a time, see ``matrix.per_matrix``); a zero
    matrix gives zero (its singular vectors are arbitrary), a matrix with a NaN or
    an inf gives NaN (LAPACK's SVD of an inf never returns: it is not called on one).

    Args:
      x: a stack of matrices [..., m, n], fp32.

    Returns:
      (U V^T [..., m, n], singular values [..., min(m, n)], descending).
    """
    finite = jnp.all(jnp.isfinite(x), axis=(-2, -1), keepdims=True)   # [..., 1, 1]
    safe = jnp.where(finite, x, 0.0)
    u, s, vt = per_matrix(lambda a: jnp.linalg.svd(a, full_matrices=False), safe)
    polar = jnp.matmul(u, vt, precision=jax.lax.Precision.HIGHEST)
    nonzero = jnp.max(s, axis=-1)[..., None, None] > 0
    return (jnp.where(finite, jnp.where(nonzero, polar, 0.0), jnp.nan),
            jnp.where(finite[..., 0], s, jnp.nan))


def scaled_polar(x: jax.Array, scale: MopScale, rms_factor: float | None) -> jax.Array:
    """The polar factor of each matrix of a stack, times its scale."""
    polar, s = polar_factor(x)
    if scale == "nuclear_norm":
        factor = jnp.sum(s, axis=-1)[..., None, None]
        return polar * factor * (1.0 if rms_factor is None else rms_factor)
    return polar * update_scale(scale, *x.shape[-2:], rms_factor)


def scale_by_mop(*, beta: float = 0.95, nesterov: bool = False,
                 scale: MopScale = "nuclear_norm", rms_factor: float | None = None,
                 momentum_dtype=None, plan: PlanLike = None
                 ) -> optax.GradientTransformation:
    """MOP's direction for matrix leaves: momentum, then each block's exact polar factor.

    EMA momentum (``g`` weighted ``1 - beta``, Nesterov optional) and each block's
    polar factor by SVD, scaled by its nuclear norm (``scale="nuclear_norm"``,
    times ``rms_factor`` if given) or by Muon's ``update_scale``. ``mesh``,
    ``layout`` and ``plan`` as for ``scale_by_muon``; there is no tensor-parallel
    mode: a matrix split over the tensor axis is gathered (module docstring).

    Arguments, leaves and ``plan`` are checked as for ``scale_by_muon``, and a
    non-finite gradient likewise makes its block's update NaN from then on (the
    momentum keeps it): the polar factor of a non-finite matrix is NaN, with no
    SVD run on it (LAPACK's never returns on an inf).

    Args:
      beta: the momentum's decay.
      nesterov: decompose the Nesterov look-ahead ``beta * m + (1 - beta) * g``
        instead of the momentum m.
      scale: "nuclear_norm" (the block's sum of singular values, PolarGrad's), or
        one of ``update_scale``'s modes: "spectral", "shape", "unit_rms", "none".
      rms_factor: a factor on the scale; None: 1 for "nuclear_norm", else
        ``update_scale``'s default (0.2 for "spectral").
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.

    Returns:
      An ``optax.GradientTransformation`` (state ``MuonState``) whose updates are
      the scaled polar factors, before the learning rate and sign.

    References:
      Lau, Long & Su, "PolarGrad: A Class of Matrix-Gradient Optimizers from a
        Unifying Preconditioning Perspective", arXiv:2505.21799, 2025.
      NVIDIA Emerging-Optimizers 0.3.0, ``MOP``.
    """
    if scale not in get_args(MopScale):
        raise ValueError(f"unknown MOP scale {scale!r}; one of {get_args(MopScale)}")
    check_momentum_args(beta, rms_factor, momentum_dtype)
    source = PlanSource.of(plan)
    polar = lambda stack: scaled_polar(stack, scale, rms_factor)

    def init_stack(x, leaf):
        return (held_zeros(x, leaf, momentum_dtype or x.dtype),)

    def update_stack(g, fields, count, leaf):
        (m,) = fields
        m32, d = momentum_step(g, m.astype(jnp.float32), count, beta, "ema", nesterov, False)
        spec = leaf.route.spec
        blocks = [polar(b) for b in to_matrices(d, spec)]
        return from_matrices(blocks, spec, d.shape), (m32.astype(m.dtype),)

    return scale_by_matrix_optimizer("scale_by_mop", MuonState, init_stack, update_stack,
                                     source, whole_matrices=True)


def mop(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.95, nesterov: bool = False,
        scale: MopScale = "nuclear_norm", rms_factor: float | None = None,
        weight_decay: float = 0.01, weight_decay_method: WeightDecayMethod = "decoupled",
        momentum_dtype=None, plan: PlanLike = None,
        adamw: AdamW = AdamW()) -> optax.GradientTransformation:
    """MOP for hidden matrices, AdamW for every other leaf.

    Matrices get ``-lr * scale * polar(momentum)`` and weight decay by
    ``weight_decay_method`` (``jmegatron.optim.matrix.descend``); the other leaves
    get ``adamw``'s. Defaults are Emerging-Optimizers' (no Nesterov, nuclear-norm
    scale, decoupled decay 0.01).

    Args:
      learning_rate: a number or an optax schedule of the step; also AdamW's
        unless ``adamw.learning_rate`` is set.
      beta: the momentum's decay.
      nesterov: decompose the Nesterov look-ahead instead of the momentum.
      scale: "nuclear_norm", "spectral", "shape", "unit_rms" or "none" (see
        ``scale_by_mop``).
      rms_factor: a factor on the scale; None: 1 for "nuclear_norm", else
        ``update_scale``'s default.
      weight_decay: the matrices' weight decay coefficient (0: none); the other
        leaves take ``adamw.weight_decay``.
      weight_decay_method: "decoupled", "independent", "l2" or "palm" (see
        ``descend``).
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.
      adamw: the AdamW of the other leaves (``AdamW``).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "mop") and the AdamW leaves.

    References:
      Lau, Long & Su, "PolarGrad", arXiv:2505.21799, 2025.
    """
    direction = scale_by_mop(beta=beta, nesterov=nesterov, scale=scale, rms_factor=rms_factor,
                             momentum_dtype=momentum_dtype, plan=plan)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method)
    return with_adamw("mop", matrix, plan, learning_rate, adamw)


def mop_matrix_flops(m: int, n: int) -> int:
    """Textbook FLOPs of one MOP step on one m x n block (see ``mop_flops``)."""
    p, q = sorted((m, n))
    return 8 * q * p * p + 20 * p ** 3


def mop_flops(params, routing: Routing = Routing()) -> int:
    """Textbook FLOPs of one MOP step on ``params``.

    Per p x q block (p <= q) a thin R-SVD, 6 q p^2 + 20 p^3 (Golub & Van Loan,
    table 8.6.1), and the product U V^T, 2 q p^2. LAPACK's divide-and-conquer
    differs by a constant factor.

    Args:
      params: the params tree (real or abstract arrays, or an nnx.State; only the
        shapes and logical axes are read).
      routing: which leaves are matrices, as for ``mop``.

    Returns:
      The FLOPs, an int.
    """
    return flops_over_matrices(params, routing, mop_matrix_flops)
