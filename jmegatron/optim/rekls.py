"""REKLS ("Realtime Eigen KL SOAP"): Adam in the eigenbasis of KL-Shampoo's factors,
refreshed by ``eigh`` every step, as optax transformations.

Per matrix G (m x n, a block of a routed leaf; jmegatron's [fan_in, fan_out]),
step t (1-based), with factors L [m, m], R [n, n] (zero at the start), their
eigenbases Q_L, Q_R (identity at the start), and Adam's moments mu, nu kept
in the eigenbasis:

  1. sb_t = 1 - (1 - shampoo_beta) / (1 - shampoo_beta^t)  (bias-corrected; sb_1 = 0).
  2. KL-Shampoo's factor update, with the old factors and bases:
       lam_L = diag(Q_L^T L Q_L),  C_L = Q_L diag(1 / (m max(lam_L, eps))) Q_L^T,
       lam_R = diag(Q_R^T R Q_R),  C_R = Q_R diag(1 / (n max(lam_R, eps))) Q_R^T,
       L <- sb_t L + (1 - sb_t) G C_R G^T,   R <- sb_t R + (1 - sb_t) G^T C_L G
     (L's update is divided by the number of columns n, R's by the number of
     rows m: the algorithm is the same on G^T with the sides swapped, so
     PyTorch's [out, in] weights and ours give the same updates).
  3. New bases every step, from the factors that already hold this step's
     gradient ("realtime"): the first moment goes out of the old bases
     (Q_L mu Q_R^T) and into the new ones; the second moment is only permuted,
     its rows and columns sorted by the eigenvalues the old bases estimate for
     the new factors, diag(Q^T F Q) descending; the new bases are ``eigh``'s
     eigenvectors, by eigenvalue descending.
  4. Adam on Q_L^T G Q_R in the new bases, bias-corrected, eps added to
     sqrt(v_hat); the direction is rotated back with Q_L . Q_R^T. The first
     step makes an update (SOAP's first step only builds its bases).

A side longer than ``max_precond_dim`` keeps the identity basis and has no
factor (EO has no such option): the other side's KL correction then uses
C = I / dim, i.e. lam = 1 for the missing side, since a factor's scale does
not change its eigenbasis (L <- sb_t L + (1 - sb_t) G G^T / n). With both
sides identity REKLS is Adam.

Numerics (EO's semantics, kept; measured in tests/test_rekls.py): at step 1
lam = 0 is clamped to eps, so the first factors are G G^T / (n eps) and
G^T G / (m eps) (1e8 |G|^2 for eps = 1e-8). Three consequences:
  - Step 1's bases are G's singular vectors, so Q_L^T G Q_R is diagonal in
    exact arithmetic; fp32 leaves ~1e-7 |G| off the diagonal, and Adam's
    division by (|x| + eps) makes that +-O(1): for eps << 1e-7 |G| the first
    direction of a two-sided block is U V^T plus round-off of RMS ~0.8.
  - Later gradients enter the factors at ~eps^2 of the first one's scale, so
    on a square block the bases stay the first gradient's for a few hundred
    steps, until shampoo_beta^t has decayed it (float64, 6 x 6, eps = 1e-8:
    unchanged through step 200).
  - On a non-square block the longer side's first factor is rank-deficient;
    its null eigenvalues are round-off of the 1/eps scale, clamped at eps,
    and the next KL correction weighs that null space by their inverse: not
    reproducible across precisions.
Factors and bases are fp32, and their products run at full fp32 precision
(no TF32).

Under a mesh, each matrix is handled whole in ``jax.shard_map`` on the
devices that hold its state, exactly as SOAP's (``jmegatron.optim.soap``).
``eigh`` on CPU runs one matrix at a time (``matrix.per_matrix``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import optax
from jax import lax

from jmegatron.optim import checks
from jmegatron.optim.matrix import (AdamW, PlanLike, PlanSource, WeightDecayMethod, descend,
                                    with_adamw)
from jmegatron.optim.routing import Routing, flops_over_matrices
from jmegatron.optim.soap import Factors, eigenbasis, rotate, scale_by_eigenbasis_adam

_HIGHEST = lax.Precision.HIGHEST


def _estimated_eigvals(factor, q):
    """diag(Q^T F Q): the eigenvalues the basis Q estimates for the factor F."""
    return jnp.einsum("...ki,...kl,...li->...i", q, factor, q, precision=_HIGHEST)


def _kl_correction(factor, q, dim: int, eps: float):
    """C = Q diag(1 / (dim max(lam, eps))) Q^T with lam = diag(Q^T F Q); None (for
    I / dim) on a side with no factor."""
    if factor is None:
        return None
    scale = 1.0 / (dim * jnp.maximum(_estimated_eigvals(factor, q), eps))
    return jnp.einsum("...ik,...k,...jk->...ij", q, scale, q, precision=_HIGHEST)


def _sandwich(g, c, dim: int, transpose: bool):
    """G C G^T (or with ``transpose`` G^T C G); ``c`` None stands for I / dim."""
    if transpose:
        g = jnp.swapaxes(g, -1, -2)
    if c is None:
        return jnp.einsum("...ik,...jk->...ij", g, g, precision=_HIGHEST) / dim
    gc = jnp.einsum("...ik,...kl->...il", g, c, precision=_HIGHEST)
    return jnp.einsum("...il,...jl->...ij", gc, g, precision=_HIGHEST)


def _kl_accumulate(f: Factors, g, beta, eps: float) -> Factors:
    """KL-Shampoo's factor update (module docstring, step 2), from the old factors
    and bases; ``beta`` is this step's (bias-corrected) decay."""
    m, n = g.shape[-2:]     # a side's correction serves only the other side's factor
    c_left = None if f.right is None else _kl_correction(f.left, f.q_left, m, eps)
    c_right = None if f.left is None else _kl_correction(f.right, f.q_right, n, eps)
    ema = lambda old, new: None if old is None else beta * old + (1 - beta) * new
    return f._replace(left=ema(f.left, _sandwich(g, c_right, n, transpose=False)),
                      right=ema(f.right, _sandwich(g, c_left, m, transpose=True)))


