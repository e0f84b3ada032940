"""The GPT decoder: embedding, L stacked blocks scanned in the forward pass, head."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from jmegatron.models.config import GPTConfig
from jmegatron.models.layers import Block, embed_lookup, param, rms_norm
from jmegatron.models.moe import MoEBlock
from jmegatron.sharding import rules as ax
from jmegatron.sharding.rules import constrain, logical_axes_of, run_gathered

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class GPT(nnx.Module):
    """Decoder-only Transformer; every block weight is stacked as [L, ...] (dense and
    MoE blocks in two stacks, ``blocks`` and ``moe_blocks``)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab, cfg.d_model), (ax.VOCAB, ax.EMBED), cfg.init_std)
        zero_padding(self.embed, cfg.vocab_size, axis=0)

        def stacked(make: type[nnx.Module], n: int) -> nnx.Module:
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
            def stack(rngs: nnx.Rngs) -> nnx.Module:
                return make(cfg, rngs)
            return stack(rngs)

        n_moe = sum(cfg.moe_layers)   # MoE blocks stack apart from dense ones
        if n_moe < cfg.n_layers:
            self.blocks = stacked(Block, cfg.n_layers - n_moe)
            if cfg.layer_group > 1:
                group_layers(self.blocks, cfg.layer_group)
        if n_moe:
            self.moe_blocks = stacked(MoEBlock, n_moe)
        self.final_norm = param(rngs, (cfg.d_model,), (ax.NORM,), None)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab), (ax.EMBED, ax.VOCAB), cfg.init_std)
            zero_padding(self.head, cfg.vocab_size, axis=1)

    def __call__(self, tokens: jax.Array, return_aux: bool = False):
        """Logits [B, T, V_padded] in fp32 for tokens [B, T]; with ``return_aux``,
        (logits, MoE stats stacked [L_moe, ...], empty for a dense model)."""
        cfg = self.cfg
        x = embed_lookup(self.embed[...].astype(cfg.dtype), tokens)   # [B, T, D]
        positions = jnp.arange(tokens.shape[1])
        if any(cfg.moe_layers):
            x, stats = self._run_mixed(x, positions)
        else:
            x, stats = self._run_blocks(x, positions), {}
        x = rms_norm(x, self.final_norm[...], cfg.norm_eps)
        head = self.embed[...].T if cfg.tie_embeddings else self.head[...]
        logits = jnp.einsum("btd,dv->btv", x, head.astype(cfg.dtype),
                            preferred_element_type=jnp.float32)
        logits = constrain(logits, (ax.BATCH, ax.SEQ, ax.ACT_VOCAB))
        return (logits, stats) if return_aux else logits

    def _run_mixed(self, x: jax.Array, positions: jax.Array):
        """Dense and MoE layers in model order: each run of consecutive layers of one
        kind scans its slice of that kind's stack; MoE layers also give their stats."""
        start, stats = {False: 0, True: 0}, []
        for moe, run in itertools.groupby(self.cfg.moe_layers):
            n = len(list(run))
            graphdef, state = nnx.split(self.moe_blocks if moe else self.blocks)
            if n < jax.tree.leaves(state)[0].shape[0]:
                state = jax.tree.map(lambda a, i=start[moe]: a[i:i + n], state)
            start[moe] += n

            def one_layer(x, layer_state, graphdef=graphdef, moe=moe):
                out = nnx.merge(graphdef, layer_state)(x, positions)
                return out if moe else (out, None)

            if self.cfg.remat != "none":
                one_layer = jax.checkpoint(one_layer, policy=_REMAT[self.cfg.remat])
            x, layer_stats = jax.lax.scan(one_layer, x, state)
            if moe:
                stats.append(layer_stats)
        return x, jax.tree.map(lambda *a: jnp.concatenate(a), *stats)

    def _run_blocks(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        graphdef, state = nnx.split(self.blocks)

        def one_layer(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions), None

        if self.cfg.remat != "none":
            one_layer = jax.checkpoint(one_layer, policy=_REMAT[self.cfg.remat])
        if self.cfg.layer_group == 1:
            return jax.lax.scan(one_layer, x, state)[0]
        # [L/g, g, ...]: each step gathers one group of g whole layers (each kept on
        # its own rank under the owner layout), runs them, and moves on; the
        # backward gathers the group again and reduce-scatters its gradients back
        # to the owners.
        axes = [logical_axes_of(v)[1:] for v in
                jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))]
        treedef = jax.tree.structure(state)

        run_layers = lambda x, leaves: jax.lax.scan(one_layer, x, treedef.unflatten(leaves))[0]

        def one_group(x, group_state):
            return run_gathered(run_layers, x, jax.tree.leaves(group_state), axes, ax.LAYERS), None

        return jax.lax.scan(one_group, x, state)[0]


def zero_padding(var: nnx.Param, vocab_size: int, axis: int) -> None:
    """Zeros the padded vocabulary entries. The loss masks them, so they get no
    gradient and stay zero: inert, and lost by no checkpoint that drops them."""
    value = var[...]
    keep = jnp.arange(value.shape[axis]) < vocab_size
    var.set_value(jnp.where(jnp.expand_dims(keep, 1 - axis), value, 0.0))


def group_layers(blocks: nnx.Module, group: int) -> None:
    """Reshapes every stacked [L, ...] weight of ``blocks`` to [L/group, group, ...]
    in place (the same values: a canonical checkpoint is a reshape away)."""
    for _, var in nnx.iter_graph(blocks):
        if isinstance(var, nnx.Variable):
            value = var[...]
            var.set_value(value.reshape(value.shape[0] // group, group, *value.shape[1:]))
            var.set_metadata(out_sharding=(ax.LAYER_GROUPS, *logical_axes_of(var)))


def ungroup(params: nnx.State) -> nnx.State:
    """Block weights back to [L, ...] from [L/g, g, ...] (other leaves unchanged)."""
    def flat(v):
        axes = logical_axes_of(v)
        if not axes or axes[0] != ax.LAYER_GROUPS:
            return v
        value = v[...]
        return v.replace(value.reshape(-1, *value.shape[2:]), out_sharding=axes[1:])
    return jax.tree.map(flat, params, is_leaf=lambda v: isinstance(v, nnx.Variable))

