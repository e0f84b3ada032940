"""Causal self-attention of a whole sequence on one device: the model's two paths
(``ATTENTION``, chosen by ``GPTConfig.attention``), each returning the output and
the largest pre-softmax logit of each example and query head (QK-clip's S).
Attention over a sequence split across devices builds on these
(``models.context``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MASKED_LOGIT = -0.7 * float(jnp.finfo(jnp.float32).max)   # a logit softmax gives no weight


def repeat_kv(a: jax.Array, n: int) -> jax.Array:
    """k or v [B, T, K, H] repeated for the n query heads, [B, T, n, H]: query head i
    uses key/value head i // (n/K)."""
    return jnp.repeat(a, n // a.shape[2], axis=2)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal softmax attention of q [B, T, N, H] over k, v [B, T, K, H] (query head
    n uses key/value head n // (N/K)), with the logits in fp32.

    Also returns each example's and query head's largest pre-softmax logit
    q_t . k_s / sqrt(H) over the unmasked s <= t, [B, N]: what QK-clip watches.
    It is read off the softmax's own row maxima and carries no gradient, so it
    costs one reduction of the [B, N, T] maxima and keeps no [B, N, T, T] tensor.
    """
    t, n, h = q.shape[1:]
    # Each key/value head repeated for its query heads: plain multi-head einsums,
    # which XLA:CPU runs faster than grouped ones (experiments.bench_attention).
    k, v = (repeat_kv(a, n) for a in (k, v))                                 # [B, T, N, H]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k,
                        preferred_element_type=jnp.float32) * h ** -0.5      # [B, N, T, T]
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, MASKED_LOGIT)
    # The same row maxima as the softmax's own (XLA computes them once).
    peak = jax.lax.stop_gradient(logits.max(axis=-1).max(axis=-1))          # [B, N]
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", weights.astype(v.dtype), v), peak


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                    block: int = 512) -> tuple[jax.Array, jax.Array]:
    """``causal_attention`` by ``jax.nn.dot_product_attention``: cuDNN's fused (flash)
    kernel on GPU, which never forms the [B, N, T, T] logits, and XLA's elsewhere.

    The kernel returns no logits, so the largest one per example and head, [B, N]
    (QK-clip's S, the metric), comes from ``causal_peak``: a second pass over
    q k^T in query blocks, with no gradient: one more q k^T over all T keys (2 B N
    T^2 H FLOPs, the causal mask skipping nothing) and one [B, N, block, T] fp32
    block at a time. On CPU the einsum path is faster (no fused kernel there).
    """
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True)   # GQA: K divides N
    return y, causal_peak(q, k, block)


def causal_peak(q: jax.Array, k: jax.Array, block: int = 512) -> jax.Array:
    """max over t and s <= t of q_t . k_s / sqrt(H), per example and query head [B, N],
    in fp32, one block of queries at a time (exactly ``causal_attention``'s)."""
    b, t, n, h = q.shape
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    k = repeat_kv(k, n)                                                         # [B, T, N, H]
    size = math.gcd(t, block)
    blocks = q.reshape(b, t // size, size, n, h).swapaxes(0, 1)           # [T/bq, B, bq, N, H]

    def block_peak(args):
        index, q_block = args
        logits = jnp.einsum("btnh,bsnh->bnts", q_block, k,
                            preferred_element_type=jnp.float32) * h ** -0.5  # [B, N, bq, T]
        rows = index * size + jnp.arange(size)
        causal = jnp.arange(t)[None, :] <= rows[:, None]                          # [bq, T]
        return jnp.where(causal, logits, -jnp.inf).max(axis=(-2, -1))             # [B, N]

    return jax.lax.map(block_peak, (jnp.arange(t // size), blocks)).max(axis=0)


ATTENTION = {"einsum": causal_attention, "flash": flash_attention}
