"""MOP and adaptive Muon (AdaMuon, NorMuon, NAMO) against independent float64
NumPy implementations of their equations; the weight-decay methods against
their formulas."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmegatron.optim import (MATRIX, MatrixSpec, PlanSpec, Route, Routing, adaptive_muon,
                             coefficient_set, mop, muon, scale_by_adaptive_muon, scale_by_mop,
                             scale_by_muon)
from jmegatron.optim.matrix import WEIGHT_DECAY_METHODS

SHAPES = {"square": (6, 6), "wide": (5, 8), "tall": (8, 5), "stack": (2, 6, 7)}
STEPS = 4
BETA, BETA2, EPS = 0.9, 0.95, 1e-8
# Every leaf a matrix [fan_in, fan_out], a 3-D leaf a stack of them.
ROUTING = Routing(custom=lambda path, shape, logical: Route(
    MATRIX, "test", MatrixSpec((len(shape) - 2,), (len(shape) - 1,))))


def gradients(step):
    rng = np.random.default_rng(step)
    return {k: rng.standard_normal(s) * (1 + 0.5 * step) for k, s in SHAPES.items()}


def newton_schulz64(x, coefficients="quintic"):
    """X <- a X + (b A + c A^2) X with A = X X^T on the short side, from X / ||X||_F."""
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / np.linalg.norm(x)
    for a, b, c in coefficient_set(coefficients).schedule(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Reference:
    """One m x n matrix's optimizer, in float64, from the equations: EMA momentum
    (Nesterov optional), then MOP's scaled polar factor, or Newton-Schulz followed
    by the adaptive second moment and Muon's spectral scale (x 0.2)."""

    def __init__(self, kind, shape, nesterov=False, scale="nuclear_norm"):
        self.kind, self.nesterov, self.scale = kind, nesterov, scale
        self.m, self.n = shape
        self.M = np.zeros(shape)
        self.V = {"adamuon": np.zeros(shape), "normuon": 0.0, "namo": 0.0}.get(kind)

    def step(self, G):
        self.M = BETA * self.M + (1 - BETA) * G
        D = BETA * self.M + (1 - BETA) * G if self.nesterov else self.M
        spectral = 0.2 * math.sqrt(max(self.m, self.n))
        if self.kind == "mop":
            U, S, Vt = np.linalg.svd(D, full_matrices=False)
            return U @ Vt * (S.sum() if self.scale == "nuclear_norm" else spectral)
        O = newton_schulz64(D)
        if self.kind == "adamuon":
            self.V = BETA2 * self.V + (1 - BETA2) * O ** 2
            U = O / (np.sqrt(self.V) + EPS)
        elif self.kind == "normuon":   # one value per column of the shorter side
            axis = 0 if self.m <= self.n else 1
            self.V = BETA2 * self.V + (1 - BETA2) * np.mean(O ** 2, axis=axis, keepdims=True)
            U = O / np.sqrt(np.maximum(self.V, EPS))
            U = U * np.linalg.norm(O) / np.linalg.norm(U)
        else:
            self.V = BETA2 * self.V + (1 - BETA2) * np.sum(G ** 2)
            U = O * np.linalg.norm(D) / (np.sqrt(self.V) + EPS)
        return U * spectral


