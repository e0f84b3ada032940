"""Token dispatch of a mixture-of-experts layer, on one device or one expert rank.

Each token picks k experts, giving N = S * k assignments. The functions here
run on a device's own tokens x_block [S, D] (inside ``jax.shard_map`` when
experts are spread over devices, or plain on one device) and return each
assignment's expert output, [N, D] in assignment order (token-major).

dropless  Assignments are sorted by expert and every one is computed: the
          experts' SwiGLUs run as grouped matmuls (``jax.lax.ragged_dot``)
          over the sorted rows.
capacity  Each expert takes at most C = ceil(capacity_factor * S * k / E)
          assignments of this device's tokens, first come first served in
          token order (GShard's position rule); the rest are dropped (their
          output is zero, the residual stream carries the token on). Slots
          are a dense [E, C, D] buffer, so the experts run as one batched
          matmul.

With the E experts split over P expert ranks (E/P each), assignments travel
to the rank holding their expert and back by all-to-all:

padded    ``jax.lax.all_to_all`` of a [P, C_send, D] buffer. For capacity
          dispatch C_send = E/P * C. For dropless dispatch C_send is the
          worst case S * min(k, E/P) (all of a device's assignments going to
          one rank), so the buffer holds up to P times more rows than tokens
          are routed: exact, but padded. It runs on every backend.
ragged    ``jax.lax.ragged_all_to_all`` moves only the real rows, at offsets
          derived from everyone's per-expert counts (one all-gather of [E]
          integers). XLA:CPU cannot run it: a switch for GPU/TPU.

References:
  Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation
    and Automatic Sharding", arXiv:2006.16668, 2020.
  Gale et al., "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts",
    arXiv:2211.15841, 2022.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jmegatron.models.products import weight_einsum, weight_ragged_dot
from jmegatron.sharding.rules import EXCHANGED

Axes = Sequence[str]


class ExpertWeights(NamedTuple):
    """This rank's experts' SwiGLU weights (gate_up [E_loc, D, 2, F], down [E_loc, F, D])
    and the dtype their gradients are computed in (None: the compute dtype;
    ``models.products``)."""

    gate_up: jax.Array
    down: jax.Array
    grad_dtype: jnp.dtype | None = None

    @property
    def local(self) -> int:
        """E_loc, the experts on this rank."""
        return self.gate_up.shape[0]

    def grouped(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """Rows [M, D] sorted by expert through each expert's SwiGLU; rows after the
        last group come out zero."""
        g, d, _, f = self.gate_up.shape
        h = weight_ragged_dot(rows, self.gate_up.reshape(g, d, 2 * f), group_sizes,
                              self.grad_dtype).reshape(-1, 2, f)                # [M, 2, F]
        return weight_ragged_dot(jax.nn.silu(h[:, 0]) * h[:, 1], self.down, group_sizes,
                                 self.grad_dtype)

    def batched(self, slots: jax.Array) -> jax.Array:
        """Slots [G, C, D] through expert g's SwiGLU each (one batched matmul)."""
        h = weight_einsum("gcd,gdkf->gckf", slots, self.gate_up, self.grad_dtype)  # [G, C, 2, F]
        return weight_einsum("gcf,gfd->gcd", jax.nn.silu(h[:, :, 0]) * h[:, :, 1], self.down,
                             self.grad_dtype)


def inverse_permutation(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))


def _ids_from_counts(counts: jax.Array, slots: int) -> jax.Array:
    """Local expert of each of ``slots`` rows per source (rows grouped by expert,
    ``counts`` [P, E_loc] of them), E_loc for the padding after them: [P, slots]."""
    ends = jnp.cumsum(counts, axis=-1)                              # [P, E_loc]
    return (jnp.arange(slots)[None, :, None] >= ends[:, None, :]).sum(-1)


def _local_experts(rows: jax.Array, ids: jax.Array, ffn: ExpertWeights) -> jax.Array:
    """Rows [M, D] with local expert ids [M] (E_loc: padding, output zero), in place."""
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=ffn.local + 1)[:-1]
    return ffn.grouped(rows[order], sizes)[inverse_permutation(order)]


def dropless(x: jax.Array, experts: jax.Array, ffn: ExpertWeights, ep_axes: Axes = (),
             exchange: str = "padded") -> jax.Array:
    """Every assignment's expert output, [N, D] in assignment order.

    x [S, D]; experts [S, k] (global ids); ``ffn``: this rank's experts (all of them
    when ``ep_axes`` is empty).
    """
    s, k = experts.shape
    ep = lax.axis_size(tuple(ep_axes)) if ep_axes else 1
    e_loc = ffn.local
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)                          # [N] sorted by expert
    counts = jnp.bincount(flat, length=e_loc * ep)                  # [E]
    token = order // k                                              # token of each sorted row
    if ep == 1:
        out = ffn.grouped(x[token], counts)
    elif exchange == "padded":
        out = _padded_exchange(x, token, flat[order], counts, ffn, tuple(ep_axes),
                               s * min(k, e_loc))
    elif exchange == "ragged":
        out = _ragged_exchange(x[token], counts, ffn, tuple(ep_axes), s * min(k, e_loc))
    else:
        raise ValueError(f"unknown exchange {exchange!r}; choose padded or ragged")
    return out[inverse_permutation(order)]


