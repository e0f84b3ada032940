"""Newton-Schulz under tensor parallelism: exact modes equal one device, and
each mode communicates exactly what it claims."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPT, GPTConfig, create_sharded
from jmegatron.optim import (PlanSpec, Routing, TPCostModel, TensorParallel, describe, muon,
                             newton_schulz, scale_by_muon, tp_newton_schulz, update_scale)
from jmegatron.optim.tensor_parallel import tp_note
from jmegatron.sharding import DEFAULT_RULES, MeshConfig, logical_to_spec, make_mesh

SHAPES = [(2, 64, 64), (2, 32, 128), (3, 128, 32)]


def setup(t, shape, side, seed=0):
    mesh = make_mesh(MeshConfig(data=8 // t, fsdp=1, tensor=t))
    x = jax.random.normal(jax.random.key(seed), shape)
    spec = jax.P(None, "tensor", None) if side == "in" else jax.P(None, None, "tensor")
    return TensorParallel(mesh), x, jax.device_put(x, jax.NamedSharding(mesh, spec))


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("side", ["in", "out"])
def test_exact_modes_equal_one_device(t, side):
    for shape in SHAPES:
        tp, x, xs = setup(t, shape, side)
        want = newton_schulz(x)
        for mode in ("duplicated", "distributed", "gathered"):
            got = jax.jit(lambda a: tp_newton_schulz(a, side, mode, tp))(xs)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=f"{mode} {shape}")
            assert got.sharding.is_equivalent_to(xs.sharding, 3)


@pytest.mark.parametrize("side", ["in", "out"])
def test_aol_distributed_is_exact_or_refused(side):
    """AOL rescales the Gram side's rows: exact when that is the short side."""
    for shape in [(2, 32, 128), (2, 128, 32)]:
        tp, x, xs = setup(4, shape, side)
        want = newton_schulz(x, coefficients="aol")
        short_unsplit = (shape[2] if side == "in" else shape[1]) == min(shape[1:])
        forced = TensorParallel(tp.mesh, "distributed")
        assert forced.mode_for(shape[1], shape[2], side, 4, aol=True) == (
            "distributed" if short_unsplit else "duplicated")
        run = lambda m: jax.jit(lambda a: tp_newton_schulz(a, side, m, tp, coefficients="aol"))(xs)
        if short_unsplit:
            np.testing.assert_allclose(run("distributed"), want, rtol=1e-5, atol=2e-6)
        else:
            with pytest.raises(ValueError, match="AOL needs the short side unsplit"):
                run("distributed")
        np.testing.assert_allclose(run("duplicated"), want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("side", ["in", "out"])
def test_blockwise_is_newton_schulz_of_each_block(side):
    tp, x, xs = setup(4, (2, 64, 128), side)
    got = jax.jit(lambda a: tp_newton_schulz(a, side, "blockwise", tp))(xs)
    axis = 1 if side == "in" else 2
    want = jnp.concatenate([newton_schulz(b) for b in jnp.split(x, 4, axis=axis)], axis=axis)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("steps", [3, 5])
@pytest.mark.parametrize("side", ["in", "out"])
def test_each_mode_communicates_what_it_claims(steps, side):
    tp, _, xs = setup(4, (2, 64, 128), side)
    run = lambda mode: hlo_collectives(
        jax.jit(lambda a: tp_newton_schulz(a, side, mode, tp, steps=steps)), xs)
    duplicated, distributed, gathered, blockwise = map(
        run, ("duplicated", "distributed", "gathered", "blockwise"))
    assert duplicated.count() == 1 and duplicated.count("all-gather", ("tensor",)) == 1
    # One scalar all-reduce for the scale, then one Gram all-reduce per iteration.
    assert distributed.count() == steps + 1, distributed.table()
    assert distributed.count("all-reduce", ("tensor",)) == steps + 1
    grams = sorted(c.buffer_bytes for c in distributed.collectives)
    r = 128 if side == "in" else 64          # the Gram of the unsplit side
    assert grams == [2 * 4] + [2 * r * r * 4] * steps
    assert blockwise.count() == 0
    # X and this rank's Gram rows gathered each iteration, nothing reduced.
    assert gathered.count("all-gather", ("tensor",)) == 2 * steps == gathered.count(), \
        gathered.table()
    # The cost model's bytes (per matrix; the stack holds 2) are the HLO's, less
    # the scalars of the scale.
    for mode, report in (("duplicated", duplicated), ("distributed", distributed),
                         ("gathered", gathered)):
        modeled = 2 * TPCostModel().terms(mode, 4, 64, 128, side, steps)[1]
        assert 0 <= report.bytes_per_device() - modeled <= 2 * 8, (mode, report.table())


def test_auto_follows_the_cost_model():
    model = TPCostModel()
    # 1:8, split along its long side: the Gram is small, distributed wins.
    assert model.choose(8, 1024, 8192, "out", 5) == "distributed"
    # Small square: one all-gather beats six latency-bound all-reduces.
    assert model.choose(8, 256, 256, "out", 5) == "duplicated"
    # Split along the short side, distributed's Gram is of the long side; gathered
    # splits the FLOPs for 10 gathers, which pays once they outweigh the latency.
    assert model.choose(4, 512, 2048, "in", 5) == "duplicated"
    assert model.choose(8, 2048, 8192, "in", 5) == "gathered"
    assert model.choose(8, 4096, 16384, "in", 5) == "gathered"
    # The same 1:8 matrix is small enough at 512 x 4096 that latency decides.
    assert model.choose(8, 512, 4096, "out", 5) == "duplicated"
    count, nbytes, flops = model.terms("distributed", 8, 512, 4096, "out", 5)
    assert count == 6 and nbytes == 5 * 2 * 7 / 8 * 512 * 512 * 4
    assert flops == 5 * (4 * 512 ** 2 * 4096 / 8 + 2 * 512 ** 3)
    count, nbytes, flops = model.terms("gathered", 8, 512, 4096, "in", 5)
    assert count == 10 and nbytes == 5 * 7 / 8 * (512 * 4096 + 512 * 512) * 4
    assert flops == 5 * (4 * 4096 * 512 ** 2 + 2 * 512 ** 3) / 8


CFG = GPTConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                d_ff=128).pad_vocab(4)


