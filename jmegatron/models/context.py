"""Causal attention over a sequence split across devices (context parallelism).

The T positions of a sequence are cut into 2C chunks of T / 2C and dealt to the C
ranks of a context axis, two chunks each (``ORDERS``):

  zigzag      rank i holds chunks i and 2C - 1 - i: under the causal mask every rank
              attends to the same number of (query, key) pairs, so none waits for the
              others (Megatron-LM's context parallelism deals the sequence so;
              Brandon et al.'s "Striped Attention", 2023, balances it by dealing the
              tokens round-robin instead);
  contiguous  rank i holds chunks 2i and 2i + 1, the plain split: the last rank does
              about twice the mean's work, the first almost none.

A rank's queries attend to every rank's keys by one of two strategies
(``CONTEXT_ATTENTION``), each called inside a map manual over the mesh
(``split_sequence_attention``) on the rank's q [B, 2c, N, H] and k, v [B, 2c, K, H]
(its rows and heads of its two chunks, in order), and
returning its attention output and the largest logit of each example and query head
over the whole sequence, [B, N] (``attention.causal_attention``'s pair):

  all_gather  gather K and V over the axis and attend with the mask of the true
              positions: simplest, but every rank holds the whole K and V (MaxText's
              default); autodiff's reduce-scatter returns their gradients;
  ring        pass K and V around the ring with ``ppermute``, C - 1 times, combining
              each block into the output by the online softmax (a running row
              maximum and sum; Milakov and Gimelshein, 2018), so no rank holds
              more than its own and one arriving block (Liu et al., "Ring Attention",
              2023). Each (query chunk, key chunk) pair is computed only where the
              causal mask leaves something to compute (``_relation``). The backward
              is its own (``custom_vjp``): the blocks go around the ring again with
              their key and value gradients, which arrive home after one more step;
              only q, k, v, the output and each row's log-sum-exp are kept.

In the model, the loss deals each window's tokens and targets (``sequence_order``,
``deal``) and hands the model their positions; each attention layer calls ``attend``,
which picks this module's path where the active rules split the sequence over a live
axis (the mesh's ``context``), and one device's (``attention.ATTENTION``) elsewhere.

References:
  Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for
    Near-Infinite Context", arXiv:2310.01889, 2023.
  Brandon et al., "Striped Attention: Faster Ring Attention for Causal
    Transformers", arXiv:2311.09431, 2023.
  Milakov and Gimelshein, "Online normalizer calculation for softmax",
    arXiv:1805.02867, 2018.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jmegatron.models.attention import ATTENTION, MASKED_LOGIT, repeat_kv
from jmegatron.models.config import CONTEXT_ORDERS as ORDERS, GPTConfig
from jmegatron.sharding import nested, rules as ax
from jmegatron.sharding.rules import (EXCHANGED, Rules, active_mesh_and_rules, logical_to_spec,
                                      mesh_axes_of)

SKIP, FULL, DIAGONAL = 0, 1, 2   # what a (query chunk, key chunk) pair computes


def chunks_of(rank, size: int, order: str):
    """The two chunk indices (of 2 ``size``) that ``rank`` holds under ``order``
    (``rank`` may be traced)."""
    if order == "zigzag":
        return rank, 2 * size - 1 - rank
    if order == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"context order {order!r}: one of {', '.join(ORDERS)}")


def dealt_positions(t: int, size: int, order: str) -> np.ndarray:
    """[T] the positions of a sequence of ``t`` in the order the ``size`` ranks hold
    them, rank after rank: ``x[:, dealt_positions(...)]`` split evenly over the
    context axis gives each rank its chunks, and a rank's slice of it its tokens'
    true positions (for RoPE and the mask)."""
    if t % (2 * size):
        raise ValueError(f"a sequence of {t} cannot be cut into 2 x {size} chunks")
    chunk = t // (2 * size)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for rank in range(size)
                           for c in chunks_of(rank, size, order)])


def pairs_computed(size: int, order: str) -> np.ndarray:
    """[C] the (query chunk, key chunk) pairs each rank's ``ring`` computes (the causal
    mask leaves something in them), each c x c logits: its share of the attention
    FLOPs. zigzag: 2C + 1 on every rank; contiguous: 4i + 3 on rank i."""
    return np.array([sum(int(_relation(q, k) != SKIP) for q in chunks_of(rank, size, order)
                         for k in range(2 * size)) for rank in range(size)])


def _relation(q_chunk, k_chunk):
    """What the pair computes: nothing (keys after the queries), every logit (keys
    before), or the causal triangle (the same chunk)."""
    return jnp.where(q_chunk > k_chunk, FULL, jnp.where(q_chunk == k_chunk, DIAGONAL, SKIP))


def _masked_logits(q, k, relation):
    """q k^T / sqrt(H) in fp32 [B, N, c, c] (k repeated to q's heads), the causal
    triangle's upper part masked where ``relation`` is DIAGONAL."""
    c, h = q.shape[1], q.shape[-1]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * h ** -0.5
    keep = jnp.tril(jnp.ones((c, c), bool)) | (relation != DIAGONAL)
    return jnp.where(keep, logits, MASKED_LOGIT)


def _fold(a, kv_heads: int):
    """A gradient of repeated k or v [B, c, N, H] summed back to [B, c, K, H]."""
    b, c, n, h = a.shape
    return a.reshape(b, c, kv_heads, n // kv_heads, h).sum(axis=3)


def _block(q, k, v, relation):
    """One pair's (unnormalized output [B, c, N, H] fp32, row max [B, N, c], row sum)."""
    def compute(q, k, v):
        logits = _masked_logits(q, k, relation)
        top = logits.max(axis=-1)
        p = jnp.exp(logits - top[..., None])
        out = jnp.einsum("bnts,bsnh->btnh", p.astype(v.dtype), v,
                         preferred_element_type=jnp.float32)
        return out, top, p.sum(axis=-1)

    def skip(q, k, v):
        b, c, n, h = q.shape
        return _typed_as((jnp.zeros((b, c, n, h), jnp.float32),
                          jnp.full((b, n, c), MASKED_LOGIT), jnp.zeros((b, n, c), jnp.float32)),
                         q, k)

    return jax.lax.cond(relation == SKIP, skip, compute, q, k, v)


def _combine(state, block):
    """The online softmax: two partial (output, row max, row sum) as one."""
    (o, m, l), (o2, m2, l2) = state, block
    top = jnp.maximum(m, m2)
    a, b = jnp.exp(m - top), jnp.exp(m2 - top)
    rows = lambda w: w.swapaxes(1, 2)[..., None]   # [B, N, c] -> [B, c, N, 1]
    return o * rows(a) + o2 * rows(b), top, l * a + l2 * b


def _halves(a, axis: int = 1):
    """A rank's two chunks of ``a`` (its rows along ``axis``)."""
    return tuple(jnp.split(a, 2, axis=axis))


def _typed_as(tree, *like):
    """``tree``'s constants varying over the manual axes ``like``'s arrays vary over
    (the branches of a ``cond`` must agree)."""
    axes = tuple(sorted(frozenset().union(*map(nested.varying_axes, like))))
    return jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying") if axes else a, tree)


def _ring_steps(axis, order):
    """(this rank, C, the chunk indices of the keys at ring step s, the permutation
    passing a block to the next rank)."""
    size = jax.lax.axis_size(axis)
    rank = jax.lax.axis_index(axis)
    source = lambda s: chunks_of((rank - s) % size, size, order)   # keys from rank - s
    return rank, size, source, [(i, (i + 1) % size) for i in range(size)]


def _ring_forward(q, k, v, axis, order):
    """(output [B, 2c, N, H], lse [B, N, 2c], peak [B, N]) of this rank's queries."""
    rank, size, source, ring = _ring_steps(axis, order)
    mine = chunks_of(rank, size, order)
    n = q.shape[2]
    qs = _halves(q)
    b, c, _, h = qs[0].shape
    empty = _typed_as((jnp.zeros((b, c, n, h), jnp.float32), jnp.full((b, n, c), MASKED_LOGIT),
                       jnp.zeros((b, n, c), jnp.float32)), q, k)

    def step(states, k, v, s):   # each query chunk's state, with the key chunks here
        ks, vs = _halves(repeat_kv(k, n)), _halves(repeat_kv(v, n))
        for bi in range(2):
            states = [_combine(state, _block(q_a, ks[bi], vs[bi],
                                             _relation(mine[a], source(s)[bi])))
                      for a, (q_a, state) in enumerate(zip(qs, states))]
        return states

    def later(carry, s):
        states, k, v = carry
        k, v = (jax.lax.ppermute(a, axis, ring) for a in (k, v))
        return (step(states, k, v, s), k, v), None

    states = step([empty, empty], k, v, 0)
    (states, _, _), _ = jax.lax.scan(later, (states, k, v), jnp.arange(1, size))
    out = jnp.concatenate([o / l.swapaxes(1, 2)[..., None] for o, _, l in states], axis=1)
    lse = jnp.concatenate([m + jnp.log(l) for _, m, l in states], axis=-1)
    peak = jnp.maximum(*[m.max(axis=-1) for _, m, _ in states])
    return out.astype(q.dtype), lse, jax.lax.pmax(peak, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ring_attention(q, k, v, axis: str, order: str):
    """Causal attention of this rank's q [B, 2c, N, H] over the whole sequence's keys and
    values, k, v [B, 2c, K, H] passed around the ``axis`` ring (module docstring):
    (output [B, 2c, N, H], largest logit [B, N] over the sequence, no gradient)."""
    out, _, peak = _ring_forward(q, k, v, axis, order)
    return out, peak


def _ring_fwd(q, k, v, axis, order):
    out, lse, peak = _ring_forward(q, k, v, axis, order)
    return (out, peak), (q, k, v, out, lse)


def _ring_bwd(axis, order, residuals, cotangents):
    """The blocks around the ring again, each with its key and value gradients: for a
    pair, p = exp(logits - lse), dv += p^T dy, ds = p (dy v^T - rowsum(dy * out)),
    dq += ds k / sqrt(H), dk += ds^T q / sqrt(H)."""
    q, k, v, out, lse = residuals
    dy = cotangents[0]
    rank, size, source, ring = _ring_steps(axis, order)
    mine = chunks_of(rank, size, order)
    n, kv_heads, h = q.shape[2], k.shape[2], q.shape[-1]
    qs, dys, lses = _halves(q), _halves(dy), _halves(lse, -1)
    row_dots = _halves(jnp.einsum("btnh,btnh->bnt", dy.astype(jnp.float32),
                                  out.astype(jnp.float32)), -1)   # rowsum(dy * out)

    def pair(a, k_blk, v_blk, relation):   # (dq_a, dk_blk, dv_blk) of one pair, fp32
        def compute(k_blk, v_blk):
            p = jnp.exp(_masked_logits(qs[a], k_blk, relation) - lses[a][..., None])
            dv = jnp.einsum("bnts,btnh->bsnh", p, dys[a].astype(jnp.float32))
            dp = jnp.einsum("btnh,bsnh->bnts", dys[a], v_blk,
                            preferred_element_type=jnp.float32)
            ds = p * (dp - row_dots[a][..., None]) * h ** -0.5
            return (jnp.einsum("bnts,bsnh->btnh", ds, k_blk.astype(jnp.float32)),
                    jnp.einsum("bnts,btnh->bsnh", ds, qs[a].astype(jnp.float32)), dv)

        def skip(k_blk, v_blk):
            zeros = jnp.zeros(k_blk.shape, jnp.float32)
            return _typed_as((jnp.zeros(qs[a].shape, jnp.float32), zeros, zeros), qs[a], k_blk)

        return jax.lax.cond(relation == SKIP, skip, compute, k_blk, v_blk)

    def step(dq, k, v, s):   # (dq, dk, dv of the blocks k, v here)
        ks, vs = _halves(repeat_kv(k, n)), _halves(repeat_kv(v, n))
        dk, dv = [], []
        for bi in range(2):
            grads = [pair(a, ks[bi], vs[bi], _relation(mine[a], source(s)[bi]))
                     for a in range(2)]
            dq = [d + g_q for d, (g_q, _, _) in zip(dq, grads)]
            dk.append(sum(g_k for _, g_k, _ in grads))
            dv.append(sum(g_v for _, _, g_v in grads))
        fold = lambda parts: _fold(jnp.concatenate(parts, axis=1), kv_heads)
        return dq, fold(dk), fold(dv)

    def later(carry, s):
        dq, k, v, dk, dv = carry
        k, v, dk, dv = (jax.lax.ppermute(a, axis, ring) for a in (k, v, dk, dv))
        dq, g_k, g_v = step(dq, k, v, s)
        return (dq, k, v, dk + g_k, dv + g_v), None

    zeros = [_typed_as(jnp.zeros(a.shape, jnp.float32), q, k) for a in qs]
    dq, dk, dv = step(zeros, k, v, 0)
    (dq, _, _, dk, dv), _ = jax.lax.scan(later, (dq, k, v, dk, dv), jnp.arange(1, size))
    dk, dv = (jax.lax.ppermute(a, axis, ring) for a in (dk, dv))   # home: C steps round
    return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype),
            dv.astype(v.dtype))


ring_attention.defvjp(_ring_fwd, _ring_bwd)


def gathered_attention(q, k, v, axis: str, order: str):
    """Causal attention of this rank's q [B, 2c, N, H] over k, v [B, 2c, K, H]
    gathered whole over ``axis`` (module docstring), masked by the true positions:
    (output [B, 2c, N, H], largest logit [B, N] over the sequence, no gradient)."""
    size, rank = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    t, n, h = q.shape[1], q.shape[2], q.shape[3]
    # Named EXCHANGED, as the MoE's exchanges: a layer recomputed for its backward (the
    # owner and fsdp runners' remat) keeps them instead of gathering them again.
    k, v = (repeat_kv(checkpoint_name(jax.lax.all_gather(a, axis, axis=1, tiled=True),
                                    EXCHANGED), n) for a in (k, v))
    positions = jnp.asarray(dealt_positions(t * size, size, order))
    mine = jax.lax.dynamic_slice_in_dim(positions, rank * t, t)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * h ** -0.5
    logits = jnp.where(mine[:, None] >= positions[None, :], logits, MASKED_LOGIT)
    peak = jax.lax.pmax(jax.lax.stop_gradient(logits).max(axis=(-2, -1)), axis)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", weights.astype(v.dtype), v), peak


CONTEXT_ATTENTION = {"all_gather": gathered_attention, "ring": ring_attention}


def split_sequence_attention(strategy: str, mesh: jax.sharding.Mesh, rules: Rules,
                             order: str):
    """``CONTEXT_ATTENTION[strategy]`` as a function of q [B, T, N, H] and k, v [B, T, K,
    H] already dealt in ``order`` (``sequence_order``) and placed as ``rules`` place
    (batch, seq, heads): (output [B, T, N, H], dealt alike, largest logit [B, N]). A
    map manual over every axis, each rank attending with its own rows and heads; only
    the sequence axis (``sequence_axis``) carries the strategy's collectives."""
    axis = sequence_axis(mesh.shape, rules)
    if axis is None:
        raise ValueError("no live mesh axis splits the sequence under these rules")
    spec = lambda heads: logical_to_spec((ax.BATCH, ax.SEQ, heads, None), rules)
    body = functools.partial(CONTEXT_ATTENTION[strategy], axis=axis, order=order)
    return nested.shard_map(body, mesh, (spec(ax.ACT_HEADS), spec(ax.ACT_KV_HEADS),
                                         spec(ax.ACT_KV_HEADS)),
                            (spec(ax.ACT_HEADS), logical_to_spec((ax.BATCH, ax.ACT_HEADS), rules)))


def sequence_axis(mesh_shape, rules: Rules) -> str | None:
    """The mesh axis of size > 1 that splits the sequence under ``rules`` (None: every
    rank holds whole sequences); ValueError if several do."""
    live = [a for a in mesh_axes_of(ax.SEQ, rules) if mesh_shape.get(a, 1) > 1]
    if len(live) > 1:
        raise ValueError(f"the sequence is split over {live}: context parallelism takes "
                         "one mesh axis")
    return live[0] if live else None


def active_sequence_axis() -> str | None:
    """``sequence_axis`` of the enclosing ``rules.activation_sharding`` (None outside one)."""
    active = active_mesh_and_rules()
    return active and sequence_axis(active[0].shape, active[1])


def sequence_order(t: int, mesh_shape, rules: Rules, order: str) -> np.ndarray | None:
    """[T] the positions of a sequence of ``t`` in the order the model runs them on a
    mesh of ``mesh_shape`` under ``rules``: dealt in ``order`` over the axis splitting
    the sequence (``dealt_positions``); None where none does (0..T-1). The caller
    deals its tokens and their targets by it (``deal``) and passes it to the model as
    their positions; a loss that is a mean over tokens needs no undealing."""
    axis = sequence_axis(mesh_shape, rules)
    return None if axis is None else dealt_positions(t, mesh_shape[axis], order)


def deal(x: jax.Array, order: np.ndarray | None) -> jax.Array:
    """x [B, T, ...] in ``sequence_order``'s ``order`` (None: as it is)."""
    return x if order is None else x[:, order]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cfg: GPTConfig):
    """The model's causal attention of q [B, T, N, H] over k, v [B, T, K, H] in
    ``sequence_order``'s order: split over the sequence axis of the enclosing
    ``rules.activation_sharding`` by ``cfg.context_attention`` (dealt in
    ``cfg.context_order``), else whole by ``cfg.attention``. Returns (output [B, T, N,
    H], largest logit [B, N])."""
    axis = active_sequence_axis()
    if not axis:
        return ATTENTION[cfg.attention](q, k, v)
    mesh, rules = active_mesh_and_rules()
    why = refusal(cfg, size=mesh.shape[axis])
    if why:
        raise ValueError(why)
    return split_sequence_attention(cfg.context_attention, mesh, rules, cfg.context_order)(
        q, k, v)


def refusal(cfg: GPTConfig, seq_len: int | None = None, size: int = 1) -> str | None:
    """Why ``cfg`` cannot run sequences of ``seq_len`` split over a context axis of
    ``size`` (one line), or None."""
    if size == 1:
        return None
    if cfg.attention != "einsum":
        return (f"--model.attention {cfg.attention} cannot run a sequence split over "
                f"--mesh.context {size}: the split attention computes its own blocks "
                "(their row sums combine by the online softmax); use --model.attention einsum")
    if seq_len is not None and seq_len % (2 * size):
        return (f"--seq-len {seq_len} must be divisible by 2 x --mesh.context = {2 * size}: "
                "the sequence is dealt to the context ranks in 2 chunks each")
    return None