def _permute_nu(f: Factors, old: Factors, nu):
    """nu's rows (columns) in the order of the eigenvalues the old left (right) basis
    estimates for the new factor, descending (EO's sort_eigenbasis_by_approx_eigvals;
    the sorted bases themselves are not used)."""
    for factor, q, axis in ((f.left, old.q_left, -2), (f.right, old.q_right, -1)):
        if factor is None:
            continue
        order = jnp.argsort(-_estimated_eigvals(factor, q), axis=-1)
        index = order[..., :, None] if axis == -2 else order[..., None, :]
        nu = jnp.take_along_axis(nu, index, axis=axis)
    return nu


def rekls_block(g, mu, nu, f: Factors, count, *, b1: float, b2: float, shampoo_beta: float,
                eps: float):
    """One REKLS step of a stack of blocks [*batch, m, n]: the module docstring's steps 1-4.

    Args:
      g: the gradient, a stack of blocks [*batch, m, n], fp32.
      mu: the first moment, in the bases of ``f``, [*batch, m, n] fp32.
      nu: the second moment, likewise.
      f: the blocks' ``Factors`` before this step (None sides: identity).
      count: this step's number, 1-based (an int32 scalar).
      b1: the first moment's decay.
      b2: the second moment's decay.
      shampoo_beta: the factors' EMA decay, before its bias correction.
      eps: Adam's epsilon (added to sqrt(v_hat)) and the floor of KL-Shampoo's
        eigenvalues.

    Returns:
      (direction, mu, nu, factors): the Adam direction rotated back, and the
      moments and factors of this step, in its new bases.
    """
    t = count.astype(jnp.float32)
    if f.left is None and f.right is None:     # both sides identity: Adam
        new = f
    else:
        beta = 1 - (1 - shampoo_beta) / (1 - shampoo_beta ** t)
        acc = _kl_accumulate(f, g, beta, eps)
        nu = _permute_nu(acc, f, nu)
        new = acc._replace(q_left=eigenbasis(acc.left), q_right=eigenbasis(acc.right))
        mu = rotate(rotate(mu, f, back=True), new)
    rotated = rotate(g, new)
    mu = b1 * mu + (1 - b1) * rotated
    nu = b2 * nu + (1 - b2) * rotated * rotated
    m_hat, v_hat = mu / (1 - b1 ** t), nu / (1 - b2 ** t)
    direction = rotate(m_hat / (jnp.sqrt(v_hat) + eps), new, back=True)
    return direction, mu, nu, new


def scale_by_rekls(*, b1: float = 0.9, b2: float = 0.95, shampoo_beta: float = 0.95,
                   eps: float = 1e-8, max_precond_dim: int = 10_000,
                   plan: PlanLike = None) -> optax.GradientTransformation:
    """REKLS's direction for matrix leaves: Adam in the eigenbasis of KL-Shampoo's factors.

    Every leaf must be a matrix or a stack of them under ``routing``; ``rekls``
    sends the others to AdamW. State ``SoapState``: the bases start as the
    identity, the factors at zero.

    ``shampoo_beta`` is the factors' EMA decay (bias-corrected), ``eps`` both Adam's
    and the floor of KL-Shampoo's eigenvalues (as in EO). A block side longer than
    ``max_precond_dim`` is not preconditioned (module docstring). ``mesh``,
    ``layout`` and ``plan`` place state and work as for ``scale_by_soap``.

    Arguments, leaves and ``plan`` are checked as for ``scale_by_muon``. A NaN
    or an inf in a block's gradient enters its factors, bases and moments: the
    block's update is NaN on that step and every later one, as for
    ``scale_by_soap``.

    Args:
      b1: the first moment's decay.
      b2: the second moment's decay.
      shampoo_beta: the factors' EMA decay, in [0, 1), bias-corrected.
      eps: Adam's epsilon (added to sqrt(v_hat)) and the floor of KL-Shampoo's
        eigenvalues.
      max_precond_dim: a block side longer than this keeps the identity basis
        (no factor).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.

    Returns:
      An ``optax.GradientTransformation`` (state ``SoapState``) whose updates are
      the Adam directions rotated back, before the learning rate and sign.

    References:
      Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam",
        arXiv:2409.11321, 2024.
      Lin et al., "Understanding and Improving Shampoo and SOAP via
        Kullback-Leibler Minimization", arXiv:2509.03378, 2025.
      NVIDIA NeMo Emerging-Optimizers 0.3.0, ``emerging_optimizers.soap.REKLS``
        (SOAP with use_eigh=True, use_kl_shampoo=True), 2026.
    """
    checks.fraction("b1", b1)
    checks.fraction("b2", b2)
    checks.fraction("shampoo_beta", shampoo_beta)   # 1 would divide by 1 - 1^t = 0
    checks.positive("eps", eps)   # also the floor of the eigenvalues it divides by
    block = functools.partial(rekls_block, b1=b1, b2=b2, shampoo_beta=shampoo_beta, eps=eps)
    return scale_by_eigenbasis_adam("scale_by_rekls", block, max_precond_dim,
                                    PlanSource.of(plan),
                                    basis="identity")