@pytest.fixture(scope="module")
def reference():
    """Params, gradients and one Muon update on a single device."""
    model = create_sharded(lambda: GPT(CFG, nnx.Rngs(0)), None)
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(7), p.shape), params)
    tx = muon(0.01)
    return params, grads, jax.jit(tx.update)(grads, tx.init(params), params)[0]


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "gathered"])
@pytest.mark.parametrize("mesh_config", [MeshConfig(data=2, fsdp=2, tensor=2),
                                         MeshConfig(data=2, fsdp=1, tensor=4)])
def test_muon_step_on_the_tensor_parallel_gpt_equals_one_device(mode, mesh_config, reference):
    params, grads, want = reference
    mesh = make_mesh(mesh_config)
    sharded = create_sharded(lambda: GPT(CFG, nnx.Rngs(0)), mesh)
    shard = lambda tree: jax.tree.map(
        lambda a, s: jax.device_put(a, s[...].sharding), tree, nnx.state(sharded, nnx.Param))
    tx = muon(0.01, tp_mode=mode, plan=PlanSpec(mesh=mesh, rules=DEFAULT_RULES))
    p, g = shard(params), shard(grads)
    got = jax.jit(tx.update)(g, tx.init(p), p)[0]
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)


def test_describe_reports_each_blocks_mode():
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    params = nnx.state(GPT(CFG, nnx.Rngs(0)), nnx.Param)
    spec_of = lambda leaf: logical_to_spec(leaf.logical, DEFAULT_RULES)
    table = describe(params, block_note=tp_note(TensorParallel(mesh, "distributed"), spec_of,
                                                None, "quintic"))
    assert "q: 2 x [64, 64] [tensor out: distributed, Gram 64x64]" in table
    assert "[tensor in: distributed, Gram 64x64]" in table           # attention out, down
    per_head = describe(params, Routing(per_head=True),
                        block_note=tp_note(TensorParallel(mesh), spec_of, None, "quintic"))
    assert "q: 8 x [64, 16] [local]" in per_head   # a head lives on one tensor rank


def test_blockwise_scales_each_block_by_its_own_shape():
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    down = nnx.state(create_sharded(lambda: GPT(CFG, nnx.Rngs(0)), mesh), nnx.Param)
    down = {"down": down["blocks"]["mlp"]["down"]}                   # [L, F, D], F split 4 ways
    grads = jax.tree.map(lambda p: jax.device_put(
        jax.random.normal(jax.random.key(3), p.shape), p[...].sharding), down)
    tx = scale_by_muon(tp_mode="blockwise", plan=PlanSpec(mesh=mesh, rules=DEFAULT_RULES))
    got = jax.jit(tx.update)(grads, tx.init(down))[0]["down"][...]
    g = np.asarray(grads["down"][...])
    f, d = CFG.d_ff // 4, CFG.d_model
    for block in range(4):
        want = newton_schulz(g[:, block * f:(block + 1) * f]) * update_scale("spectral", f, d)
        np.testing.assert_allclose(got[:, block * f:(block + 1) * f], want, rtol=1e-5, atol=1e-6)