def _padded_exchange(x, token, sorted_experts, counts, ffn, axes, cap):
    """Sorted assignments to their experts' ranks in a [P, cap, D] all_to_all and back."""
    ep, e_loc = lax.axis_size(axes), ffn.local
    n = token.size
    per_rank = counts.reshape(ep, e_loc).sum(-1)                    # [P] rows to each rank
    first = jnp.cumsum(per_rank) - per_rank                         # [P] their first sorted row
    slot = jnp.arange(cap)
    src = jnp.clip(first[:, None] + slot, 0, n - 1)                 # [P, cap]
    valid = slot[None] < per_rank[:, None]
    send = jnp.where(valid[..., None], x[token[src]], 0)            # [P, cap, D]
    recv = _all_to_all(send, axes)                                  # [P (source), cap, D]
    everyone = lax.all_gather(counts, axes)                         # [P, E]: who sends what
    mine = lax.dynamic_slice_in_dim(everyone, lax.axis_index(axes) * e_loc, e_loc, axis=1)
    ids = _ids_from_counts(mine, cap)                               # [P, cap]
    out = _local_experts(recv.reshape(ep * cap, -1), ids.reshape(-1), ffn)
    back = _all_to_all(out.reshape(ep, cap, -1), axes)              # [P (expert rank), cap, D]
    rank = sorted_experts // e_loc                                  # [N] rank of each sorted row
    return back[rank, jnp.arange(n) - first[rank]]                  # [N, D] sorted order


def _ragged_exchange(rows, counts, ffn, axes, cap):
    """Sorted rows [N, D] to their experts' ranks by ragged_all_to_all and back."""
    ep, e_loc = lax.axis_size(axes), ffn.local
    me = lax.axis_index(axes)
    everyone = lax.all_gather(counts, axes)                         # [P, E]
    sent = everyone.reshape(ep, ep, e_loc).sum(-1)                  # [source, dest] row counts
    exclusive = lambda a, axis: jnp.cumsum(a, axis=axis) - a
    send_sizes, recv_sizes = sent[me], sent[:, me]
    send_offsets, recv_offsets = exclusive(send_sizes, 0), exclusive(recv_sizes, 0)
    lands_at = exclusive(sent, 0)[me]             # where my rows start on each dest
    came_from = exclusive(sent, 1)[:, me]         # where each source's rows to me started
    recv = ragged_all_to_all(rows, jnp.zeros((ep * cap, rows.shape[1]), rows.dtype),
                             send_offsets, send_sizes, lands_at, recv_sizes, axis_name=axes)
    mine = lax.dynamic_slice_in_dim(everyone, me * e_loc, e_loc, axis=1).reshape(-1)
    which = jnp.searchsorted(jnp.cumsum(mine), jnp.arange(ep * cap), side="right")
    ids = jnp.where(which < ep * e_loc, which % e_loc, e_loc)
    out = _local_experts(recv, ids, ffn)
    return ragged_all_to_all(out, jnp.zeros_like(rows), recv_offsets, recv_sizes, came_from,
                             send_sizes, axis_name=axes)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name):
    """``jax.lax.ragged_all_to_all`` (a module attribute, so tests can stand in for it on CPU),
    its output named ``EXCHANGED``."""
    return checkpoint_name(lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                                 output_offsets, recv_sizes,
                                                 axis_name=axis_name), EXCHANGED)


def _all_to_all(x: jax.Array, axes) -> jax.Array:
    """Dim 0 of x [P, ...] exchanged over ``axes``; named ``EXCHANGED``: a backward
    that recomputes the layer (``rules.run_gathered``) keeps it rather than send it again."""
    return checkpoint_name(lax.all_to_all(x, axes, 0, 0), EXCHANGED)


def capacity(x: jax.Array, experts: jax.Array, ffn: ExpertWeights, capacity_factor: float,
             ep_axes: Axes = ()) -> tuple[jax.Array, jax.Array]:
    """Expert outputs [N, D] in assignment order (zero where dropped) and the number
    of dropped assignments, with C = ceil(capacity_factor * S * k / E) slots per expert."""
    s, k = experts.shape
    axes = tuple(ep_axes)
    ep = lax.axis_size(axes) if axes else 1
    e_loc = ffn.local
    n_experts = e_loc * ep
    cap = capacity_slots(s, k, n_experts, capacity_factor)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    counts = jnp.bincount(flat, length=n_experts)
    first = jnp.cumsum(counts) - counts
    rank = jnp.arange(flat.size) - first[sorted_experts]            # place in its expert's queue
    slot = jnp.arange(cap)
    src = jnp.clip(first[:, None] + slot, 0, flat.size - 1)         # [E, cap]
    slots = jnp.where((slot[None] < counts[:, None])[..., None], x[(order // k)[src]], 0)
    if ep > 1:
        recv = _all_to_all(slots.reshape(ep, e_loc, cap, -1), axes)
        slots = recv.swapaxes(0, 1).reshape(e_loc, ep * cap, -1)    # [E_loc, P*cap, D]
    out = ffn.batched(slots)
    if ep > 1:
        out = _all_to_all(out.reshape(e_loc, ep, cap, -1).swapaxes(0, 1), axes)
    out = out.reshape(n_experts, cap, -1)
    kept = rank < cap
    y = jnp.where(kept[:, None], out[sorted_experts, jnp.minimum(rank, cap - 1)], 0)
    return y[inverse_permutation(order)], (~kept).sum()


def capacity_slots(tokens: int, k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert for ``tokens`` tokens: ceil(capacity_factor * tokens * k / E)."""
    return max(1, math.ceil(capacity_factor * tokens * k / n_experts))