def rekls(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.9, b2: float = 0.95,
          shampoo_beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.01,
          weight_decay_method: WeightDecayMethod = "decoupled", max_precond_dim: int = 10_000,
          plan: PlanLike = None, adamw: AdamW = AdamW()
          ) -> optax.GradientTransformation:
    """REKLS for hidden matrices, AdamW for every other leaf.

    ``routing`` (or ``plan``) decides which leaves are matrices. Matrices get
    ``-lr * rekls_direction`` and weight decay by ``weight_decay_method``
    (``jmegatron.optim.matrix.descend``; "l2" feeds ``g + wd * W`` to the factors
    too) on every step, the first included (it is a real update). The other
    leaves get ``adamw``'s. Defaults are EO's.

    Args:
      learning_rate: a number or an optax schedule of the step; also AdamW's
        unless ``adamw.learning_rate`` is set.
      b1: the first moment's decay.
      b2: the second moment's decay.
      shampoo_beta: the factors' EMA decay, in [0, 1), bias-corrected.
      eps: Adam's epsilon and the floor of KL-Shampoo's eigenvalues.
      weight_decay: the matrices' weight decay coefficient (0: none); the other
        leaves take ``adamw.weight_decay``.
      weight_decay_method: "decoupled", "independent", "l2" or "palm" (see
        ``descend``).
      max_precond_dim: a block side longer than this is not preconditioned.
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.
      adamw: the AdamW of the other leaves (``AdamW``).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "rekls") and the AdamW leaves.

    References:
      Lin et al., "Understanding and Improving Shampoo and SOAP via
        Kullback-Leibler Minimization", arXiv:2509.03378, 2025.
      NVIDIA NeMo Emerging-Optimizers 0.3.0, ``emerging_optimizers.soap.REKLS``, 2026.
    """
    direction = scale_by_rekls(b1=b1, b2=b2, shampoo_beta=shampoo_beta, eps=eps,
                               max_precond_dim=max_precond_dim, plan=plan)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method)
    return with_adamw("rekls", matrix, plan, learning_rate, adamw)


def rekls_matrix_flops(m: int, n: int, max_precond_dim: int = 10_000) -> int:
    """Matmul FLOPs of one REKLS step on one m x n block (see ``rekls_flops``)."""
    per_step = 0
    for p, o in ((m, n), (n, m)):
        if p > max_precond_dim:
            continue
        per_step += 8 * m * n * p + 2 * p ** 3 + 2 * p * p * o
        if o <= max_precond_dim:
            per_step += 2 * p * o * o + 4 * p ** 3
    return per_step


def rekls_flops(params, routing: Routing = Routing(), max_precond_dim: int = 10_000) -> int:
    """Matmul FLOPs of one REKLS step on ``params``.

    Per m x n block, for each side p in {m, n} that is preconditioned (o: the
    other side): rotating the old first moment out and into the new basis, the
    gradient in and the direction back (8 mnp); the sort's eigenvalue estimate
    (2 p^3); the factor update G C_o G^T (2 p^2 o, plus 2 p o^2 when o is
    preconditioned); and when o is preconditioned, p's KL correction C_p (its
    eigenvalue estimate and Q diag Q^T: 4 p^3). The ``eigh`` of every
    preconditioned factor each step (not a matmul: LAPACK/cuSOLVER, about 9 p^3
    FLOPs with eigenvectors, Golub & Van Loan) is left out. XLA's cost analysis
    of one 64 x 128 block counts 1-2% more (the elementwise work), two-sided or
    one-sided.

    Args:
      params: the params tree (real or abstract arrays, or an nnx.State; only the
        shapes and logical axes are read).
      routing: which leaves are matrices, as for ``rekls``.
      max_precond_dim: the longest side that is preconditioned, as for ``rekls``.

    Returns:
      The FLOPs, an int.
    """
    return flops_over_matrices(params, routing,
                               lambda m, n: rekls_matrix_flops(m, n, max_precond_dim))
