"""The Pallas SYRK kernel: equal to jnp, every element written, only lower tiles
launched, its FLOP count, and Newton-Schulz / Muon / tensor-parallel NS on it.

Runs the kernel in interpret mode on CPU (under jit). On a GPU machine,
``JMEGATRON_SYRK_BACKEND=pallas`` runs the same tests on the compiled kernel
(experiments/gpu_check.sh)."""

import functools
import math
import os

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmegatron.optim import (PlanSpec, TensorParallel, muon, newton_schulz, ns_flops,
                             tp_newton_schulz)
from jmegatron.optim.kernels import resolve_backend, syrk, syrk_flops, syrk_plan, tile_of
from jmegatron.optim.kernels.syrk_kernel import syrk_call
from jmegatron.sharding import DEFAULT_RULES, MeshConfig, logical_to_spec, make_mesh

BACKEND = os.environ.get("JMEGATRON_SYRK_BACKEND", "interpret")
SMALL = dict(block=16, block_k=16)      # several tiles even on tiny matrices
POISON = -7777.0
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


@functools.partial(jax.jit, static_argnames=("alpha", "beta", "out_dtype", "block", "block_k"))
def kernel(a, c=None, *, alpha=1.0, beta=0.0, out_dtype=None, block=16, block_k=16):
    return syrk(a, c, alpha=alpha, beta=beta, out_dtype=out_dtype, block=block,
                block_k=block_k, backend=BACKEND)


def reference(a, c=None, alpha=1.0, beta=0.0):
    """alpha a a^T + beta c in float64 (numpy)."""
    a64 = np.asarray(a, np.float64)
    out = alpha * np.einsum("...ik,...jk->...ij", a64, a64)
    return out if c is None else out + beta * np.asarray(c, np.float64)


