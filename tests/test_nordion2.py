"""NorDion2 against an independent float64 NumPy implementation of the reference's
equations (microsoft/dion, dion/nordion2.py, dion/dion2.py, dion/normuon.py and
dion/polar_express.py), written on the reference's own [out, in] weights:
jmegatron's [fan_in, fan_out] leaves are their transposes, so the orientation
of the selection (always output neurons) and of the normalization is checked.

Mutated copies of the reference (no normalization, the normalization per input
column instead of per output row, the second moment decayed on every row, the
shorter side selected as Dion2 does) must miss the optimizer's updates by far
more than the tolerance, so a comparison that passes could not have passed for them.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion_reference import (ROUTING, Leaves, assert_owner_steps_like_one_device, assert_refused,
                            polar_express64)
from jmegatron.optim import PlanSpec
from jmegatron.optim.nordion2 import nordion2, scale_by_nordion2

# jmegatron leaves [fan_in, fan_out] (a 3-D leaf: a stack of them); "fused" is cut
# along fan_out into blocks of 8 and 4 columns. "very_wide" (fan_out 24 > 4 fan_in)
# makes the selected [k, in] submatrix tall, so its rows are not orthonormal and the
# per-neuron normalization acts from the first step.
SHAPES = {"square": (7, 7), "wide": (6, 10), "tall": (10, 6), "stack": (3, 6, 9),
          "very_wide": (4, 24), "fused": (6, 12)}
STEPS = 5
LEAVES = Leaves(SHAPES, seed=100)
worst = LEAVES.worst
FRACTION, EF_DECAY, BETA2 = 0.5, 0.9, 0.5
# fp32 against float64 relative to a leaf's largest entry: Polar Express in fp32 lands
# ~1e-5 from float64 (tests/test_dion2.py); with the normalization, measured here at
# most 1.1e-5 (very_wide), 4.8e-6 to 8.3e-6 elsewhere.
TOL = 5e-5


class Reference:
    """One torch-oriented weight [out, in] under NorDion2, in float64: M += G; the
    k = max(1, ceil(fraction * out)) rows of largest L1 norm are copied out, decayed
    by mu in M, orthogonalized (U, [k, in]); their second moments V[sel] <-
    lerp(V[sel], mean(U^2, row), 1 - beta2); U / (sqrt(V[sel]) + 1e-8) rescaled
    to ||U||_F (denominator clamped at 1e-8); scattered into a zero update, times
    sqrt(out / in).

    ``mutant``: "no_norm", "norm_columns" (per input column), "v_every_row" (every
    row's V takes the EMA of the scattered update, zero on unselected rows),
    "shorter_side" (Dion2's selection axis)."""

    def __init__(self, out_in, mutant=None):
        self.M, self.V = np.zeros(out_in), np.zeros(out_in[0])
        self.mutant = mutant
        self.factor = math.sqrt(out_in[0] / out_in[1])
        self.gap = np.inf

    def step(self, G):
        self.M = self.M + G
        rows, cols = self.M.shape
        by_rows = self.mutant != "shorter_side" or rows <= cols
        view = self.M if by_rows else self.M.T
        n = view.shape[0]
        k = max(1, math.ceil(FRACTION * n))
        norms = np.abs(view).sum(axis=1)
        order = np.argsort(-norms)
        if k < n:
            self.gap = min(self.gap, (norms[order[k - 1]] - norms[order[k]]) / norms.max())
        chosen = order[:k]
        sub = view[chosen].copy()
        view[chosen] = EF_DECAY * sub
        U = polar_express64(sub) if by_rows else polar_express64(sub.T).T
        if not by_rows:   # columns selected: normalize the rows of the whole update
            full = np.zeros_like(view)
            full[chosen] = U
            U, chosen, by_rows = full.T, np.arange(rows), True
        if self.mutant == "no_norm":
            normed = U
        elif self.mutant == "norm_columns":
            v = np.mean(U * U, axis=0)   # stateless per-column normalization
            normed = U / (np.sqrt(v) + 1e-8)
            normed *= np.linalg.norm(U) / max(np.linalg.norm(normed), 1e-8)
        else:
            if self.mutant == "v_every_row":
                full = np.zeros((rows, cols))
                full[chosen] = U
                self.V = self.V + (1 - BETA2) * (np.mean(full * full, axis=1) - self.V)
                v = self.V[chosen]
            else:
                v = self.V[chosen] + (1 - BETA2) * (np.mean(U * U, axis=1) - self.V[chosen])
                self.V[chosen] = v
            normed = U / (np.sqrt(v)[:, None] + 1e-8)
            normed *= np.linalg.norm(U) / max(np.linalg.norm(normed), 1e-8)
        update = np.zeros((rows, cols))
        update[chosen] = normed
        return update * self.factor


def references(mutant=None):
    return LEAVES.references(lambda out_in: Reference(out_in, mutant))


@pytest.fixture(scope="module")
def fp32_run():
    tx = scale_by_nordion2(fraction=FRACTION, ef_decay=EF_DECAY, muon_beta2=BETA2,
                           matmul_dtype="float32", plan=PlanSpec(routing=ROUTING))
    return LEAVES.run(tx, STEPS)


def test_equals_the_reference_in_float64(fp32_run):
    """Five steps on square, wide, tall, stacked, very wide and fused leaves: fp32
    matmuls against float64 within ``TOL`` of each leaf's largest entry; the
    selections agree (no two L1 norms at the cut within 1e-5 of the largest, 100x
    fp32 round-off; measured 1.4e-4)."""
    refs = references()
    errors = worst(fp32_run, refs)
    assert max(errors.values()) < TOL, errors
    gaps = [r.gap for per_block in refs.values() for mats in per_block for r in mats]
    assert min(gaps) > 1e-5, min(gaps)


@pytest.mark.parametrize("mutant", ["no_norm", "norm_columns", "v_every_row", "shorter_side"])
def test_a_mutated_reference_misses(mutant, fp32_run):
    """Each mutation misses by over 100x the tolerance on the leaves it can affect:
    every leaf for the normalization's form and the second moment; the shorter-side
    selection only where fan_in < fan_out (wide, stack, very wide, fused).
    Measured: no_norm >= 0.12, norm_columns >= 0.23, v_every_row >= 0.054,
    shorter_side >= 1.4 of the largest entry (>= 1000x the tolerance)."""
    errors = worst(fp32_run, references(mutant))
    affected = ([n for n, s in SHAPES.items() if s[-2] < s[-1]] if mutant == "shorter_side"
                else list(SHAPES))
    assert min(errors[n] for n in affected) > 100 * TOL, errors


def test_a_zero_gradient_gives_a_zero_update():
    tx = scale_by_nordion2(plan=PlanSpec(routing=ROUTING))
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    got, state = jax.jit(tx.update)(params, tx.init(params), params)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(got))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state))


