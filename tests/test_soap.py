"""SOAP against an independent float64 NumPy implementation of the paper's
algorithm, against optax's Adam with identity bases, on degenerate gradients,
and under every optimizer layout."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmegatron.optim import AdamW, MatrixSpec, PlanSpec, Route, Routing, scale_by_soap, soap
from jmegatron.optim.routing import MATRIX

B1, B2, EPS, FREQ = 0.9, 0.95, 1e-8, 5
STEPS = 12      # refreshes after Adam steps 5 and 10: two of them


class PaperSOAP:
    """Algorithm 3 of Vyas et al. (2024) for one m x n matrix, in float64.

    Written from the paper: the first moment M is kept in the original space and
    projected with the current bases every step; the first call only builds
    L, R and their eigenbases; the bases are refreshed every ``freq`` Adam
    steps by a power iteration and QR, columns (and V) sorted by the
    eigenvalues the old basis estimates. A side longer than ``max_dim``
    stays the identity; with both sides identity this is Adam.
    """

    def __init__(self, m, n, max_dim):
        self.sides = [k <= max_dim for k in (m, n)]
        self.factors = [np.zeros((k, k)) if on else None for k, on in zip((m, n), self.sides)]
        self.bases = [np.eye(k) for k in (m, n)]
        self.M, self.V = np.zeros((m, n)), np.zeros((m, n))
        self.calls = 0

    def step(self, G):
        self.calls += 1
        preconditioned = any(self.sides)
        if preconditioned and self.calls == 1:
            self._update_factors(G)
            self.bases = [np.linalg.eigh(F)[1][:, ::-1] if F is not None else Q
                          for F, Q in zip(self.factors, self.bases)]
            return np.zeros_like(G)
        t = self.calls - 1 if preconditioned else self.calls
        QL, QR = self.bases
        self.M = B1 * self.M + (1 - B1) * G
        G_rot, M_rot = QL.T @ G @ QR, QL.T @ self.M @ QR
        self.V = B2 * self.V + (1 - B2) * G_rot ** 2
        N = (M_rot / (1 - B1 ** t)) / (np.sqrt(self.V / (1 - B2 ** t)) + EPS)
        update = QL @ N @ QR.T
        self._update_factors(G)
        if preconditioned and t % FREQ == 0:
            self._refresh()
        return update

    def _update_factors(self, G):
        grams = (G @ G.T, G.T @ G)
        self.factors = [None if F is None else B2 * F + (1 - B2) * gram
                        for F, gram in zip(self.factors, grams)]

    def _refresh(self):
        for side, F in enumerate(self.factors):
            if F is None:
                continue
            Q = self.bases[side]
            order = np.argsort(-np.diag(Q.T @ F @ Q))
            self.V = self.V[order] if side == 0 else self.V[:, order]
            self.bases[side] = np.linalg.qr(F @ Q[:, order])[0]


def gradient_stream(shape, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) * (1 + 0.3 * s) for s in range(STEPS)]


def run_soap(tx, grads):
    """Directions of ``tx`` (jitted once) for a list of {"w": gradient} trees."""
    params = jax.tree.map(jnp.zeros_like, grads[0])
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for g in grads:
        direction, state = update(g, state, params)
        out.append(direction)
    return out, state


STACK = Routing(custom=lambda path, shape, logical: Route(MATRIX, "test stack",
                                                          MatrixSpec((1,), (2,))))


@pytest.mark.parametrize("shape,max_dim", [
    ((6, 6), 100),       # square, both sides
    ((5, 6), 100),       # rectangular: R's first eigenbasis has a 1-D null space (unique)
    ((6, 5), 100),
    ((4, 9), 6),         # one-sided: the long side stays the identity
    ((9, 4), 6),
], ids=["square", "wide", "tall", "one-sided-wide", "one-sided-tall"])
def test_equals_the_papers_algorithm_step_by_step(shape, max_dim):
    """A stack of two matrices, each with its own gradient stream, for 12 steps
    across two basis refreshes, against float64 NumPy. The tolerance is fp32
    eigh/QR error on 6 x 6 factors amplified by Adam's division (~1e-4)."""
    streams = [gradient_stream(shape, seed) for seed in (0, 1)]
    grads = [{"w": jnp.asarray(np.stack([s[i] for s in streams]), jnp.float32)}
             for i in range(STEPS)]
    tx = scale_by_soap(b1=B1, b2=B2, eps=EPS, precondition_frequency=FREQ,
                       max_precond_dim=max_dim, plan=PlanSpec(routing=STACK))
    got, _ = run_soap(tx, grads)
    for k, stream in enumerate(streams):
        paper = PaperSOAP(*shape, max_dim)
        for i, g in enumerate(stream):
            want = paper.step(g)
            np.testing.assert_allclose(np.asarray(got[i]["w"][k]), want, rtol=1e-3, atol=1e-3,
                                       err_msg=f"matrix {k}, step {i + 1}")


def test_identity_bases_are_adam():
    grads = [{"w": jnp.asarray(g, jnp.float32)} for g in gradient_stream((4, 7), 3)]
    tx = scale_by_soap(b1=B1, b2=B2, eps=EPS, max_precond_dim=0, plan=PlanSpec(routing=STACK))
    got, _ = run_soap(tx, [{"w": g["w"][None]} for g in grads])
    want, _ = run_soap(optax.scale_by_adam(b1=B1, b2=B2, eps=EPS), grads)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a["w"][0], b["w"], rtol=1e-6, atol=1e-7)


