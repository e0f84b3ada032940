"""The GPT decoder: embedding, L stacked blocks scanned in the forward pass, head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmegatron.models.config import GPTConfig
from jmegatron.models.layers import Block, embed_lookup, param, rms_norm
from jmegatron.sharding import rules as ax
from jmegatron.sharding.rules import constrain

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class GPT(nnx.Module):
    """Decoder-only Transformer; every block weight is stacked as [L, ...]."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab, cfg.d_model), (ax.VOCAB, ax.EMBED), cfg.init_std)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
        def stacked_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.blocks = stacked_blocks(rngs)
        self.final_norm = param(rngs, (cfg.d_model,), (ax.NORM,), None)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab), (ax.EMBED, ax.VOCAB), cfg.init_std)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits [B, T, V_padded] in fp32 for tokens [B, T]."""
        cfg = self.cfg
        x = embed_lookup(self.embed[...].astype(cfg.dtype), tokens)   # [B, T, D]
        x = self._run_blocks(x, jnp.arange(tokens.shape[1]))
        x = rms_norm(x, self.final_norm[...], cfg.norm_eps)
        head = self.embed[...].T if cfg.tie_embeddings else self.head[...]
        logits = jnp.einsum("btd,dv->btv", x, head.astype(cfg.dtype),
                            preferred_element_type=jnp.float32)
        return constrain(logits, (ax.BATCH, ax.SEQ, ax.ACT_VOCAB))

    def _run_blocks(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        graphdef, state = nnx.split(self.blocks)

        def one_layer(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions), None

        if self.cfg.remat != "none":
            one_layer = jax.checkpoint(one_layer, policy=_REMAT[self.cfg.remat])
        x, _ = jax.lax.scan(one_layer, x, state)
        return x
