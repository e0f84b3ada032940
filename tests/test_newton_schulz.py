"""Newton-Schulz against the SVD polar factor, its symmetries, and its FLOP count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.optim import (COEFFICIENT_SETS, CoefficientSet, coefficient_set, newton_schulz,
                             ns_flops)
from jmegatron.optim.kernels import syrk_flops

NS = jax.jit(newton_schulz, static_argnames=("steps", "coefficients", "matmul_dtype"))


def gaussian(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def singular_values(x):
    return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


def ill_conditioned(m=128, n=256, condition=1e6, seed=0):
    """U diag(s) V^T with s from 1 down to 1/condition, and its polar factor U V^T."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(m, m)))
    v, _ = np.linalg.qr(rng.normal(size=(n, m)))
    s = np.logspace(0, -np.log10(condition), m)
    return jnp.asarray((u * s) @ v.T, jnp.float32), u @ v.T


def test_simple_five_steps_band():
    s = singular_values(NS(gaussian((256, 1024)), steps=5, coefficients="simple"))
    assert 0.68 <= s.min() and s.max() <= 1.14, (s.min(), s.max())


def test_polar_express_band_is_tighter():
    x = gaussian((256, 1024))
    simple = singular_values(NS(x, steps=5, coefficients="simple"))
    polar = singular_values(NS(x, steps=5, coefficients="polar_express"))
    assert polar.max() - polar.min() < 0.6 * (simple.max() - simple.min())


@pytest.mark.parametrize("name", ["simple", "polar_express", "quintic", "cans", "aol"])
def test_more_steps_move_closer_on_ill_conditioned_input(name):
    x, polar = ill_conditioned()
    errors = [np.linalg.norm(np.asarray(NS(x, steps=k, coefficients=name)) - polar)
              for k in (5, 10, 20)]
    assert errors[0] > errors[1] > errors[2], errors


def test_converging_sets_reach_the_polar_factor():
    x, polar = ill_conditioned(condition=1e3)
    out = np.asarray(NS(x, steps=30, coefficients="polar_express"))
    np.testing.assert_allclose(out, polar, atol=2e-3)


def test_transpose_and_stack_symmetries():
    x = gaussian((3, 48, 80))
    stacked = NS(x)
    np.testing.assert_allclose(NS(jnp.swapaxes(x, 1, 2)), jnp.swapaxes(stacked, 1, 2),
                               rtol=1e-5, atol=1e-6)
    for i in range(3):
        np.testing.assert_allclose(stacked[i], NS(x[i]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factor", [1e-30, 1e-20, 1e20, 1e30])
def test_scale_invariant_for_tiny_and_huge_inputs(factor):
    x = gaussian((64, 96))
    out = NS(x * factor)
    assert jnp.all(jnp.isfinite(out))
    np.testing.assert_allclose(out, NS(x), rtol=1e-5, atol=1e-6)


def test_zero_matrix_gives_zero():
    out = NS(jnp.zeros((32, 64)))
    assert jnp.all(out == 0)


def test_bf16_matmuls_stay_close_and_return_fp32():
    x = gaussian((128, 256))
    out = NS(x, matmul_dtype=jnp.bfloat16)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, NS(x), atol=0.05)
    s = singular_values(out)
    assert 0.6 < s.min() and s.max() < 1.3


def test_coefficient_schedules_beyond_their_lists():
    for name in ("quintic", "polar_express", "cans", "aol"):
        cset = COEFFICIENT_SETS[name]
        n = len(cset.steps)
        assert cset.schedule(n + 2) == list(cset.steps) + [cset.steps[-1]] * 2   # repeats last
    cycled = CoefficientSet("mine", ((1.0, 0.0, 0.0), (2.0, 0.0, 0.0)), after_list="cycle")
    assert cycled.schedule(3) == [(1.0, 0.0, 0.0), (2.0, 0.0, 0.0), (1.0, 0.0, 0.0)]
    assert coefficient_set((1.5, -0.5, 0.0)).schedule(3) == [(1.5, -0.5, 0.0)] * 3
    with pytest.raises(ValueError, match="unknown coefficient set 'fast'"):
        coefficient_set("fast")
    with pytest.raises(ValueError, match=r"\(a, b, c\)"):
        coefficient_set([(1.0, 2.0)])


@pytest.mark.parametrize("m, n, steps", [(64, 256, 5), (256, 64, 5), (96, 160, 7)])
def test_ns_flops_matches_xla_cost_analysis(m, n, steps):
    """XLA counts the matmuls plus elementwise work: per step b*A + c*AA (3 p^2) and
    a*X + BX (2 p q), and a few passes over X and the first Gram to normalize them."""
    compiled = jax.jit(lambda x: newton_schulz(x, steps=steps, coefficients="simple")).lower(
        jnp.ones((m, n))).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
    p, q = min(m, n), max(m, n)
    elementwise = steps * (3 * p * p + 2 * p * q) + 10 * p * q + 5 * p * p
    assert 0 <= xla - ns_flops(m, n, steps) <= elementwise, (xla, ns_flops(m, n, steps))
    # SYRK counts, per symmetric product, the kernel's tiles where they are fewer than
    # the plain product's FLOPs, else the plain product (the traced program is checked
    # in test_syrk.py), plus B X as a plain matmul.
    assert ns_flops(m, n, 1, syrk=True) == (min(syrk_flops(p, q), 2 * p * p * q)
                                           + min(syrk_flops(p, p), 2 * p ** 3) + 2 * p * p * q)
