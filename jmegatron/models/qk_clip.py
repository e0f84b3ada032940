"""QK-clip (MuonClip): after each optimizer step, every attention head whose largest
pre-softmax logit S in the step's batch exceeded tau has its query and key
weights rescaled so that logit becomes at most tau.

With one key per query head (multi-head attention) this is the Kimi K2 rule:
eta = tau / S, W_q *= eta^alpha, W_k *= eta^(1 - alpha). With grouped-query
attention a key head is shared by the G query heads of its group, and one
scale of the key acts on all of them. The rule here:

  eta_j = min(1, tau / S_j)                 for each query head j,
  W_k of group k  *= (min_{j in k} eta_j)^(1 - alpha)   (its strongest clip),
  W_q of head j   *= eta_j^alpha.

Head j's logit then scales by eta_j^alpha * (min eta)^(1 - alpha) <= eta_j, so
every head ends at or under tau and the group's strongest head exactly at tau.
Nothing is ever scaled up, and a head under tau keeps its query weights
bitwise (it only sees a clipped group's smaller key). The alternatives either
move unclipped heads' query weights up to compensate (the logits of heads
under tau stay put, but weights grow by 1/(min eta)^(1 - alpha)) or clip every
head of a group by the group's maximum (the "group max" rule of some Megatron
forks), which shrinks healthy heads' queries too. K2's own MLA choice for its
shared rotary key, leaving it alone and putting the whole clip on the queries,
is this rule at alpha = 1. Values are never scaled.

The weights are the fused QKV weight [..., D, K, G + 2, H] of each stack (its
G query slots, then the key, then the value), and its bias when the model has
one (Qwen2), so each query and key scales whole; the scale is elementwise over
its layer, head and slot axes, so it runs where each weight shard lives, under
any layout and tensor split, with no communication.

References:
  Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv:2507.20534, 2025
    (MuonClip, section 2.1).
"""

from __future__ import annotations

import itertools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jmegatron.models.config import GPTConfig
from jmegatron.sharding.stacks import stack_of

# Where the fused QKV weights sit in the model's params: (stack, is MoE).
_STACKS = (("blocks", False), ("moe_blocks", True))
_QKV = ("attn", "qkv")
_QKV_BIAS = ("attn", "qkv_bias")   # [..., K, G + 2, H]: q = x W_q + b_q scales with both

# clip(trained params, max_logit [L, N]) -> (params, {"qk_clipped_heads": count})
Clip = Callable[[nnx.State, jax.Array], tuple[nnx.State, dict[str, jax.Array]]]


