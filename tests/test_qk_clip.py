"""QK-clip: the largest attention logit the model reports, the clip rule, and the
clipped train step (its layouts are in test_layouts, which trains with QK-clip on)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import helpers
from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPT, GPTConfig, clip_scales, create_sharded, qk_clip, qk_clipper
from jmegatron.models.layers import rms_norm, rope
from jmegatron.sharding import (DEFAULT_RULES, MeshConfig, activation_sharding, logical_to_spec,
                                make_mesh)
from jmegatron.train import ScheduleConfig, TrainConfig, make_loss_fn, make_train_step
from jmegatron.train.config import ConfigError

CFG = GPTConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                d_ff=128).pad_vocab(2)
B, T = 8, 16


def tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T + 1), 0, CFG.vocab_size)


def full_score_max(model: GPT, tokens: jax.Array) -> jax.Array:
    """[L, N]: each layer's whole [B, N, T, T] causal scores built and maximized,
    layer by layer (each block's input from the block before)."""
    cfg, g, h = model.cfg, model.cfg.group_size, model.cfg.resolved_head_dim
    x, positions = model.embed[...][tokens], jnp.arange(tokens.shape[1])
    graphdef, stacked = nnx.split(model.blocks)
    out = []
    for layer in range(cfg.n_layers):
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], stacked))
        qkv = jnp.einsum("btd,dkgh->btkgh", rms_norm(x, block.attn_norm[...], cfg.norm_eps),
                         block.attn.qkv[...])
        q = rope(qkv[:, :, :, :g].reshape(*x.shape[:2], cfg.n_heads, h), positions,
                 cfg.rope_theta)
        k = jnp.repeat(rope(qkv[:, :, :, g], positions, cfg.rope_theta), g, axis=2)
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)     # [B, N, T, T]
        causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
        out.append(jnp.where(causal, scores, -jnp.inf).max(axis=(0, 2, 3)))
        x, _ = block(x, positions)
    return jnp.stack(out)


def reported_max(cfg, mesh, params, tokens):
    graphdef, state = nnx.split(create_sharded(lambda: GPT(cfg, nnx.Rngs(0)), mesh))
    if params is not None:
        state = jax.device_put(params, jax.tree.map(lambda a: a.sharding, state))

    @jax.jit
    def forward(state, tokens):
        with activation_sharding(mesh):
            return nnx.merge(graphdef, state)(tokens, return_aux=True)[1].max_logit

    if mesh is not None:
        tokens = jax.device_put(
            tokens, NamedSharding(mesh, logical_to_spec(("batch", "seq"), DEFAULT_RULES)))
    return forward(state, tokens)


@pytest.mark.parametrize("mesh_config", [None, MeshConfig(fsdp=2, tensor=2, data=2)],
                         ids=["one_device", "tensor2_fsdp2"])
def test_max_attention_logit_equals_the_full_scores(mesh_config):
    model = GPT(CFG, nnx.Rngs(0))
    want = full_score_max(model, tokens()[:, :-1])
    mesh = None if mesh_config is None else make_mesh(mesh_config)
    got = reported_max(CFG, mesh, nnx.state(model), tokens()[:, :-1])
    assert got.shape == (CFG.n_layers, CFG.n_heads)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_the_gqa_rule_by_hand():
    """Group 0 (heads 0, 1): head 0 at 4 over tau 2 (eta 1/2), head 1 at 1; group 1
    (heads 2, 3) under tau."""
    s = jnp.array([[4.0, 1.0, 2.0, 0.5]])
    q, k = clip_scales(s, n_kv_heads=2, tau=2.0, alpha=0.5)
    np.testing.assert_allclose(q, [[0.5 ** 0.5, 1, 1, 1]], rtol=1e-6)
    np.testing.assert_allclose(k, [[0.5 ** 0.5, 1]], rtol=1e-6)
    # Head 0 lands on tau; head 1 is scaled only through the shared key.
    np.testing.assert_allclose(s * q * jnp.repeat(k, 2, axis=1), [[2.0, 0.5 ** 0.5, 2.0, 0.5]],
                               rtol=1e-6)
    # alpha 1 leaves the shared keys alone (K2's choice for its shared rotary key).
    q, k = clip_scales(s, 2, 2.0, alpha=1.0)
    np.testing.assert_allclose(q, [[0.5, 1, 1, 1]])
    np.testing.assert_allclose(k, [[1, 1]])
    # Two clipped heads in a group: the key takes the stronger clip, each query its own.
    q, k = clip_scales(jnp.array([[8.0, 4.0]]), 1, 2.0, alpha=0.5)
    np.testing.assert_allclose(k, [[0.5]], rtol=1e-6)
    np.testing.assert_allclose(q, [[0.5, 0.5 ** 0.5]], rtol=1e-6)
    assert np.all(np.array([[8.0, 4.0]]) * q * k <= 2.0 * (1 + 1e-6))


ONE_LAYER = dataclasses.replace(CFG, n_layers=1)
TRAIN = TrainConfig(lr=1e-2, schedule=ScheduleConfig(warmup_steps=0), grad_clip=0.0)


def boosted(params):
    """Query head 0 made 6x larger, so its logits stand far above the others."""
    qkv = params["blocks"]["attn"]["qkv"]
    params["blocks"]["attn"]["qkv"] = qkv.replace(qkv[...].at[:, :, 0, 0].multiply(6.0))
    return params


