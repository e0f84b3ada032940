"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner, as optax transformations.

Per matrix G (m x n, a block of a routed leaf), SOAP keeps the Kronecker
factors L = EMA(G G^T) and R = EMA(G^T G) and their eigenbases Q_L, Q_R, and
runs Adam on the rotated gradient Q_L^T G Q_R; the Adam direction is rotated
back with Q_L . Q_R^T. The bases come from ``eigh`` on the first step (which
makes no update, so the gradient that built a basis is never projected on
it) and are refreshed every ``precondition_frequency`` steps by one power
iteration and a QR decomposition, columns ordered by estimated eigenvalue.
The first moment is re-projected onto each new basis; the second moment is
only permuted with the columns (as in the paper's reference code).

A side longer than ``max_precond_dim`` keeps the identity (one-sided SOAP);
with both sides identity SOAP is exactly Adam. Dims are merged by the
routing's matrix view: a leaf [embed, heads, head_dim] is preconditioned as
one [embed, heads * head_dim] matrix (per-head blocks with
``Routing(per_head=True)``). Factors and bases are fp32, and their products
run at full fp32 precision (no TF32), since the rotations must be orthogonal.

Differences from the reference PyTorch code, kept on purpose: eps is added to
the bias-corrected sqrt(v) as in ``optax.adam`` (so identity bases give
Adam exactly); the first moment is re-projected only when the basis changes
(the reference projects it back and forth every step, an identity); weight
decay is optax's decoupled form on the pre-update weights.

Under a mesh, each matrix is handled whole in ``jax.shard_map`` on the
devices that hold its state (``jmegatron.optim.placement``): under ``owner``
and ``layerwise`` each rank preconditions its own matrices, with no
collective under ``owner``; under ``fsdp`` and for matrices split over the
tensor axis the shards are gathered first and every rank of the split
computes the whole matrix (duplicated).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jmegatron.optim import checks
from jmegatron.optim.matrix import (AdamW, PlanLike, PlanSource, WeightDecayMethod, at_step,
                                    descend, held_zeros, matrix_leaves, per_matrix,
                                    scale_by_matrix_optimizer, with_adamw)
from jmegatron.optim.plan import BLOCKS, HELD, matrix_state
from jmegatron.optim.routing import (Routing, flops_over_matrices, from_matrices,
                                     to_matrices)

_HIGHEST = lax.Precision.HIGHEST


class Factors(NamedTuple):
    """Shampoo's factors of one block and their eigenbases (None: identity side).

    Attributes:
      left: [*batch, m, m], SOAP's EMA of G G^T (REKLS: KL-Shampoo's left
        factor); None where the side is longer than ``max_precond_dim``.
      right: [*batch, n, n], SOAP's EMA of G^T G (REKLS: the right factor).
      q_left: [*batch, m, m], the left eigenbasis, columns by eigenvalue
        descending.
      q_right: [*batch, n, n], the right eigenbasis, likewise.
    """

    left: jax.Array | None       # [*batch, m, m]  EMA of G G^T
    right: jax.Array | None      # [*batch, n, n]  EMA of G^T G
    q_left: jax.Array | None     # [*batch, m, m]  eigenvectors, columns by eigenvalue desc
    q_right: jax.Array | None


@matrix_state(mu=HELD, nu=HELD, factors=BLOCKS)
class SoapState(NamedTuple):
    """The state of ``scale_by_soap`` (and of ``scale_by_rekls``).

    Attributes:
      count: the steps seen, an int32 scalar (SOAP's first makes no update).
      mu: the first moment, in the eigenbasis, held as the owners hold the params.
      nu: the second moment, likewise.
      factors: a tree mirroring the params: per matrix leaf a tuple of
        ``Factors``, one per block.
    """

    count: jax.Array              # int32 scalar: steps seen (the first makes no update)
    mu: optax.Updates             # first moment, in the eigenbasis, held like the params
    nu: optax.Updates             # second moment, likewise
    factors: optax.Updates        # mirrors the params: per leaf a tuple of Factors per block


def rotate(x, f: Factors, back: bool = False):
    """Q_L^T x Q_R into the eigenbasis, or with ``back`` Q_L x Q_R^T out of it."""
    left, right = (("...ik,...kj->...ij", "...ik,...jk->...ij") if back
                   else ("...ki,...kj->...ij", "...ik,...kj->...ij"))
    if f.q_left is not None:
        x = jnp.einsum(left, f.q_left, x, precision=_HIGHEST)
    if f.q_right is not None:
        x = jnp.einsum(right, x, f.q_right, precision=_HIGHEST)
    return x


def _accumulate(f: Factors, g, beta: float) -> Factors:
    """L <- beta L + (1 - beta) G G^T, R <- beta R + (1 - beta) G^T G."""
    ema = lambda old, new: None if old is None else beta * old + (1 - beta) * new
    return f._replace(
        left=ema(f.left, jnp.einsum("...ik,...jk->...ij", g, g, precision=_HIGHEST)),
        right=ema(f.right, jnp.einsum("...ki,...kj->...ij", g, g, precision=_HIGHEST)))


def eigenbasis(factor):
    """Eigenvectors of a symmetric factor, by eigenvalue descending."""
    if factor is None:
        return None
    return per_matrix(lambda f: jnp.linalg.eigh(f)[1], factor)[..., ::-1]


def _refresh(f: Factors, nu):
    """One power iteration + QR per side; the columns (and nu with them) are first
    sorted by the eigenvalues the old basis estimates, diag(Q^T F Q)."""
    bases = []
    for factor, q, axis in ((f.left, f.q_left, -2), (f.right, f.q_right, -1)):
        if factor is None:
            bases.append(None)
            continue
        estimate = jnp.einsum("...ki,...kl,...li->...i", q, factor, q, precision=_HIGHEST)
        order = jnp.argsort(-estimate, axis=-1)
        q = jnp.take_along_axis(q, order[..., None, :], axis=-1)
        nu = jnp.take_along_axis(nu, order[..., :, None] if axis == -2 else order[..., None, :],
                                 axis=axis)
        power = jnp.matmul(factor, q, precision=_HIGHEST)
        bases.append(per_matrix(lambda p: jnp.linalg.qr(p)[0], power))
    return f._replace(q_left=bases[0], q_right=bases[1]), nu


def soap_block(g, mu, nu, f: Factors, count, *, b1: float, b2: float, shampoo_beta: float,
               eps: float, precondition_frequency: int, bias_correction: bool = True):
    """One SOAP step of a stack of blocks [*batch, m, n] (all fp32).

    Returns (direction, mu, nu, factors); ``count`` is this step's number (1-based).
    """
    preconditioned = f.left is not None or f.right is not None
    t = count - 1 if preconditioned else count     # Adam steps taken, this one included

    def first():            # factors from the first gradient, bases by eigh, no update
        acc = _accumulate(f, g, shampoo_beta)
        acc = acc._replace(q_left=eigenbasis(acc.left), q_right=eigenbasis(acc.right))
        return jnp.zeros_like(g), mu, nu, acc

    def later():
        rotated = rotate(g, f)
        new_mu = b1 * mu + (1 - b1) * rotated
        new_nu = b2 * nu + (1 - b2) * rotated * rotated
        m_hat, v_hat = new_mu, new_nu
        if bias_correction:
            m_hat = new_mu / (1 - b1 ** t.astype(jnp.float32))
            v_hat = new_nu / (1 - b2 ** t.astype(jnp.float32))
        direction = rotate(m_hat / (jnp.sqrt(v_hat) + eps), f, back=True)
        if not preconditioned:
            return direction, new_mu, new_nu, f
        acc = _accumulate(f, g, shampoo_beta)

        def refresh(acc, new_mu, new_nu):
            plain_mu = rotate(new_mu, acc, back=True)
            acc, new_nu = _refresh(acc, new_nu)
            return acc, rotate(plain_mu, acc), new_nu

        acc, new_mu, new_nu = lax.cond(t % precondition_frequency == 0, refresh,
                                       lambda *args: args, acc, new_mu, new_nu)
        return direction, new_mu, new_nu, acc

    if not preconditioned:
        return later()
    return lax.cond(count == 1, first, later)


def _empty_factors(stack_shape: tuple[int, ...], max_precond_dim: int,
                   basis: str = "zeros") -> Factors:
    """Zero factors of a block stack [*batch, m, n] (None: identity side) and bases
    of zeros (SOAP: its first step builds them by eigh) or ``"identity"``."""
    *batch, m, n = stack_shape
    zeros = lambda k: jnp.zeros((*batch, k, k), jnp.float32)
    eye = lambda k: jnp.broadcast_to(jnp.eye(k, dtype=jnp.float32), (*batch, k, k))
    start = eye if basis == "identity" else zeros
    side = lambda k, make: None if k > max_precond_dim else make(k)
    return Factors(side(m, zeros), side(n, zeros), side(m, start), side(n, start))


BlockStep = Callable[..., tuple]   # (g, mu, nu, factors, count) -> (direction, mu, nu, factors)


def scale_by_eigenbasis_adam(who: str, block: BlockStep, max_precond_dim: int,
                             source: PlanSource, basis: str = "zeros"
                             ) -> optax.GradientTransformation:
    """The skeleton of SOAP-like optimizers (Adam in a per-block eigenbasis, state
    ``SoapState``): ``block`` steps one stack of blocks; the bases start as
    ``basis`` (see ``_empty_factors``)."""
    checks.integer("max_precond_dim", max_precond_dim, 0)

    def init_stack(x, leaf):
        zeros = held_zeros(x, leaf, jnp.float32)
        factors = tuple(_empty_factors(s.shape, max_precond_dim, basis)
                        for s in to_matrices(zeros, leaf.route.spec))
        return zeros, jnp.copy(zeros), factors

    def update_stack(g, fields, count, leaf):
        mu, nu, factors = fields
        spec = leaf.route.spec
        blocks = [block(*args, count) for args in zip(
            to_matrices(g, spec), to_matrices(mu, spec), to_matrices(nu, spec), factors)]
        direction, m, v, f = (list(z) for z in zip(*blocks))
        direction, m, v = (from_matrices(z, spec, g.shape) for z in (direction, m, v))
        return direction, (m, v, tuple(f))

    return scale_by_matrix_optimizer(who, SoapState, init_stack, update_stack, source,
                                     whole_matrices=True)


def scale_by_soap(*, b1: float = 0.95, b2: float = 0.95, shampoo_beta: float | None = None,
                  eps: float = 1e-8, precondition_frequency: int = 10,
                  max_precond_dim: int = 10_000, bias_correction: bool = True,
                  plan: PlanLike = None) -> optax.GradientTransformation:
    """SOAP's direction for matrix leaves: Adam in the eigenbasis of Shampoo's factors.

    Every leaf must be a matrix or a stack of them under ``routing``; ``soap``
    sends the others to AdamW. ``shampoo_beta`` (the factors' EMA decay)
    defaults to ``b2``. A block side longer than ``max_precond_dim`` is not
    preconditioned. ``mesh``, ``layout`` and ``plan`` place state and work as
    for ``scale_by_muon``.

    Arguments, leaves and ``plan`` are checked as for ``scale_by_muon``. A NaN
    or an inf in a block's gradient enters its moments and factors (and the
    bases built from them): the block's update is NaN (wholly where both sides
    are preconditioned, else in the rows or columns the rotation mixes it into),
    on that step and every later one. ``jmegatron.train``'s step skips
    non-finite steps; in your own chain use ``optax.apply_if_finite``.

    Args:
      b1: the first moment's decay.
      b2: the second moment's decay.
      shampoo_beta: the factors' EMA decay; None: ``b2``.
      eps: added to the (bias-corrected) sqrt(v), as in ``optax.adam``.
      precondition_frequency: the Adam steps between refreshes of the bases (one
        power iteration and a QR each); >= 1.
      max_precond_dim: a block side longer than this keeps the identity basis
        (no factor).
      bias_correction: Adam's bias correction of both moments, counted in Adam
        steps (from the second step where a side is preconditioned).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.

    Returns:
      An ``optax.GradientTransformation`` (state ``SoapState``) whose updates are
      the Adam directions rotated back, before the learning rate and sign; zero
      on the first step of a block with a preconditioned side.

    References:
      Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam",
        arXiv:2409.11321, 2024.
      Gupta et al., "Shampoo: Preconditioned Stochastic Tensor Optimization",
        arXiv:1802.09568, 2018.
    """
    checks.fraction("b1", b1)
    checks.fraction("b2", b2)
    checks.fraction("shampoo_beta", shampoo_beta, optional=True)
    checks.positive("eps", eps)   # a zero gradient gives 0 / 0
    checks.integer("precondition_frequency", precondition_frequency, 1)
    block = functools.partial(
        soap_block, b1=b1, b2=b2, shampoo_beta=b2 if shampoo_beta is None else shampoo_beta,
        eps=eps, precondition_frequency=precondition_frequency, bias_correction=bias_correction)
    return scale_by_eigenbasis_adam("scale_by_soap", block, max_precond_dim,
                                    PlanSource.of(plan))


def add_decayed_weights_after_basis_step(weight_decay, source: PlanSource = PlanSource(),
                                         max_precond_dim: int = 10_000
                                         ) -> optax.GradientTransformation:
    """``optax.add_decayed_weights`` for SOAP's matrices (``weight_decay`` a number or
    a function of the step), except on the first step of every block with a
    preconditioned side: that step only builds the eigenbases, its direction is
    zero, and the weights must stay exactly as they are. (A block with no
    preconditioned side is plain Adam from the first step, and decays with it.)"""

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params):
        plan = source(params)
        subs, out = plan.split(params), plan.split(updates)
        for i, leaf in matrix_leaves(plan, subs, "SOAP's weight decay"):
            p, spec = jax.tree.leaves(subs[i])[0], leaf.route.spec
            builds = from_matrices([jnp.full(b.shape, min(b.shape[-2:]) <= max_precond_dim)
                                    for b in to_matrices(p, spec)], spec, p.shape)
            rate = jnp.where(builds & (state.count == 0), 0.0, at_step(weight_decay, state.count))
            out[i] = jax.tree.map(lambda g: g + rate * p, out[i])
        return plan.join(out), optax.ScaleByScheduleState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def soap(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.95, b2: float = 0.95,
         shampoo_beta: float | None = None, eps: float = 1e-8,
         precondition_frequency: int = 10, max_precond_dim: int = 10_000,
         bias_correction: bool = True, weight_decay: float = 0.0,
         weight_decay_method: WeightDecayMethod = "decoupled",
         plan: PlanLike = None, adamw: AdamW = AdamW()
         ) -> optax.GradientTransformation:
    """SOAP for hidden matrices, AdamW for every other leaf.

    ``routing`` (or ``plan``) decides which leaves are matrices. Matrices get
    ``-lr * soap_direction`` and weight decay by ``weight_decay_method``
    (``jmegatron.optim.matrix.descend``; "l2" feeds ``g + wd * W`` to the factors
    too), and nothing on the first step, which only builds the eigenbases (no
    direction, no weight decay; blocks with no preconditioned side are Adam
    from the first step). The other leaves get ``adamw``'s.

    Args:
      learning_rate: a number or an optax schedule of the step; also AdamW's
        unless ``adamw.learning_rate`` is set.
      b1: the first moment's decay.
      b2: the second moment's decay.
      shampoo_beta: the factors' EMA decay; None: ``b2``.
      eps: added to the (bias-corrected) sqrt(v).
      precondition_frequency: the Adam steps between refreshes of the bases.
      max_precond_dim: a block side longer than this is not preconditioned.
      bias_correction: Adam's bias correction of both moments.
      weight_decay: the matrices' weight decay coefficient (0: none); the other
        leaves take ``adamw.weight_decay``.
      weight_decay_method: "decoupled", "independent", "l2" or "palm" (see
        ``descend``).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.
      adamw: the AdamW of the other leaves (``AdamW``).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "soap") and the AdamW leaves.

    References:
      Vyas et al., "SOAP: Improving and Stabilizing Shampoo using Adam",
        arXiv:2409.11321, 2024.
    """
    source = PlanSource.of(plan)
    direction = scale_by_soap(b1=b1, b2=b2, shampoo_beta=shampoo_beta, eps=eps,
                              precondition_frequency=precondition_frequency,
                              max_precond_dim=max_precond_dim, bias_correction=bias_correction,
                              plan=plan)
    decay = lambda rate: add_decayed_weights_after_basis_step(rate, source, max_precond_dim)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method, decay)
    return with_adamw("soap", matrix, plan, learning_rate, adamw)