def small_integers(shape, dtype, seed=0):
    """Entries in [-3, 3]: every product and partial sum is an exact integer in fp32."""
    return jax.random.randint(jax.random.key(seed), shape, -3, 4).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bitwise_equal_to_jnp_on_integer_inputs(dtype):
    a = small_integers((2, 40, 24), dtype)          # 3 x 3 tiles of 16, padded rows
    want = jnp.einsum("...ik,...jk->...ij", a, a, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(kernel(a, out_dtype=jnp.float32), want)
    # Sums up to 24 * 9 = 216 < 256 are exact in bf16 too, so the cast-down result matches.
    np.testing.assert_array_equal(kernel(a), want.astype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_close_on_random_inputs(dtype):
    """Relative error under 1e-5 for both dtypes: a product of two bf16 numbers is
    exact in fp32 (8 + 8 significant bits <= 24), so with fp32 accumulation the
    only error is fp32 summation, as for fp32 inputs. Accumulating in bf16 would
    miss by ~1e-2."""
    a = jax.random.normal(jax.random.key(1), (3, 50, 70)).astype(dtype)
    out = np.asarray(kernel(a, out_dtype=jnp.float32), np.float64)
    want = reference(a)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("shape", [(37, 29), (1, 5), (16, 16), (2, 3, 33, 17)])
def test_every_element_written(shape):
    """Pre-fill the output with a poison value (aliased in): none survives. With the
    mirrored stores switched off, poison survives exactly in the strictly-upper
    tiles: the kernel computes no upper tile itself."""
    n, k = shape[-2:]
    plan = syrk_plan(n, k, **SMALL)
    a = small_integers((math.prod(shape[:-2]), n, k), jnp.float32, seed=2)
    padded = jnp.pad(a, ((0, 0), (0, plan.n_pad - n), (0, plan.k_pad - k)))
    run = jax.jit(lambda x, mirror: syrk_call(x, plan=plan, interpret=BACKEND == "interpret",
                                              mirror=mirror, poison=POISON),
                  static_argnums=1)
    full = np.asarray(run(padded, True))
    assert not np.any(full == POISON)
    np.testing.assert_array_equal(full[:, :n, :n], reference(a))
    np.testing.assert_array_equal(full[:, n:, :], 0)     # zero padding rows stay zero
    tiles = np.arange(plan.n_pad) // plan.block
    upper = tiles[:, None] < tiles[None, :]                # strictly-upper tiles
    lower_only = np.asarray(run(padded, False))
    assert np.all(lower_only[:, upper] == POISON)
    np.testing.assert_array_equal(lower_only[:, ~upper], full[:, ~upper])
    out = kernel(small_integers(shape, jnp.float32, seed=2))          # public entry point
    assert out.shape == (*shape[:-2], n, n) and not jnp.any(jnp.isnan(out))


def test_grid_launches_only_lower_tiles():
    """The launch grid has T (T + 1) / 2 programs per matrix, and program t maps to
    each lower tile (i, j), j <= i, exactly once (all tiles up to T = 300; row ends
    up to T = 6000, past 4608 where the float square root alone lands one off)."""
    a = jnp.zeros((3, 100, 40))
    [eqn] = pallas_eqns(jax.make_jaxpr(lambda x: syrk(x, backend="interpret", **SMALL))(a).jaxpr)
    t = math.ceil(100 / 16)
    assert tuple(eqn.params["grid_mapping"].grid) == (3, t * (t + 1) // 2)
    for side in (1, 7, 300):
        i, j = map(np.asarray, jax.jit(tile_of)(jnp.arange(side * (side + 1) // 2)))
        pairs = set(zip(i.tolist(), j.tolist()))
        assert pairs == {(r, c) for r in range(side) for c in range(r + 1)}
        assert len(pairs) == len(i)
    rows = np.arange(1, 6000)
    first = rows * (rows + 1) // 2                          # t of tile (row, 0)
    for t, want in ((first, (rows, 0 * rows)), (first - 1, (rows - 1, rows - 1))):
        np.testing.assert_array_equal(np.stack(jax.jit(tile_of)(t)), np.stack(want))


def test_beta_c_path():
    a = jax.random.normal(jax.random.key(3), (2, 45, 30))
    c = jnp.asarray(reference(jax.random.normal(jax.random.key(4), (2, 45, 45))), jnp.float32)
    out = np.asarray(kernel(a, c, alpha=-0.75, beta=2.5), np.float64)
    want = reference(a, c, -0.75, 2.5)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-5
    # Newton-Schulz's use: bf16 operand, fp32 c added in fp32, fp32 result.
    half = kernel(a.astype(jnp.bfloat16), c, alpha=-0.75, beta=2.5, out_dtype=jnp.float32)
    want = reference(a.astype(jnp.bfloat16), c, -0.75, 2.5)
    assert half.dtype == jnp.float32
    assert np.linalg.norm(half - want) / np.linalg.norm(want) < 1e-5


def matmul_flops(jaxpr: jcore.Jaxpr) -> int:
    """Matmul FLOPs of a traced program: a pallas_call is its launched programs times
    its kernel's FLOPs, a scan its length times its body, a cond its costliest branch."""
    total = 0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name == "pallas_call":
            total += math.prod(params["grid_mapping"].grid) * matmul_flops(params["jaxpr"])
        elif name == "scan":
            total += params["length"] * matmul_flops(params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(matmul_flops(b.jaxpr) for b in params["branches"])
        else:
            total += sum(matmul_flops(v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v)
                         for v in params.values()
                         if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)))
    return total


def pallas_eqns(jaxpr: jcore.Jaxpr) -> list:
    """Every pallas_call in a traced program, nested jits and shard_maps included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for v in eqn.params.values():
            if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                found += pallas_eqns(v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v)
    return found


def kernel_calls(fn, *args) -> int:
    return len(pallas_eqns(jax.make_jaxpr(fn)(*args).jaxpr))


# (p, q, X X^T on the kernel, A A on the kernel). With 128-row tiles, p just
# above a tile multiple pads a whole tile row (136 -> 256: 3.2x the plain X X^T
# at q = 264), one tile (p <= 128) saves nothing, and at 2 x 2 tiles the three
# lower tiles are 3/4 of the full product only without padding: there
# Newton-Schulz must use the plain product. 240 x 260 pads k to 320 (X X^T
# plain, A A on the kernel); 230 x 1024 the reverse (A A's k = 230 pads to 256).
CHOICES = [(100, 300, False, False), (128, 512, False, False), (136, 264, False, False),
           (200, 200, False, False), (240, 260, False, True), (230, 1024, True, False),
           (256, 256, True, True), (1024, 4096, True, True)]


@pytest.mark.parametrize("p, q, gram, poly", CHOICES)
def test_kernel_only_where_it_saves_flops(p, q, gram, poly):
    """Newton-Schulz with SYRK launches the kernel only for the products whose
    tiles do fewer FLOPs than the plain product (2 p^2 q for X X^T, 2 p^3 for
    A A), so the traced program (kernels read off their grids and bodies) never
    does more matmul FLOPs than without SYRK, and ``ns_flops(syrk=True)``
    counts exactly what runs."""
    x = jnp.zeros((p, q))
    ns = lambda **kw: jax.make_jaxpr(functools.partial(
        newton_schulz, steps=1, coefficients="simple", **kw))(x).jaxpr
    traced, plain = ns(syrk="interpret"), ns()
    operands = sorted(len(eqn.invars) for eqn in pallas_eqns(traced))
    assert operands == [1] * gram + [2] * poly      # X X^T: a alone; b A + c A A: a and c
    assert (syrk_flops(p, q) < 2 * p * p * q, syrk_flops(p, p) < 2 * p ** 3) == (gram, poly)
    assert matmul_flops(traced) == ns_flops(p, q, 1, syrk=True)
    assert matmul_flops(plain) == ns_flops(p, q, 1)
    saved = ns_flops(p, q, 1) - ns_flops(p, q, 1, syrk=True)
    assert saved > 0 if gram or poly else saved == 0


@pytest.mark.parametrize("m, n, steps", [(390, 250, 2), (240, 260, 1), (256, 256, 1)])
def test_flops_count_the_kernels_tiles(m, n, steps):
    """``ns_flops(syrk=True)`` equals the matmul FLOPs of the traced Newton-Schulz
    with the kernel, read off its pallas_call grids and kernel bodies; without
    SYRK the same count gives the plain 4 p^2 q + 2 p^3 per step."""
    x = jnp.zeros((m, n))
    traced = lambda **kw: matmul_flops(jax.make_jaxpr(functools.partial(
        newton_schulz, steps=steps, coefficients="simple", **kw))(x).jaxpr)
    assert traced(syrk="interpret") == ns_flops(m, n, steps, syrk=True)
    assert traced() == ns_flops(m, n, steps)
    p, q = min(m, n), max(m, n)
    assert syrk_flops(p, q) == syrk_plan(p, q).programs * 2 * 128 ** 2 * math.ceil(q / 64) * 64
    if p % 128 == 0:   # no padding: only whole diagonal tiles above the ideal triangle
        t = p // 128
        ideal = 3 * p * p * q + p ** 3
        assert ns_flops(m, n, 1, syrk=True) == ideal + (p * p * q + p ** 3) // t


def test_flops_approach_the_ideal_triangle():
    """At 4096 x 16384 (q = 4p) the kernel's count is within 1/T (T = 32 tiles) of
    the ideal 3 p^2 q + p^3 = 13 p^3, against 4 p^2 q + 2 p^3 = 18 p^3 plain."""
    p, q = 4096, 16384
    ratio = ns_flops(p, q, 1, syrk=True) / ns_flops(p, q, 1)
    assert 13 / 18 < ratio < 13 / 18 * (1 + 1 / 32), ratio


# rtol 1e-5 as the spec asks, plus atol 1e-6 for entries near zero: an
# orthogonalized p x q matrix has entries ~1/sqrt(q) (~0.06), and fp32 round-off
# in a different summation order moves any entry by up to ~rtol times that
# (measured: up to 4e-7 on entries near zero, which rtol alone fails).
TOL = dict(rtol=1e-5, atol=1e-6)


# Shapes where the kernel saves FLOPs (see CHOICES), so it really runs: padded
# rows (250 -> 256) and contraction (390 -> 448), tall and batched.
@pytest.mark.parametrize("shape", [(2, 256, 256), (250, 390), (390, 250)])
def test_newton_schulz_with_syrk_equals_without(shape):
    x = jax.random.normal(jax.random.key(5), shape)
    ns = jax.jit(functools.partial(newton_schulz, steps=3), static_argnames="syrk")
    assert kernel_calls(functools.partial(ns, syrk=BACKEND), x) == 6    # 3 steps x 2 products
    np.testing.assert_allclose(ns(x, syrk=BACKEND), ns(x), **TOL)


def test_muon_step_with_syrk_equals_without():
    params = {"w": jax.random.normal(jax.random.key(6), (256, 320)),
              "v": jax.random.normal(jax.random.key(7), (40, 24))}    # v: plain products
    grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)

    def step(syrk):
        tx = muon(0.02, steps=2, syrk=syrk)     # 2 steps: fewer kernels to compile
        state = tx.init(params)
        assert kernel_calls(tx.update, grads, state, params) == (4 if syrk else 0)
        updates, _ = jax.jit(tx.update)(grads, state, params)
        return optax.apply_updates(params, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), step(BACKEND), step(False))


@pytest.fixture(scope="module")
def tensor2():
    return make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))


@needs_8
@pytest.mark.parametrize("mode", ["duplicated", "distributed", "blockwise"])
def test_tp_modes_with_syrk_equal_without(tensor2, mode):
    """Every tensor-parallel mode in shard_map runs the kernel and matches itself
    without it: duplicated on the gathered 256 x 512, distributed on each rank's
    256 x 256 columns (a SYRK before the psum, then A A of the summed Gram),
    blockwise on each 256 x 256 block."""
    x = jax.random.normal(jax.random.key(8), (256, 512))
    xs = jax.device_put(x, jax.NamedSharding(tensor2, jax.P(None, "tensor")))
    tp = TensorParallel(tensor2)
    run = lambda syrk: (lambda a: tp_newton_schulz(a, "out", mode, tp, steps=2, syrk=syrk))
    assert kernel_calls(run(BACKEND), xs) == 4               # 2 steps x 2 products
    got = jax.jit(run(BACKEND))(xs)
    assert got.sharding.is_equivalent_to(xs.sharding, 2)
    np.testing.assert_allclose(got, jax.jit(run(False))(xs), **TOL)


@needs_8
def test_muon_step_on_a_mesh_with_syrk_equals_without():
    """Muon on a mesh with a layout (fsdp): the matrix is split over the fsdp and
    tensor axes, gathered and orthogonalized in shard_map, SYRK included."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    logical = ("embed", "mlp")
    sharding = jax.NamedSharding(mesh, logical_to_spec(logical, DEFAULT_RULES))
    param = lambda key: nnx.Param(jax.device_put(jax.random.normal(key, (256, 512)), sharding),
                                  out_sharding=logical, eager_sharding=False)
    params = {"w": param(jax.random.key(9))}
    grads = {"w": param(jax.random.key(10))}

    def update(syrk):
        tx = muon(0.02, steps=2, syrk=syrk, plan=PlanSpec(mesh=mesh, layout="fsdp"))
        state = tx.init(params)
        assert kernel_calls(tx.update, grads, state, params) == (4 if syrk else 0)
        return jax.jit(tx.update)(grads, state, params)[0]
    with_kernel, without = update(BACKEND), update(False)
    assert with_kernel["w"][...].sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_allclose(with_kernel["w"][...], without["w"][...], **TOL)


def test_backends_and_arguments():
    a = jax.random.normal(jax.random.key(9), (20, 12))
    assert resolve_backend("auto") == ("pallas" if jax.default_backend() == "gpu" else "jnp")
    assert resolve_backend("jnp", interpret=True) == "interpret"
    np.testing.assert_allclose(syrk(a, backend="jnp"), reference(a), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown syrk backend"):
        syrk(a, backend="cuda")
    with pytest.raises(ValueError, match="power of two"):
        syrk(a, backend="interpret", block=48)
    with pytest.raises(ValueError, match="c must have shape"):
        syrk(a, jnp.zeros((12, 12)), backend="interpret")