def test_a_clipped_step_brings_every_clipped_head_to_tau_and_leaves_the_rest():
    """One layer, the optimizer's update zeroed: only the clip moves the weights. The
    forward on the same batch then has max logit <= tau for every clipped head
    (exactly tau for the strongest of each group); what no clip touches is bitwise
    the same."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    layout, optimizer, graphdef, state = helpers.build(mesh, "fsdp", ONE_LAYER, TRAIN)
    state = state._replace(params=boosted(state.params))
    before = reported_max(ONE_LAYER, mesh, state.params, tokens()[:, :-1])[0]
    tau = float(np.sort(before)[-2]) * 1.5     # head 0 (group 0) alone over tau
    assert int(np.sum(before > tau)) == 1 and before[0] > tau

    frozen = dataclasses.replace(optimizer, tx=optax.set_to_zero())
    loss_fn = make_loss_fn(graphdef, ONE_LAYER, mesh, layout)
    step = make_train_step(loss_fn, frozen, 1, mesh, layout.rules, qk_clipper(ONE_LAYER, tau))
    old = jax.tree.map(np.asarray, state.params)
    new, metrics = step(state, tokens())
    assert int(metrics["qk_clipped_heads"]) == 1
    after = reported_max(ONE_LAYER, mesh, new.params, tokens()[:, :-1])[0]
    np.testing.assert_allclose(after[0], tau, rtol=1e-4)         # the clipped head
    np.testing.assert_allclose(after[1], before[1] * np.sqrt(tau / before[0]), rtol=1e-4)
    np.testing.assert_allclose(after[2:], before[2:], rtol=1e-6)   # group 1 untouched

    qkv, qkv_old = np.asarray(new.params["blocks"]["attn"]["qkv"][...]), \
        old["blocks"]["attn"]["qkv"][...]
    np.testing.assert_allclose(qkv[:, :, 0, 0], qkv_old[:, :, 0, 0] * np.sqrt(tau / before[0]),
                               rtol=1e-6)
    np.testing.assert_allclose(qkv[:, :, 0, 2], qkv_old[:, :, 0, 2] * np.sqrt(tau / before[0]),
                               rtol=1e-6)
    unclipped = np.ones(qkv.shape, bool)
    unclipped[:, :, 0, [0, 2]] = False     # group 0's query head 0 and its key
    np.testing.assert_array_equal(qkv[unclipped], qkv_old[unclipped])
    rest = lambda p: [v for k, v in jax.tree.leaves_with_path(p) if "qkv" not in str(k)]
    chex.assert_trees_all_equal(rest(jax.tree.map(np.asarray, new.params)), rest(old))


def test_the_clip_adds_no_collective_under_owner_and_tensor():
    """Owner layout on data 2 x fsdp 2 x tensor 2: the clip moves nothing (it scales
    each weight shard where it lives). The clipped step has the plain step's
    gathers and scatters, and its all-reduces carry at most a few scalars more (the
    clipped-head count; XLA computes the clip's [L, N] logits layer-sharded, so the
    metrics' maxima over them reduce over fsdp too). The largest logits cross
    devices once, as [L, N/tensor]."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    layout, optimizer, graphdef, state = helpers.build(mesh, "owner", CFG, TRAIN)
    loss_fn = make_loss_fn(graphdef, CFG, mesh, layout)
    plain, clipped = [
        hlo_collectives(make_train_step(loss_fn, optimizer, 1, mesh, layout.rules, clip),
                        state, tokens())
        for clip in (None, qk_clipper(CFG, 0.1))]
    moved = lambda report: sorted((c.kind, c.axes, c.shape, c.executions)
                                  for c in report.collectives if c.kind != "all-reduce")
    assert moved(clipped) == moved(plain), (plain.table(), clipped.table())
    reduced = lambda report: sum(c.buffer_bytes * c.executions
                                 for c in report.select("all-reduce"))
    assert 0 <= reduced(clipped) - reduced(plain) <= 4 * 4, (plain.table(), clipped.table())
    peaks = [c for c in plain.select("all-reduce", ("data", "fsdp"))
             if c.shape.startswith(f"f32[{CFG.n_layers},{CFG.n_heads // 2}]")]
    assert len(peaks) == 1 and peaks[0].executions == 1, plain.table()


@pytest.mark.parametrize("args, message", [
    (dict(qk_clip=-1.0), "--qk-clip -1.0: must be a finite number >= 0"),
    (dict(qk_clip=10.0, model=dataclasses.replace(CFG, qk_norm=True)), "--model.qk-norm"),
    (dict(qk_clip=10.0, qk_clip_alpha=1.5), "--qk-clip-alpha 1.5: must be in [0, 1]"),
])
def test_bad_settings_are_refused_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TrainConfig(**args)


def test_a_qkv_bias_is_clipped_with_its_weight():
    """Qwen2's q = x W_q + b_q: scaling W alone would miss tau; with the bias scaled
    too, the clipped head lands on it exactly (one device, one layer)."""
    cfg = dataclasses.replace(ONE_LAYER, qkv_bias=True)
    model = GPT(cfg, nnx.Rngs(0))
    bias = model.blocks.attn.qkv_bias
    bias.set_value(jax.random.normal(jax.random.key(3), bias.shape))   # a real bias
    params = boosted(nnx.state(model, nnx.Param))
    before = reported_max(cfg, None, params, tokens()[:, :-1])[0]
    tau = float(before[0]) / 2
    after = reported_max(cfg, None, qk_clip(params, before[None], cfg, tau),
                         tokens()[:, :-1])[0]
    np.testing.assert_allclose(after[0], tau, rtol=1e-4)
