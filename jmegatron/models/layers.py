"""Transformer building blocks. Every parameter carries its logical axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmegatron.models import context
from jmegatron.models.config import GPTConfig
from jmegatron.models.products import bias_add, weight_einsum
from jmegatron.sharding import nested, rules as ax
from jmegatron.sharding.rules import (active_mesh_and_rules, constrain, logical_to_spec,
                                      mesh_axes_of, spec_axes)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], logical: tuple[str | None, ...],
          std: float | None, compute: str = "float32", grad: str | None = None) -> nnx.Param:
    """An fp32 parameter, normal(0, std) (ones when std is None), named by logical axes,
    that computes in ``compute`` (the model's dtype for matmul weights; fp32 for norm
    scales and the router) and has its gradient computed and summed in ``grad`` (None:
    ``compute``; ``GPTConfig.weight_grad_dtype``): runners gather it in the first and
    sum its gradient in the second (``rules.compute_dtype_of``, ``rules.grad_dtype_of``).

    The names are logical, not mesh axes, so Flax must not try to shard the
    value with them (``eager_sharding=False``); ``create_sharded`` maps them
    to mesh axes through a rules table.
    """
    if std is None:
        value = jnp.ones(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, out_sharding=logical, eager_sharding=False, compute_dtype=compute,
                     grad_dtype=grad or compute)


def embed_lookup(table: jax.Array, tokens: jax.Array, dtype=None) -> jax.Array:
    """Rows of ``table`` [V, D] for ``tokens`` [B, T], cast to ``dtype`` (None: the
    table's; cast after the lookup, the table's gradient is summed in its own dtype);
    vocab-parallel when sharded.

    With the vocabulary split over devices (Megatron), each device looks up the
    tokens that fall in its slice, zeros the others, and one all-reduce of
    [B, T, D] combines them. (Left to XLA, the gather of a table sharded over
    both vocab and embed replicates the whole activation.)
    """
    dtype = table.dtype if dtype is None else dtype
    active = active_mesh_and_rules()
    if active is None:
        return table[tokens].astype(dtype)
    mesh, rules = active
    vocab_axes = tuple(a for a in mesh_axes_of(ax.VOCAB, rules) if mesh.shape[a] > 1)
    batch_axes = spec_axes(logical_to_spec((ax.BATCH,), rules)[0])
    if not vocab_axes or set(vocab_axes) & set(batch_axes):
        # Not split (or split like the batch, which validate_sharding refuses): plain gather.
        return constrain(table[tokens].astype(dtype), (ax.BATCH, ax.SEQ, ax.ACT_EMBED))

    def local(table_block, tokens_block):   # [V/tp, D], [B/dp, T]
        v_local = table_block.shape[0]
        ids = tokens_block - jax.lax.axis_index(vocab_axes) * v_local
        here = (ids >= 0) & (ids < v_local)
        rows = table_block[jnp.clip(ids, 0, v_local - 1)]
        return jax.lax.psum(jnp.where(here[..., None], rows, 0).astype(dtype), vocab_axes)

    return nested.shard_map(
        local, mesh, (jax.P(vocab_axes, None), logical_to_spec((ax.BATCH, ax.SEQ), rules)),
        logical_to_spec((ax.BATCH, ax.SEQ, ax.ACT_EMBED), rules))(table, tokens)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: tuple = ()) -> jax.Array:
    """RoPE's rotation frequencies [H/2]; with Llama 3's ``scaling`` (factor, low,
    high, context), wavelengths past context/low are stretched by the factor, those
    under context/high kept, and the ones between blended linearly in context/wavelength."""
    half = head_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if not scaling:
        return freq
    factor, low, high, context = scaling
    cycles = context * freq / (2 * jnp.pi)          # rotations over the original context
    blend = jnp.clip((cycles - low) / (high - low), 0.0, 1.0)   # 0: stretch, 1: keep
    return blend * freq + (1 - blend) * freq / factor


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: tuple = ()) -> jax.Array:
    """Rotary position embedding (rotate-half form) on x [B, T, heads, H]."""
    freq = rope_frequencies(x.shape[-1], theta, scaling)            # [H/2]
    angle = positions[:, None].astype(jnp.float32) * freq            # [T, H/2]
    cos = jnp.cos(angle)[None, :, None, :]
    sin = jnp.sin(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with a fused, column-parallel QKV weight.

    The QKV weight is [D, K, G+2, H]: for each of the K key/value heads, its
    G = N/K query heads, then its key, then its value (Megatron's layout), so
    sharding the K axis over `tensor` keeps each group on one device. Returns
    the output and the largest attention logit per example and head [B, N]
    (``causal_attention``).
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, k, g, h = cfg.d_model, cfg.n_kv_heads, cfg.group_size, cfg.resolved_head_dim
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        wide = cfg.weight_grad_dtype
        self.qkv = param(rngs, (d, k, g + 2, h), (ax.EMBED, ax.KV_HEADS, ax.QKV, ax.HEAD_DIM),
                         cfg.init_std, cfg.dtype, wide)
        if cfg.qkv_bias:   # starts at zero
            self.qkv_bias = param(rngs, (k, g + 2, h), (ax.KV_HEADS, ax.QKV, ax.HEAD_DIM), 0.0,
                                  cfg.dtype, wide)
        self.out = param(rngs, (cfg.n_heads, h, d), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), out_std,
                         cfg.dtype, wide)
        if cfg.qk_norm:
            self.q_norm = param(rngs, (h,), (ax.NORM,), None)
            self.k_norm = param(rngs, (h,), (ax.NORM,), None)
        self.cfg = cfg

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        b, t, _ = x.shape
        wide = cfg.weight_grad_dtype
        qkv = weight_einsum("btd,dkgh->btkgh", x, self.qkv[...], wide)
        if cfg.qkv_bias:
            qkv = bias_add(qkv, self.qkv_bias[...], wide)
        qkv = constrain(qkv, (ax.BATCH, ax.SEQ, ax.ACT_KV_HEADS, None, None))
        g = cfg.group_size
        q = qkv[:, :, :, :g].reshape(b, t, cfg.n_heads, -1)   # [B, T, N, H]
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]            # [B, T, K, H]
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.norm_eps)
        q, k = (rope(a, positions, cfg.rope_theta, cfg.rope_scaling) for a in (q, k))
        y, max_logit = context.attend(q, k, v, cfg)          # [B, T, N, H], [B, N]
        y = constrain(y, (ax.BATCH, ax.SEQ, ax.ACT_HEADS, None))
        return weight_einsum("btnh,nhd->btd", y, self.out[...], wide), max_logit


class SwiGLU(nnx.Module):
    """SwiGLU MLP: fused gate/up weight [D, 2, F] column-parallel, down row-parallel.

    Fusing gate and up (as Megatron's fc1 does) makes their input gradient one
    partial sum, hence one all-reduce in the backward pass instead of two.
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.wide = cfg.weight_grad_dtype
        self.gate_up = param(rngs, (d, 2, f), (ax.EMBED, ax.GLU, ax.MLP), cfg.init_std, cfg.dtype,
                             self.wide)
        self.down = param(rngs, (f, d), (ax.MLP, ax.EMBED), out_std, cfg.dtype, self.wide)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up = weight_einsum("btd,dgf->btgf", x, self.gate_up[...], self.wide)
        gate_up = constrain(gate_up, (ax.BATCH, ax.SEQ, None, ax.ACT_MLP))   # [B, T, 2, F]
        h = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
        return weight_einsum("btf,fd->btd", h, self.down[...], self.wide)


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)); returns
    (x, {"max_logit": [B, N]}), the attention's largest logits."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.attn_norm = param(rngs, (cfg.d_model,), (ax.NORM,), None)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = param(rngs, (cfg.d_model,), (ax.NORM,), None)
        self.mlp = SwiGLU(cfg, rngs)
        self.eps = cfg.norm_eps

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict]:
        y, max_logit = self.attn(rms_norm(x, self.attn_norm[...], self.eps), positions)
        x = constrain(x + y, (ax.BATCH, ax.SEQ, ax.ACT_EMBED))
        x = x + self.mlp(rms_norm(x, self.mlp_norm[...], self.eps))
        return constrain(x, (ax.BATCH, ax.SEQ, ax.ACT_EMBED)), {"max_logit": max_logit}