def soap_matrix_flops(m: int, n: int, precondition_frequency: int = 10,
                      max_precond_dim: int = 10_000) -> float:
    """Matmul FLOPs of one SOAP step on one m x n block (see ``soap_flops``)."""
    sides = [p for p in (m, n) if p <= max_precond_dim]
    per_step = sum(6 * m * n * p for p in sides)
    per_refresh = sum((4 + 2 + 4 / 3) * p ** 3 for p in sides)
    return per_step + per_refresh / precondition_frequency


def soap_flops(params, routing: Routing = Routing(), precondition_frequency: int = 10,
               max_precond_dim: int = 10_000) -> int:
    """Matmul FLOPs of one SOAP step on ``params``.

    Per m x n block, for each side p in {m, n} that is preconditioned: rotating
    the gradient in and the direction back (4 mnp) and the factor update
    (2 mnp) every step; per refresh, amortized: the eigenvalue estimate (4 p^3),
    one power iteration (2 p^3) and QR (4/3 p^3, Householder). The first step's
    eigh is left out.

    Args:
      params: the params tree (real or abstract arrays, or an nnx.State; only the
        shapes and logical axes are read).
      routing: which leaves are matrices, as for ``soap``.
      precondition_frequency: the steps between refreshes, as for ``soap``.
      max_precond_dim: the longest side that is preconditioned, as for ``soap``.

    Returns:
      The FLOPs, an int.
    """
    return flops_over_matrices(params, routing, lambda m, n: soap_matrix_flops(
        m, n, precondition_frequency, max_precond_dim))