def test_soap_with_identity_bases_is_adamw_for_the_whole_tree():
    """Matrices through SOAP's Adam, the rest through its AdamW: one optax.adamw."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((4, 6)), jnp.float32),
              "bias": jnp.asarray(rng.standard_normal(6), jnp.float32)}
    opts = dict(b1=B1, b2=B2, eps=EPS, weight_decay=0.1)
    ours = soap(1e-2, **opts, max_precond_dim=0,
                adamw=AdamW(b1=B1, b2=B2, eps=EPS, weight_decay=0.1))
    theirs = optax.adamw(1e-2, **opts)
    p1, p2, s1, s2 = params, params, ours.init(params), theirs.init(params)
    for i in range(4):
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = theirs.update(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    chex.assert_trees_all_close(p1, p2, rtol=1e-6, atol=1e-7)


def test_the_first_step_leaves_preconditioned_matrices_exactly_as_they_are():
    """Step 1 only builds the eigenbases: no direction and no weight decay for the
    preconditioned stack, while a stack with no preconditioned side (plain Adam) and
    the AdamW leaves move. From step 2 on the decay applies to both stacks."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((2, 4, 6)), jnp.float32),    # preconditioned
              "wide": jnp.asarray(rng.standard_normal((2, 9, 9)), jnp.float32)}  # max_dim 8: Adam
    tx = soap(1e-2, weight_decay=0.1, max_precond_dim=8, plan=PlanSpec(routing=STACK))
    state, update = tx.init(params), jax.jit(tx.update)
    grads = lambda: jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype),
                                 params)
    updates, state = update(grads(), state, params)
    after = optax.apply_updates(params, updates)
    assert np.asarray(after["w"]).tobytes() == np.asarray(params["w"]).tobytes()
    assert not np.allclose(after["wide"], params["wide"])
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, state = update(zero, state, after)   # a zero gradient: the decay alone
    np.testing.assert_allclose(updates["w"], -1e-2 * 0.1 * after["w"], rtol=1e-6)


def test_bases_stay_orthonormal_and_state_finite_on_rank_deficient_gradients():
    """Rank-one gradients, with zero gradients in between: factors are singular
    throughout, yet eigh and QR keep orthonormal bases and nothing overflows."""
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal((2, 8, 1)), rng.standard_normal((2, 1, 6))
    grads = [{"w": jnp.asarray((u @ v) * (i % 3 != 2), jnp.float32)} for i in range(STEPS)]
    tx = scale_by_soap(precondition_frequency=2, plan=PlanSpec(routing=STACK))
    got, state = run_soap(tx, grads)
    assert all(bool(jnp.all(jnp.isfinite(d["w"]))) for d in got)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
    (factors,) = state.factors["w"]
    for q in (factors.q_left, factors.q_right):
        eye = jnp.broadcast_to(jnp.eye(q.shape[-1]), q.shape)
        np.testing.assert_allclose(jnp.swapaxes(q, -1, -2) @ q, eye, atol=1e-5)


def test_rejects_a_non_matrix_leaf():
    with pytest.raises(ValueError, match="bias.*AdamW"):
        scale_by_soap().init({"bias": jnp.zeros(3)})


# --- under every layout ------------------------------------------------------

from jmegatron.models import GPTConfig  # noqa: E402
from jmegatron.sharding import MeshConfig, make_mesh  # noqa: E402
from jmegatron.sharding.layouts import LAYOUTS  # noqa: E402
from jmegatron.train import ScheduleConfig, TrainConfig  # noqa: E402
from jmegatron.models.gpt import ungroup  # noqa: E402
import helpers  # noqa: E402

MODEL = GPTConfig(vocab_size=300, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                  d_ff=128).pad_vocab(2)
# Bases refreshed every step, so that three steps run eigh and QR twice.
TRAIN = TrainConfig(optim="soap", lr=1e-2, steps=3, grad_clip=0.0,
                    schedule=ScheduleConfig(warmup_steps=0),
                    soap=dataclasses.replace(TrainConfig().soap, precondition_frequency=1))


def three_updates(mesh, layout_name):
    """Three optimizer steps on the same random gradients, placed as the layout
    places the params. (Not gradients from a model: at initialization the
    factors of attention's output projection have near-equal eigenvalues, whose
    eigenvectors round-off alone turns, and Adam's per-coordinate division in
    that basis would then measure round-off, not the layout.)"""
    layout, optimizer, _, state = helpers.build(mesh, layout_name, MODEL, TRAIN)
    update = jax.jit(optimizer.tx.update)
    params, opt_state, out = state.params, state.opt_state, []
    for step in range(3):
        fresh = jax.tree.leaves(helpers.randomized(ungroup(params), seed=step))
        leaves, treedef = jax.tree.flatten(params)
        grads = treedef.unflatten([jax.device_put(g.reshape(p.shape), p.sharding)
                                   for g, p in zip(fresh, leaves)])
        updates, opt_state = update(grads, opt_state, params)
        out.append(jax.device_get(ungroup(updates)))
    return out


@pytest.fixture(scope="module")
def one_device():
    return three_updates(make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]), "fsdp")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_steps_like_one_device(layout, one_device):
    """data 2 x fsdp 2 x tensor 2: tensor-split matrices are gathered (duplicated).
    Updates are about lr = 1e-2 in size; atol is 1e-4 of that, fp32 eigh and QR
    on stacks grouped differently per device."""
    got = three_updates(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), layout)
    chex.assert_trees_all_close(got, one_device, rtol=1e-5, atol=1e-6)