VARIANTS = {
    "mop": (lambda: scale_by_mop(beta=BETA, plan=PlanSpec(routing=ROUTING)), dict(kind="mop")),
    "mop_spectral_nesterov": (
        lambda: scale_by_mop(beta=BETA, nesterov=True, scale="spectral",
                             plan=PlanSpec(routing=ROUTING)),
        dict(kind="mop", nesterov=True, scale="spectral")),
    **{kind: (lambda kind=kind: scale_by_adaptive_muon(
        second_moment=kind, beta=BETA, beta2=BETA2, eps=EPS, plan=PlanSpec(routing=ROUTING)),
        dict(kind=kind)) for kind in ("adamuon", "normuon", "namo")},
    "normuon_nesterov": (lambda: scale_by_adaptive_muon(
        second_moment="normuon", beta=BETA, nesterov=True, plan=PlanSpec(routing=ROUTING)),
        dict(kind="normuon", nesterov=True)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_equals_its_equations_in_float64(variant):
    """Four steps on a square, a wide, a tall and a stacked leaf. Newton-Schulz and
    SVD in fp32 against float64: agreement to ~1e-6 relative."""
    make, options = VARIANTS[variant]
    tx = make()
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    state, update = tx.init(params), jax.jit(tx.update)
    references = {k: [Reference(shape=s[-2:], **options) for _ in range(math.prod(s[:-2]))]
                  for k, s in SHAPES.items()}
    for step in range(STEPS):
        grads = gradients(step)
        got, state = update(jax.tree.map(jnp.float32, grads), state, params)
        for name, refs in references.items():
            mats = grads[name].reshape(-1, *SHAPES[name][-2:])
            want = np.stack([ref.step(g) for ref, g in zip(refs, mats)])
            np.testing.assert_allclose(np.asarray(got[name]).reshape(want.shape), want,
                                       rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{name}, step {step + 1}")


def test_mop_of_a_zero_momentum_is_zero():
    """A zero matrix has no polar factor; its singular vectors are arbitrary, so
    MOP's update (any scale mode) must be zero rather than an arbitrary rotation."""
    tx = scale_by_mop(scale="spectral", plan=PlanSpec(routing=ROUTING))
    params = {"w": jnp.zeros((4, 6))}
    updates, _ = tx.update(params, tx.init(params))
    assert float(jnp.abs(updates["w"]).max()) == 0.0


@pytest.mark.parametrize("method", WEIGHT_DECAY_METHODS)
def test_weight_decay_methods_follow_their_formulas(method):
    """Three steps with a decaying learning rate: with d the direction Muon makes of
    its input, decoupled gives -lr (d + wd p), independent -lr d - wd p, l2 -lr d(g +
    wd p), palm -lr d - lr^2 wd p, with p the weights before the step."""
    lr, wd = (lambda count: 0.1 / (1.0 + count)), 0.05
    tx = muon(lr, weight_decay=wd, weight_decay_method=method, plan=PlanSpec(routing=ROUTING))
    direction = scale_by_muon(plan=PlanSpec(routing=ROUTING))
    p = {"w": jnp.asarray(np.random.default_rng(9).standard_normal((6, 8)), jnp.float32)}
    state, inner = tx.init(p), direction.init(p)
    update, inner_update = jax.jit(tx.update), jax.jit(direction.update)
    for step in range(3):
        g = {"w": jnp.asarray(np.random.default_rng(step).standard_normal((6, 8)), jnp.float32)}
        got, state = update(g, state, p)
        fed = jax.tree.map(lambda g, p: g + wd * p, g, p) if method == "l2" else g
        d, inner = inner_update(fed, inner, p)
        rate = lr(step)
        want = {"decoupled": -rate * (d["w"] + wd * p["w"]),
                "independent": -rate * d["w"] - wd * p["w"],
                "l2": -rate * d["w"],
                "palm": -rate * d["w"] - rate ** 2 * wd * p["w"]}[method]
        np.testing.assert_allclose(got["w"], want, rtol=1e-6, atol=1e-7)
        p = optax.apply_updates(p, got)


def test_bad_options_fail_in_one_line_before_compiling():
    with pytest.raises(ValueError, match="unknown weight_decay_method 'l1'"):
        muon(0.1, weight_decay=0.1, weight_decay_method="l1")
    with pytest.raises(ValueError, match="unknown MOP scale"):
        mop(0.1, scale="nuclear")
    with pytest.raises(ValueError, match="unknown second_moment"):
        adaptive_muon(0.1, second_moment="adam")
    with pytest.raises(ValueError, match="namo.*l2"):
        adaptive_muon(0.1, second_moment="namo", weight_decay=0.1, weight_decay_method="l2")
