"""Cross-entropy over a padded vocabulary, dense or vocab-parallel.

The vocab-parallel form (Megatron-LM, Shoeybi et al. 2019) runs in
``jax.shard_map``: each device holds logits [B/dp, T, V/tp] and only
[B/dp, T]-sized statistics cross devices (the max, the sum of exponentials
and the target logit), so the [B, T, V] logits are never gathered.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jmegatron.sharding import nested, rules as ax
from jmegatron.sharding.rules import Rules, logical_to_spec, spec_axes

_NEG = jnp.finfo(jnp.float32).min   # logit of a padded vocabulary entry


class TokenLoss(NamedTuple):
    """Per-token cross-entropy and log-partition (for the z-loss), both [B, T].

    Attributes:
      nll: the cross-entropy log Z - logit[target], fp32.
      log_z: the log-partition log Z, the logsumexp of the logits over the real
        vocabulary, fp32.
    """

    nll: jax.Array
    log_z: jax.Array


def _mask_padding(logits: jax.Array, first_id: jax.Array | int, vocab_size: int) -> jax.Array:
    ids = first_id + jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_size, logits, _NEG)


def dense_token_loss(logits: jax.Array, targets: jax.Array, vocab_size: int) -> TokenLoss:
    """Cross-entropy of logits [B, T, V_padded] (fp32) against targets [B, T].

    Args:
      logits: [B, T, V_padded], any float dtype (computed in fp32).
      targets: [B, T] token ids, each below ``vocab_size``.
      vocab_size: the real vocabulary; logits of the padded ids past it are
        masked out.

    Returns:
      The ``TokenLoss``.
    """
    logits = _mask_padding(logits.astype(jnp.float32), 0, vocab_size)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return TokenLoss(log_z - target, log_z)


def vocab_parallel_token_loss(logits: jax.Array, targets: jax.Array, vocab_size: int,
                              mesh: jax.sharding.Mesh, rules: Rules) -> TokenLoss:
    """``dense_token_loss`` for logits sharded over the vocabulary.

    In ``jax.shard_map`` (module docstring); ``dense_token_loss`` when no mesh axis
    of size > 1 splits the vocabulary.

    Args:
      logits: [B, T, V_padded], sharded as ``rules`` place (batch, seq,
        act_vocab).
      targets: [B, T] token ids, each below ``vocab_size``, sharded as (batch,
        seq).
      vocab_size: the real vocabulary; logits of the padded ids past it are
        masked out.
      mesh: the device mesh.
      rules: the logical-to-mesh axis rules.

    Returns:
      The ``TokenLoss``, sharded as (batch, seq).
    """
    logits_spec = logical_to_spec((ax.BATCH, ax.SEQ, ax.ACT_VOCAB), rules)
    token_spec = logical_to_spec((ax.BATCH, ax.SEQ), rules)
    # The axes the vocabulary is really split over in the spec (the batch takes precedence).
    vocab_axes = tuple(a for a in spec_axes(logits_spec[2]) if mesh.shape[a] > 1)
    if not vocab_axes:
        return dense_token_loss(logits, targets, vocab_size)

    def local(logits_block, targets_block):   # [B/dp, T, V/tp], [B/dp, T]
        v_local = logits_block.shape[-1]
        first_id = lax.axis_index(vocab_axes) * v_local
        logits_block = _mask_padding(logits_block.astype(jnp.float32), first_id, vocab_size)
        # The max only stabilizes the exponentials; it cancels in the gradient.
        peak = lax.pmax(lax.stop_gradient(logits_block.max(axis=-1)), vocab_axes)
        sum_exp = lax.psum(jnp.exp(logits_block - peak[..., None]).sum(axis=-1), vocab_axes)
        local_target = targets_block - first_id
        here = (local_target >= 0) & (local_target < v_local)
        picked = jnp.take_along_axis(
            logits_block, jnp.clip(local_target, 0, v_local - 1)[..., None], axis=-1)[..., 0]
        target = lax.psum(jnp.where(here, picked, 0.0), vocab_axes)
        log_z = jnp.log(sum_exp) + peak
        return TokenLoss(log_z - target, log_z)

    return nested.shard_map(local, mesh, (logits_spec, token_spec),
                            TokenLoss(token_spec, token_spec))(logits, targets)


def cross_entropy(logits: jax.Array, targets: jax.Array, vocab_size: int, *,
                  mask: jax.Array | None = None, z_loss: float = 0.0,
                  mesh: jax.sharding.Mesh | None = None,
                  rules: Rules | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token loss (plus ``z_loss * log(Z)^2``, PaLM) over unmasked tokens.

    With ``mesh`` and ``rules`` given, the vocab-parallel form is used
    whenever the vocabulary is sharded.

    Args:
      logits: [B, T, V_padded], any float dtype (computed in fp32).
      targets: [B, T] token ids, each below ``vocab_size``.
      vocab_size: the real vocabulary; logits of the padded ids past it are
        masked out.
      mask: [B, T] token weights, 1 where a token counts and 0 where not (cast to
        fp32); the means divide by max(sum of weights, 1). None: every token.
      z_loss: the weight of the z-loss mean(log(Z)^2); 0: reported, not added.
      mesh: the device mesh; with ``rules``, the vocab-parallel form. None: dense.
      rules: the logical-to-mesh axis rules; None: dense.

    Returns:
      (loss, {"nll": the mean cross-entropy, "z_loss": the mean log(Z)^2, not
      multiplied by ``z_loss``}).
    """
    if mesh is not None and rules is not None:
        per_token = vocab_parallel_token_loss(logits, targets, vocab_size, mesh, rules)
    else:
        per_token = dense_token_loss(logits, targets, vocab_size)
    weights = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    count = jnp.maximum(weights.sum(), 1.0)
    nll = (per_token.nll * weights).sum() / count
    z = (jnp.square(per_token.log_z) * weights).sum() / count
    return nll + z_loss * z, {"nll": nll, "z_loss": z}