BAD = [("fraction", 0, "fraction must be a number in (0, 1]"),
       ("fraction", 1.5, "fraction must be"), ("fraction", True, "fraction must be"),
       ("ef_decay", 1.0, "ef_decay must be a number in [0, 1)"),
       ("muon_beta2", 1.0, "muon_beta2 must be a number in [0, 1)"),
       ("muon_beta2", -0.1, "muon_beta2 must be"),
       ("coefficients", "nope", "unknown coefficient set 'nope'"),
       ("steps", 0, "steps must be an integer >= 1"),
       ("matmul_dtype", "int8", "matmul_dtype must be a floating-point dtype"),
       ("epsilon", 0.0, "epsilon must be a finite number > 0"),
       ("scale", "max", "unknown scale 'max'"), ("rms_factor", -1.0, "rms_factor must be"),
       ("momentum_dtype", "int32", "momentum_dtype must be a floating-point dtype"),
       ("variance_dtype", "int32", "variance_dtype must be a floating-point dtype")]


@pytest.mark.parametrize("make", [scale_by_nordion2, lambda **kw: nordion2(0.1, **kw)],
                         ids=["scale_by_nordion2", "nordion2"])
def test_bad_arguments_are_refused_in_one_line(make):
    assert_refused(make, nordion2, BAD)


def test_owner_layout_steps_like_one_device_with_no_collective():
    """nordion2 under the owner layout (``assert_owner_steps_like_one_device``)."""
    assert_owner_steps_like_one_device(nordion2)