def clip_scales(max_logit: jax.Array, n_kv_heads: int, tau: float,
                alpha: float = 0.5) -> tuple[jax.Array, jax.Array]:
    """Per-layer scales of the query heads [L, N] and the key heads [L, K].

    The module docstring's rule, for the largest logits ``max_logit`` [L, N]
    (query head n in key group n // (N/K)).

    Args:
      max_logit: the largest pre-softmax logit per layer and query head.
      n_kv_heads: key/value heads K.
      tau: the threshold (> 0).
      alpha: the share of each clip put on the queries (0..1).

    Returns:
      (eta^alpha [L, N], (min eta of each group)^(1 - alpha) [L, K]), all <= 1.
    """
    eta = jnp.where(max_logit > tau, tau / max_logit, 1.0)          # [L, N], <= 1
    layers, heads = max_logit.shape
    strongest = eta.reshape(layers, n_kv_heads, heads // n_kv_heads).min(axis=-1)
    return eta ** alpha, strongest ** (1.0 - alpha)


def qkv_scale(max_logit: jax.Array, cfg: GPTConfig, tau: float, alpha: float) -> jax.Array:
    """The factor of each (layer, key head, slot) of the fused QKV weight,
    [L, K, G + 2]: the query scales, the key's, 1 for the value."""
    q, k = clip_scales(max_logit, cfg.n_kv_heads, tau, alpha)
    layers = max_logit.shape[0]
    q = q.reshape(layers, cfg.n_kv_heads, cfg.group_size)
    return jnp.concatenate([q, k[..., None], jnp.ones_like(k)[..., None]], axis=-1)


def qk_clip(params: nnx.State, max_logit: jax.Array, cfg: GPTConfig, tau: float,
            alpha: float = 0.5) -> nnx.State:
    """QK-clip: ``params`` with every layer's QKV weight clipped for its largest logits.

    ``params`` is the model's, or its trained part; ``max_logit`` [L, N] has the
    layers in model order, as ``GPT(..., return_aux=True)`` reports them. The QKV
    bias scales with its weight; other leaves are unchanged.

    Call it after the optimizer update, with the logits of the step's forward,
    as ``make_train_step`` does with ``--qk-clip``.

    Args:
      params: an ``nnx.State`` holding the stacks ``blocks`` / ``moe_blocks``
        (stacked [L, ...] or grouped [G, g, ...]).
      max_logit: [L, N] from the step's forward, over its whole batch.
      cfg: the model's configuration.
      tau: the threshold (> 0).
      alpha: the share of each clip put on the queries (K2: 0.5).

    Returns:
      ``params`` with the QKV weights (and biases) rescaled.
    """
    scales = {}
    for stack, moe in _STACKS:
        # The stack's layers, by static slices of model-order runs (a gather here
        # would have XLA move rows between devices).
        rows, start = [], 0
        for is_moe, run in itertools.groupby(cfg.moe_layers):
            n = len(list(run))
            if is_moe == moe:
                rows.append(max_logit[start:start + n])
            start += n
        if rows:
            scales[stack] = qkv_scale(jnp.concatenate(rows), cfg, tau, alpha)

    def clip(path, var):
        names = tuple(getattr(key, "key", None) for key in path)
        if names[1:] not in (_QKV, _QKV_BIAS) or names[0] not in scales:
            return var
        embed_axes = int(names[1:] == _QKV)
        return var.replace(var[...] * _per_slot(scales[names[0]], var, embed_axes))

    return jax.tree_util.tree_map_with_path(
        clip, params, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _per_slot(scale: jax.Array, var: nnx.Variable, embed_axes: int = 1) -> jax.Array:
    """[L, K, G + 2] scales broadcast against a QKV weight [L, D, K, G + 2, H] (or
    its bias [L, K, G + 2, H]: ``embed_axes=0``), stacked as the variable declares
    (groups, stages, circular chunks: ``sharding.stacks``; a padding slot holds a
    zero weight, whatever its scale)."""
    stack = stack_of(var)
    scale = scale if stack is None else stack.to_live(scale)
    return scale.reshape(*scale.shape[:-2], *(1,) * embed_axes, *scale.shape[-2:], 1)


def qk_clipper(cfg: GPTConfig, tau: float, alpha: float = 0.5) -> Clip:
    """The train step's QK-clip, ``clip(trained params, max_logit [L, N])``.

    Args:
      cfg: the model's configuration; QK-norm (``cfg.qk_norm``) is refused, since
        it undoes the rescaling.
      tau: the threshold on the pre-softmax logits q . k / sqrt(H) (> 0).
      alpha: the share of each clip put on the queries, in [0, 1] (K2: 0.5).

    Returns:
      ``clip``, giving (params clipped by ``qk_clip``, {"qk_clipped_heads": the
      number of query heads over tau, summed over layers}).
    """
    if cfg.qk_norm:
        raise ValueError("qk-clip rescales W_q and W_k, which QK-norm undoes (it normalizes "
                         "each query and key); use one or the other")
    if not tau > 0 or not 0 <= alpha <= 1:
        raise ValueError(f"qk-clip needs tau > 0 and 0 <= alpha <= 1, got {tau}, {alpha}")

    def clip(params, max_logit):
        count = jnp.sum(max_logit > tau, dtype=jnp.float32)   # joins the metrics' all-reduce
        return qk_clip(params, max_logit, cfg, tau, alpha), {"qk_clipped_heads": count}
    return clip
