"""Newton-Schulz against the SVD polar factor, its symmetries, and its FLOP count;
Gram Newton-Schulz against the standard iteration."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.analysis import parse_collectives
from jmegatron.optim import (COEFFICIENT_SETS, CoefficientSet, TensorParallel, coefficient_set,
                             muon, newton_schulz, ns_flops, tp_newton_schulz)
from jmegatron.optim.kernels import syrk_flops
from jmegatron.optim.newton_schulz import resolve_method
from jmegatron.optim.tensor_parallel import _distributed_method
from jmegatron.sharding import MeshConfig, make_mesh

NS = jax.jit(newton_schulz, static_argnames=("steps", "coefficients", "matmul_dtype", "method",
                                             "restart"))


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


@pytest.mark.parametrize("coefficients", [(np.nan, -4.775, 2.0315),
                                          [(3.4445, -4.775, 2.0315), (1.5, np.inf, 0.0)],
                                          np.array([[1.5, -0.5, -np.inf]])], ids=str)
def test_non_finite_coefficients_are_refused_in_one_line(coefficients):
    """A NaN or inf coefficient would make every update NaN from the first step."""
    makers = (coefficient_set, lambda c: muon(1e-3, coefficients=c),
              lambda c: CoefficientSet("mine", tuple(map(tuple, np.reshape(c, (-1, 3))))))
    for make in makers:
        with pytest.raises(ValueError, match="coefficients must be finite numbers, got ") as err:
            make(coefficients)
        assert "\n" not in str(err.value)


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


def test_deepseekv4_schedule():
    simple, polish = (3.4445, -4.7750, 2.0315), (2.0, -1.5, 0.5)
    cset = coefficient_set("deepseekv4")
    assert cset.default_steps == 10
    assert cset.schedule(10) == [simple] * 8 + [polish] * 2
    assert cset.schedule(12) == [simple] * 8 + [polish] * 4


def well_conditioned(shape, seed=0):
    """Matrices with singular values spread over [0.3, 1]: no direction so small that
    fp32 rounding, amplified by the slope at 0, separates two exact-arithmetic twins."""
    *batch, m, n = shape
    rng = np.random.default_rng(seed)
    p = min(m, n)
    u = np.linalg.qr(rng.normal(size=(*batch, m, p)))[0]
    v = np.linalg.qr(rng.normal(size=(*batch, n, p)))[0]
    return jnp.asarray((u * np.linspace(1.0, 0.3, p)) @ np.swapaxes(v, -1, -2), jnp.float32)


def relative_error(got, want):
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("shape, coefficients, restart", [
    ((48, 48), "quintic", 2), ((32, 160), "aol", 2), ((160, 32), "polar_express", 2),
    ((2, 32, 96), "deepseekv4", 2), ((32, 160), "simple", 3)])
def test_gram_equals_standard_in_fp32(shape, coefficients, restart):
    x = well_conditioned(shape)
    want = NS(x, coefficients=coefficients)
    got = NS(x, coefficients=coefficients, method="gram", restart=restart)
    assert got.shape == x.shape and got.dtype == jnp.float32
    assert relative_error(got, want) < 1e-5


def test_gram_with_bf16_matmuls_stays_close():
    """The bf16 bound of ``newton_schulz``'s docstring, on the input of the standard
    bf16 test above: within 0.05 of fp32 everywhere."""
    x = gaussian((128, 256))
    out = NS(x, matmul_dtype=jnp.bfloat16, method="gram")
    np.testing.assert_allclose(out, NS(x), atol=0.05)
    s = singular_values(out)
    assert 0.6 < s.min() and s.max() < 1.3


def dot_flops(hlo: str) -> int:
    """2 x output elements x contracted size, summed over the dots of compiled HLO.
    Operands are named, so their shapes come from their definitions earlier in
    the text (every fused computation lists its parameters before their use)."""
    shapes, total = {}, 0
    for line in hlo.splitlines():
        define = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = \w+\[([\d,]*)\]", line)
        if not define:
            continue
        dims = [int(d) for d in define.group(2).split(",") if d]
        shapes[define.group(1)] = dims
        dot = re.search(r" dot\((%[\w.-]+), .*lhs_contracting_dims=\{([\d,]*)\}", line)
        if dot:
            lhs = shapes[dot.group(1)]
            contracted = np.prod([lhs[int(d)] for d in dot.group(2).split(",")])
            total += 2 * int(np.prod(dims)) * int(contracted)
    return total


@pytest.mark.parametrize("shape, steps, restart", [
    ((32, 96), 5, 2), ((2, 96, 32), 4, 3), ((48, 48), 3, 5)])
def test_ns_flops_counts_the_compiled_dots(shape, steps, restart):
    """Exact: what the compiled program multiplies, batch and restarts included."""
    batch = int(np.prod(shape[:-2]))
    for method in ("standard", "gram"):
        compiled = jax.jit(lambda x: newton_schulz(
            x, steps=steps, method=method, restart=restart)).lower(jnp.ones(shape)).compile()
        assert dot_flops(compiled.as_text()) == batch * ns_flops(
            *shape[-2:], steps, method=method, restart=restart), method


def test_gram_flop_formula():
    """4 k p^2 q + (8 steps - 6 k) p^3 for k segments, SYRK products where they save."""
    p, q = 256, 1024
    assert ns_flops(p, q, 5, method="gram", restart=2) == 4 * 3 * p * p * q + (40 - 18) * p ** 3
    assert ns_flops(q, p, 5, method="gram", restart=5) == 4 * p * p * q + 34 * p ** 3
    assert ns_flops(p, q, 5, method="gram", restart=1) == ns_flops(p, q, 5)
    plain = ns_flops(p, q, 5, method="gram", restart=2)
    saved = 3 * (2 * p * p * q - syrk_flops(p, q)) + 5 * (2 * p ** 3 - syrk_flops(p, p))
    assert ns_flops(p, q, 5, syrk=True, method="gram", restart=2) == plain - saved


def test_auto_picks_gram_exactly_where_it_saves_flops():
    for m, n, steps, syrk in [(a, b, s, k) for a in (64, 256) for b in (64, 96, 97, 160, 1024)
                              for s in (1, 2, 5) for k in (False, True)]:
        saves = ns_flops(m, n, steps, syrk, "gram") < ns_flops(m, n, steps, syrk)
        picked = resolve_method("auto", m, n, steps, syrk)
        assert picked == ("gram" if saves else "standard")
        assert resolve_method("auto", n, m, steps, syrk) == picked
        assert ns_flops(m, n, steps, syrk, "auto") == min(ns_flops(m, n, steps, syrk, "gram"),
                                                          ns_flops(m, n, steps, syrk))
    assert resolve_method("auto", 64, 96, 5) == "standard"     # q = 1.5 p: a tie
    assert resolve_method("auto", 64, 97, 5) == "gram"
    assert resolve_method("auto", 64, 1024, 1) == "standard"   # one step: nothing to save
    assert resolve_method("gram", 64, 64, 5) == "gram"
    with pytest.raises(ValueError, match="unknown Newton-Schulz method 'fast'"):
        resolve_method("fast", 64, 64, 5)
    with pytest.raises(ValueError, match="restart >= 1"):
        ns_flops(64, 128, 5, method="gram", restart=0)


@pytest.mark.parametrize("side", ["in", "out"])
def test_tensor_parallel_distributed_gram_equals_one_device(side):
    """The Gram psum'd over the split columns, then m x m and local: one device's
    result, on 4 tensor ranks. "auto" picks gram for [32, 256] split to 64 columns
    (the all-reduce count shows it ran), and never where the Gram side is longer."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    shape = (2, 256, 32) if side == "in" else (2, 32, 256)
    x = well_conditioned(shape)
    spec = jax.P(None, "tensor", None) if side == "in" else jax.P(None, None, "tensor")
    xs = jax.device_put(x, jax.NamedSharding(mesh, spec))
    compiled = jax.jit(lambda a: tp_newton_schulz(
        a, side, "distributed", TensorParallel(mesh), method="auto")).lower(xs).compile()
    assert relative_error(compiled(xs), newton_schulz(x)) < 1e-5
    # the scale's pmax, then one Gram per segment of quintic's 5 steps: [2, 2, 1]
    assert parse_collectives(compiled.as_text(), mesh).count("all-reduce", ("tensor",)) == 4
    assert _distributed_method("auto", 256, 8, 5, False) == "standard"
    assert _distributed_method("auto", 8, 256, 5, False) == "gram"
