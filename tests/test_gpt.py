"""The GPT model: sharded loss and gradients equal the single-device model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.models import GPT, GPTConfig, create_sharded, cross_entropy
from jmegatron.models.attention import causal_attention, flash_attention
from jmegatron.sharding import (DEFAULT_RULES, MeshConfig, activation_sharding,
                                logical_to_spec, make_mesh)

CFG = GPTConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4,
                d_ff=128).pad_vocab(4)   # one padded vocabulary (512) for every mesh
BATCH, SEQ = 8, 16

MESHES = {
    "one_device": MeshConfig(fsdp=1),
    "data8": MeshConfig(data=8, fsdp=1),
    "fsdp8": MeshConfig(fsdp=8),
    "data4_tensor2": MeshConfig(data=4, fsdp=1, tensor=2),
    "fsdp2_tensor4": MeshConfig(fsdp=2, tensor=4),
    "data2_fsdp2_tensor2": MeshConfig(data=2, fsdp=2, tensor=2),
}

# The spec every leaf must have under DEFAULT_RULES, written out by hand.
EXPECTED_SPECS = {
    "embed": P("tensor", "fsdp"),
    "head": P("fsdp", "tensor"),
    "final_norm": P(None),
    "blocks/attn_norm": P(None, None),
    "blocks/mlp_norm": P(None, None),
    "blocks/attn/qkv": P(None, "fsdp", "tensor", None, None),
    "blocks/attn/out": P(None, "tensor", None, "fsdp"),
    "blocks/mlp/gate_up": P(None, "fsdp", None, "tensor"),
    "blocks/mlp/down": P(None, "tensor", "fsdp"),
}


def tokens():
    return jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, CFG.vocab_size)


def loss_and_grads(cfg, mesh, tokens):
    model = create_sharded(lambda: GPT(cfg, nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens):
        def loss_fn(state):
            with activation_sharding(mesh):
                logits = nnx.merge(graphdef, state)(tokens[:, :-1])
            rules = None if mesh is None else DEFAULT_RULES
            return cross_entropy(logits, tokens[:, 1:], cfg.vocab_size, mesh=mesh,
                                 rules=rules)[0]
        return jax.value_and_grad(loss_fn)(state)

    if mesh is not None:
        tokens = jax.device_put(
            tokens, NamedSharding(mesh, logical_to_spec(("batch", "seq"), DEFAULT_RULES)))
    return state, step(state, tokens)


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(CFG, None, tokens())[1]


def paths(state):
    flat = jax.tree.leaves_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return {"/".join(str(k.key) for k in path): v for path, v in flat}


@pytest.mark.parametrize("name", MESHES)
def test_sharded_loss_and_grads_equal_one_device(name, reference):
    mesh = make_mesh(MESHES[name], jax.devices()[:1] if name == "one_device" else None)
    state, (loss, grads) = loss_and_grads(CFG, mesh, tokens())
    ref_loss, ref_grads = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-7)

    leaves = paths(state)
    assert set(leaves) == set(EXPECTED_SPECS)
    for path, var in leaves.items():
        want = NamedSharding(mesh, EXPECTED_SPECS[path])
        assert var[...].sharding.is_equivalent_to(want, var.ndim), (path, var[...].sharding)
        # The live array really is split: its shard is the global shape over the mesh.
        assert var[...].addressable_shards[0].data.shape == want.shard_shape(var.shape), path


def test_loss_starts_near_uniform(reference):
    loss, _ = reference
    np.testing.assert_allclose(loss, np.log(CFG.vocab_size), rtol=0.05)


def test_padded_vocabulary_is_masked():
    """Extra padding rows (with junk in them) change neither loss nor real gradients."""
    small = CFG.pad_vocab(1)                               # 384 rows
    state, (loss, grads) = loss_and_grads(small, None, tokens())
    graphdef, big_state = nnx.split(create_sharded(lambda: GPT(CFG, nnx.Rngs(0)), None))
    junk = 5.0
    big_state["embed"][...] = jnp.full((CFG.vocab, CFG.d_model), junk).at[:small.vocab].set(
        state["embed"][...])
    big_state["head"][...] = jnp.full((CFG.d_model, CFG.vocab), junk).at[:, :small.vocab].set(
        state["head"][...])
    big_loss, big_grads = jax.jit(jax.value_and_grad(lambda s: cross_entropy(
        nnx.merge(graphdef, s)(tokens()[:, :-1]), tokens()[:, 1:], CFG.vocab_size)[0]))(big_state)
    np.testing.assert_allclose(big_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(big_grads["head"][...][:, :small.vocab], grads["head"][...],
                               rtol=1e-5, atol=1e-8)
    assert not jnp.any(big_grads["head"][...][:, small.vocab:])


@pytest.mark.parametrize("option", [dict(remat="full"), dict(remat="dots"),
                                    dict(attention="flash")])
def test_remat_and_flash_attention_keep_gradients(option, reference):
    cfg = GPTConfig(**{**CFG.__dict__, **option})
    _, (loss, grads) = loss_and_grads(cfg, None, tokens())
    np.testing.assert_allclose(loss, reference[0], rtol=1e-6)
    chex.assert_trees_all_close(grads, reference[1], rtol=1e-5, atol=1e-8)


def test_bf16_compute_keeps_fp32_params_and_stays_close(reference):
    cfg = GPTConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    state, (loss, grads) = loss_and_grads(cfg, None, tokens())
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(state))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(loss, reference[0], rtol=2e-2)


def test_tied_embeddings_and_qk_norm():
    cfg = GPTConfig(**{**CFG.__dict__, "tie_embeddings": True, "qk_norm": True})
    state, (loss, _) = loss_and_grads(cfg, None, tokens())
    leaves = paths(state)
    assert "head" not in leaves and "blocks/attn/q_norm" in leaves
    assert sum(v.size for v in leaves.values()) == cfg.param_count()
    assert np.isfinite(loss)


def test_param_count_matches_the_model():
    model = create_sharded(lambda: GPT(CFG, nnx.Rngs(0)), None)
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == CFG.param_count()


def test_causal_mask_keeps_prefix_logits():
    model = create_sharded(lambda: GPT(CFG, nnx.Rngs(0)), None)
    t = tokens()[:, :SEQ]
    changed = t.at[:, -1].set((t[:, -1] + 1) % CFG.vocab_size)
    np.testing.assert_allclose(model(t)[:, :-1], model(changed)[:, :-1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t, block", [(16, 4), (12, 8)])   # 12: blocks of gcd(12, 8) = 4
def test_flash_attention_gives_the_einsum_paths_output_and_largest_logit(t, block):
    """jax.nn.dot_product_attention (XLA's on CPU, cuDNN's on GPU) and the blockwise
    largest logit equal the einsum path's, on grouped heads (N 4, K 2)."""
    q, k, v = (jax.random.normal(key, (2, t, n, 8)) for key, n in
               zip(jax.random.split(jax.random.key(3), 3), (4, 2, 2)))
    want_y, want_peak = jax.jit(causal_attention)(q, k, v)
    y, peak = jax.jit(lambda *a: flash_attention(*a, block=block))(q, k, v)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(peak, want_peak, rtol=1e-6)
    assert peak.shape == (2, 4)
    # Against the definition: max over s <= t of q_t . k_s / sqrt(H), key head n // 2.
    logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, 2, axis=2)) / np.sqrt(8)
    causal = np.tril(np.ones((t, t), bool))
    np.testing.assert_allclose(peak, np.where(causal, logits, -np.inf).max(axis=(2, 3)),
                               rtol=1e-5)
