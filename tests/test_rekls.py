"""REKLS against an independent float64 NumPy implementation of its equations,
against optax's Adam with identity bases, on rank-deficient gradients, its weight
decay and its FLOP count.

What fp32 can and cannot reproduce (measured with this file's gradient streams,
seeds 0 and 1, 6 steps; error = max |fp32 - float64| / max |float64| per step):

- Two-sided blocks, step 1: the first factors are G G^T / (n eps) and
  G^T G / (m eps), so the new bases are G's singular vectors and Q_L^T G Q_R is
  diagonal in exact arithmetic. fp32 leaves ~1e-7 off the diagonal, which
  Adam's division by (|x| + eps), eps = 1e-8, turns into +-0.99: on a 6 x 6
  block the step-1 direction is U V^T (exact to 3e-6 on the diagonal of
  U^T D V) plus off-diagonal round-off of RMS ~0.8 (EO computes the same in
  fp32). The moments keep that round-off at its own size, so from step 2 on a
  square block agrees again: <= 3.8e-6 element-wise on one machine, 1.3e-5 on
  another (4.1e-6 relative; see the square test).
- Two-sided non-square blocks at eps = 1e-8 never agree (0.3-2 at every
  step): the longer side's first factor is rank-deficient, its null
  eigenvalue is round-off of a ~2e8-sized factor (on 5 x 6: 1.4 and -0.4 in
  fp32, 1e-9 and 8e-11 in float64), clamped at eps, and the next KL
  correction weighs that null space by its inverse; the factors' eigenvalue
  spread (~1/eps^2) also leaves fp32 eigh's small eigenvectors undetermined.
  With eps well above those round-offs (eps^2 >> u |G|^2 / dim, and
  eps >> u |G| for the zero entries above; u = 6e-8, |G| ~ 5 here) both
  precisions clamp the same eigenvalues to exactly eps: eps = 0.3 gives
  <= 4.4e-6 on 5 x 6 and 6 x 5 (eps = 0.1: 1.6e-5, 1e-2: 1.9e-4, 1e-4: 0.9).
  A null space of dimension > 1 (4 x 9) stays basis-dependent even then:
  EO's sort of nu orders the arbitrary null-space columns by their estimated
  eigenvalues, which interleave with the range's once eps is large (5.6e-2
  at eps = 0.3, 1.4e-4 at 0.1); not tested.
- One-sided blocks (the long side the identity, C = I / dim for it) have no
  such null space: <= 1.5e-6 at eps = 1e-8.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmegatron.optim import MatrixSpec, PlanSpec, Route, Routing
from jmegatron.optim.rekls import rekls, rekls_block, rekls_flops, scale_by_rekls
from jmegatron.optim.routing import MATRIX
from jmegatron.optim.soap import _empty_factors

B1, B2, SB, EPS = 0.9, 0.95, 0.95, 1e-8
STEPS = 6
TOL = 1e-5      # directions are O(1): rtol and atol


class PaperREKLS:
    """REKLS for one m x n matrix in float64, written from the equations (EO 0.3.0's
    SOAP with use_eigh and use_kl_shampoo, in the [in, out] convention): the
    bias-corrected KL-Shampoo factor update with the old factors and bases; the
    first moment out of the old bases and into the new; the second moment's rows
    and columns sorted by diag(Q_old^T F_new Q_old) descending; new bases by eigh,
    eigenvalues descending; then Adam in the new bases. A side longer than
    ``max_dim`` has no factor and keeps the identity, and the other side's
    correction is then I / dim."""

    def __init__(self, m, n, max_dim, eps):
        self.factors = [np.zeros((k, k)) if k <= max_dim else None for k in (m, n)]
        self.bases = [np.eye(k) for k in (m, n)]
        self.M, self.V = np.zeros((m, n)), np.zeros((m, n))
        self.eps, self.t = eps, 0

    def step(self, G):
        self.t += 1
        t = self.t
        if any(F is not None for F in self.factors):
            self._factors_and_bases(G, 1 - (1 - SB) / (1 - SB ** t))
        QL, QR = self.bases
        rotated = QL.T @ G @ QR
        self.M = B1 * self.M + (1 - B1) * rotated
        self.V = B2 * self.V + (1 - B2) * rotated ** 2
        N = (self.M / (1 - B1 ** t)) / (np.sqrt(self.V / (1 - B2 ** t)) + self.eps)
        return QL @ N @ QR.T

    def _factors_and_bases(self, G, beta):
        old = self.bases
        CL, CR = [np.eye(k) / k if F is None else
                  Q @ np.diag(1 / (k * np.maximum(np.diag(Q.T @ F @ Q), self.eps))) @ Q.T
                  for F, Q, k in zip(self.factors, old, G.shape)]
        grams = (G @ CR @ G.T, G.T @ CL @ G)
        self.factors = [None if F is None else beta * F + (1 - beta) * S
                        for F, S in zip(self.factors, grams)]
        plain = old[0] @ self.M @ old[1].T
        for side, (F, Q) in enumerate(zip(self.factors, old)):
            if F is not None:
                order = np.argsort(-np.diag(Q.T @ F @ Q))
                self.V = self.V[order] if side == 0 else self.V[:, order]
        self.bases = [Q if F is None else np.linalg.eigh(F)[1][:, ::-1]
                      for F, Q in zip(self.factors, old)]
        self.M = self.bases[0].T @ plain @ self.bases[1]


STACK = Routing(custom=lambda path, shape, logical: Route(MATRIX, "test stack",
                                                          MatrixSpec((1,), (2,))))


def stacked_streams(shape, seeds=(0, 1)):
    """Per step a {"w": [2, m, n]} fp32 gradient (one random stream per matrix)."""
    rngs = [np.random.default_rng(s) for s in seeds]
    return [{"w": jnp.asarray(np.stack([r.standard_normal(shape) * (1 + 0.3 * i) for r in rngs]),
                              jnp.float32)} for i in range(STEPS)]


def run(tx, grads):
    """Directions of ``tx`` (jitted once) for a list of gradient trees."""
    params = jax.tree.map(jnp.zeros_like, grads[0])
    state, update, out = tx.init(params), jax.jit(tx.update), []
    for g in grads:
        direction, state = update(g, state, params)
        out.append(direction)
    return out, state


def against_reference(shape, max_dim, eps, first_step=1, by_norm=False):
    """Both matrices of a [2, m, n] stack against float64, from ``first_step`` on:
    element-wise, or ``by_norm`` (|got - want|_F / |want|_F)."""
    grads = stacked_streams(shape)
    tx = scale_by_rekls(b1=B1, b2=B2, shampoo_beta=SB, eps=eps, max_precond_dim=max_dim,
                        plan=PlanSpec(routing=STACK))
    got, _ = run(tx, grads)
    for k in range(2):
        paper = PaperREKLS(*shape, max_dim, eps)
        for i, g in enumerate(grads):
            want = paper.step(np.asarray(g["w"][k], np.float64))
            if i + 1 < first_step:
                continue
            if by_norm:
                error = np.linalg.norm(np.asarray(got[i]["w"][k]) - want) / np.linalg.norm(want)
                assert error < TOL, f"matrix {k}, step {i + 1}: relative error {error:.2e}"
            else:
                np.testing.assert_allclose(np.asarray(got[i]["w"][k]), want, rtol=TOL, atol=TOL,
                                           err_msg=f"matrix {k}, step {i + 1}")
    return grads, got


@pytest.mark.parametrize("shape,max_dim,eps", [
    ((5, 6), 100, 0.3),     # two-sided, R rank-deficient at step 1: eps above round-off
    ((6, 5), 100, 0.3),
    ((4, 9), 6, EPS),       # one-sided: the long side stays the identity
    ((9, 4), 6, EPS),
], ids=["wide", "tall", "one-sided-wide", "one-sided-tall"])
def test_equals_the_equations_step_by_step(shape, max_dim, eps):
    """A stack of two matrices for 6 steps against float64 at 1e-5 (module
    docstring: why two-sided non-square blocks need eps = 0.3)."""
    against_reference(shape, max_dim, eps)


def test_square_block_from_step_two_and_the_first_step_polar_factor():
    """Square, default eps: steps 2-6 against float64 at 1e-5 relative (Frobenius). Step
    1 is, in exact arithmetic, U diag(s / (s + eps)) V^T (G = U S V^T): its diagonal
    in G's singular bases agrees at 1e-5; off the diagonal fp32 computes Adam's
    division of round-off (module docstring), bounded by 1.

    By norm, not element by element: the bases stay G_1's singular vectors, which
    fp32 eigh finds to about u * lambda_max / min gap = 6e-8 * 44 = 2.7e-6 here
    (Davis-Kahan), and where that error lands depends on the LAPACK kernels
    OpenBLAS picks for the CPU. Step 2's largest entry error was 3.8e-6 on one
    machine and 1.3e-5 on an AMD EPYC, where the relative error is 4.1e-6 (steps
    3-6: <= 4.5e-6). A wrong formula is off by O(0.1)."""
    grads, got = against_reference((6, 6), 100, EPS, first_step=2, by_norm=True)
    for k in range(2):
        g = np.asarray(grads[0]["w"][k], np.float64)
        u, s, vt = np.linalg.svd(g)
        rotated = u.T @ np.asarray(got[0]["w"][k], np.float64) @ vt.T
        np.testing.assert_allclose(np.diag(rotated), s / (s + EPS), atol=TOL)
        assert np.abs(rotated).max() < 1 + TOL


def test_identity_bases_are_adam():
    rng = np.random.default_rng(3)
    grads = [{"w": jnp.asarray(rng.standard_normal((4, 7)), jnp.float32)} for _ in range(STEPS)]
    tx = scale_by_rekls(b1=B1, b2=B2, eps=EPS, max_precond_dim=0, plan=PlanSpec(routing=STACK))
    got, _ = run(tx, [{"w": g["w"][None]} for g in grads])
    want, _ = run(optax.scale_by_adam(b1=B1, b2=B2, eps=EPS), grads)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a["w"][0], b["w"], rtol=1e-6, atol=1e-7)


def test_bases_stay_orthonormal_and_state_finite_on_rank_deficient_gradients():
    """A zero first gradient (zero factors), then rank-one gradients with zeros in
    between, default eps: factors singular throughout and scaled by 1 / eps, yet
    eigh keeps orthonormal bases and nothing overflows."""
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal((2, 8, 1)), rng.standard_normal((2, 1, 6))
    grads = [{"w": jnp.asarray((u @ v) * (i % 3 != 0), jnp.float32)} for i in range(8)]
    got, state = run(scale_by_rekls(plan=PlanSpec(routing=STACK)), grads)
    assert all(bool(jnp.all(jnp.isfinite(d["w"]))) for d in got)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
    assert float(jnp.abs(got[0]["w"]).max()) == 0.0      # a zero gradient moves nothing
    (factors,) = state.factors["w"]
    for q in (factors.q_left, factors.q_right):
        eye = jnp.broadcast_to(jnp.eye(q.shape[-1]), q.shape)
        np.testing.assert_allclose(jnp.swapaxes(q, -1, -2) @ q, eye, atol=1e-5)


@pytest.mark.parametrize("method", ["decoupled", "independent"])
def test_weight_decay_applies_by_its_method_from_the_first_step(method):
    """A zero gradient has a zero direction, so the first update is the decay alone:
    -lr * wd * W (decoupled) or -wd * W (independent); AdamW's leaf (no decay) stays."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((4, 6)), jnp.float32),
              "bias": jnp.asarray(rng.standard_normal(6), jnp.float32)}
    lr, wd = 1e-2, 0.1
    tx = rekls(lr, weight_decay=wd, weight_decay_method=method)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zero, tx.init(params), params)
    rate = lr * wd if method == "decoupled" else wd
    np.testing.assert_allclose(updates["w"], -rate * params["w"], rtol=1e-6)
    assert float(jnp.abs(updates["bias"]).max()) == 0.0


def test_rejects_a_bias_corrected_shampoo_beta_of_one():
    with pytest.raises(ValueError, match="shampoo_beta"):
        scale_by_rekls(shampoo_beta=1.0)


@pytest.mark.parametrize("max_dim", [100, 40], ids=["two-sided", "one-sided"])
def test_flops_match_xla_cost_analysis(max_dim):
    """rekls_flops (matmuls only, eigh left out) within 5% of XLA's count for one
    32 x 64 block (XLA adds the elementwise work; its eigh is a library call)."""
    block = functools.partial(rekls_block, b1=B1, b2=B2, shampoo_beta=SB, eps=EPS)
    z = jnp.zeros((32, 64), jnp.float32)
    factors = _empty_factors(z.shape, max_dim, "identity")
    cost = jax.jit(block).lower(z, z, z, factors, jnp.int32(2)).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    ours = rekls_flops({"w": z}, max_precond_dim=max_dim)
    assert 0.95 * xla <= ours <= xla, (ours, xla)
