"""The GPT decoder: embedding, L stacked blocks scanned in the forward pass, head."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jmegatron.models import context
from jmegatron.models.config import GPTConfig
from jmegatron.models.layers import Block, embed_lookup, param, rms_norm
from jmegatron.models.moe import STATS, MoEBlock
from jmegatron.models.products import weight_einsum
from jmegatron.sharding import rules as ax
from jmegatron.sharding.rules import constrain, logical_axes_of
from jmegatron.sharding.runners import Stack, active_runner, default_runner
from jmegatron.sharding.stacks import StackShape, stack_of

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": ax.dots_policy(batch_dims=True),
    "dots_no_batch": ax.dots_policy(),
}
LAYER_INPUT = "layer_input"   # each layer's input in a stack (``checkpoint_name``)


def kept_for_backward(remat: str):
    """The ``jax.checkpoint`` policy of what a pipeline chunk's forward keeps for its
    own backward (``sharding.own_backward``) under ``remat``: each layer's input and
    the MoE exchanges' outputs, and the products ``remat`` keeps, all of them under
    "none" (as "dots": the elementwise work is recomputed, and a weight's cast to
    the compute dtype, which would be a copy of the weights a microbatch)."""
    policies = jax.checkpoint_policies
    inner = ax.dots_policy(batch_dims=True) if remat == "none" else _REMAT[remat]
    return policies.save_from_both_policies(
        inner, policies.save_only_these_names(LAYER_INPUT, ax.EXCHANGED))


class Aux(NamedTuple):
    """What the forward reports besides the logits."""

    max_logit: jax.Array   # [L, N] largest pre-softmax attention logit per layer and
                           # query head over the batch (QK-clip's S)
    moe: dict              # MoE stats stacked [L_moe, ...] (moe.Stats); {} when dense


class GPT(nnx.Module):
    """Decoder-only Transformer; every block weight is stacked as [L, ...].

    Dense and MoE blocks sit in two stacks, ``blocks`` and ``moe_blocks``, each
    grouped [G, g, ...] when ``cfg.layer_group`` g > 1, or split into pipeline
    stages [S, L/S, ...] when ``cfg.stages`` S > 1. The padded vocabulary
    rows of the embedding and head start at zero (and stay there: the loss masks
    them). ``create_sharded(lambda: GPT(cfg, nnx.Rngs(0)), mesh)`` builds it
    sharded.

    Args:
      cfg: the model's ``GPTConfig``; its padded vocabulary (``cfg.vocab``) sizes
        the embedding and head.
      rngs: the random streams of the initialization (``rngs.params``).
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab, cfg.d_model), (ax.VOCAB, ax.EMBED), cfg.init_std,
                           cfg.dtype, cfg.weight_grad_dtype)
        zero_padding(self.embed, cfg.vocab_size, axis=0)

        def stacked(make: type[nnx.Module], n: int) -> nnx.Module:
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
            def stack(rngs: nnx.Rngs) -> nnx.Module:
                return make(cfg, rngs)
            return stack(rngs)

        if cfg.dense_layers:   # MoE blocks stack apart from dense ones
            self.blocks = stacked(Block, cfg.dense_layers)
            split_stack(self.blocks, cfg)
        if cfg.dense_layers < cfg.n_layers:
            self.moe_blocks = stacked(MoEBlock, cfg.n_layers - cfg.dense_layers)
            split_stack(self.moe_blocks, cfg)
        self.final_norm = param(rngs, (cfg.d_model,), (ax.NORM,), None)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab), (ax.EMBED, ax.VOCAB), cfg.init_std,
                              cfg.dtype, cfg.weight_grad_dtype)
            zero_padding(self.head, cfg.vocab_size, axis=1)

    def __call__(self, tokens: jax.Array, return_aux: bool = False, positions=None):
        """Logits [B, T, V_padded] in fp32 for tokens [B, T].

        Args:
          tokens: [B, T] token ids.
          return_aux: also return the ``Aux`` (largest attention logits, MoE stats).
          positions: [T] the tokens' positions in their sequence: where a context axis
            splits it, those of ``context.sequence_order``, by which the tokens were
            dealt (``context.deal``); None: 0..T-1.

        Returns:
          The logits, or with ``return_aux`` (logits, ``Aux``).
        """
        if positions is None:
            positions = self._whole_sequence_positions(tokens.shape[1])
        x = self.embed_tokens(tokens)
        x, aux = self._run_layers(x, jnp.asarray(positions))
        logits = self.logits_of(x)
        return (logits, aux) if return_aux else logits

    def _whole_sequence_positions(self, t: int) -> np.ndarray:
        """0..T-1, where no live mesh axis splits the sequence; else ValueError: the
        caller must deal the tokens (``__call__``'s ``positions``)."""
        if context.active_sequence_axis():
            raise ValueError("the sequence is split over a context axis: deal the tokens by "
                             "context.sequence_order and pass it as positions")
        return np.arange(t)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The embeddings [B, T, D] (compute dtype) of tokens [B, T]: with gradients in a
        wider dtype (``cfg.weight_grad_dtype``) looked up in the table's and then cast,
        so the table's gradient accumulates in it."""
        cfg = self.cfg
        if cfg.weight_grad_dtype is None:
            return embed_lookup(self.embed[...].astype(cfg.dtype), tokens)
        return embed_lookup(self.embed[...], tokens, cfg.dtype)

    def logits_of(self, x: jax.Array) -> jax.Array:
        """The last layer's output [B, T, D] -> logits [B, T, V_padded] in fp32 (the
        final norm, then the head)."""
        cfg = self.cfg
        x = rms_norm(x, self.final_norm[...], cfg.norm_eps)
        head = self.embed[...].T if cfg.tie_embeddings else self.head[...]
        logits = weight_einsum("btd,dv->btv", x, head, cfg.weight_grad_dtype,
                               preferred_element_type=jnp.float32)
        return constrain(logits, (ax.BATCH, ax.SEQ, ax.ACT_VOCAB))

    def _run_layers(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, "Aux"]:
        """Dense and MoE layers in model order: each run of consecutive layers of one
        kind runs its slice of that kind's stack."""
        start, max_logits, moe_stats = {False: 0, True: 0}, [], []
        for moe, run in itertools.groupby(self.cfg.moe_layers):
            n = len(list(run))
            x, stats = self._run_stack(moe, x, positions, start[moe], n)
            start[moe] += n
            max_logits.append(stats.pop("max_logit"))   # [n, B, N]
            if moe:
                moe_stats.append(stats)
        concat = lambda parts: jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
        # Reduced over the batch last: one (max) all-reduce of [L, N] when it is split.
        return x, Aux(concat(max_logits).max(axis=1), concat(moe_stats) if moe_stats else {})

    def _run_stack(self, moe: bool, x: jax.Array, positions: jax.Array,
                   start: int, n: int):
        """Layers start..start+n of one stack, run by the layout's runner (or this
        model's default one): (x, their stats stacked [n, ...])."""
        cfg = self.cfg
        runner = active_runner() or default_runner(cfg.layer_group, cfg.prefetch,
                                                   cfg.keep_gathered, cfg.stages)
        return runner(self.layer_stack(moe, positions, start, n), x)

    def layer_stack(self, moe: bool, positions: jax.Array, start: int = 0,
                    n: int | None = None) -> Stack:
        """Layers start..start+n (None: to the end) of the MoE or the dense stack, as
        a runner runs them (``sharding.runners.Stack``)."""
        cfg = self.cfg
        graphdef, state = nnx.split(self.moe_blocks if moe else self.blocks)

        def one_layer(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions)

        if cfg.remat != "none":
            one_layer = jax.checkpoint(one_layer, policy=_REMAT[cfg.remat])
        named = lambda x, layer_state: one_layer(checkpoint_name(x, LAYER_INPUT), layer_state)
        layers = cfg.n_layers - cfg.dense_layers if moe else cfg.dense_layers
        return Stack(named, state, start, layers - start if n is None else n,
                     STATS if moe else (), self_sharded=moe)


def _is_variable(v) -> bool:
    return isinstance(v, nnx.Variable)


def zero_padding(var: nnx.Param, vocab_size: int, axis: int) -> None:
    """Zeros the padded vocabulary entries. The loss masks them, so they get no
    gradient and stay zero: inert, and lost by no checkpoint that drops them."""
    value = var[...]
    keep = jnp.arange(value.shape[axis]) < vocab_size
    var.set_value(jnp.where(jnp.expand_dims(keep, 1 - axis), value, 0.0))
    if value.shape[axis] != vocab_size:   # the codec drops the padding in checkpoints
        var.set_metadata(real_vocab=vocab_size)


def split_stack(blocks: nnx.Module, cfg: GPTConfig) -> None:
    """Stacks the weights of ``blocks`` as the layout runs them (``sharding.stacks``):
    in ``cfg.stages`` pipeline stages, in owner groups of ``cfg.layer_group``, both,
    or [L, ...] for neither."""
    layers = jax.tree.leaves(nnx.state(blocks))[0].shape[0]
    dims, outer = [], []
    if cfg.stages > 1:
        dims, outer = [cfg.stages], [ax.STAGES]
    per_stage = StackShape(layers, (cfg.stages,), True, cfg.repeats).per_stage
    if cfg.layer_group > 1:   # each of a stage's chunks (one without repeats) in groups
        groups = cfg.repeats * -(-per_stage // cfg.repeats // cfg.layer_group)
        dims, outer = dims + [groups], outer + [ax.LAYER_GROUPS]
    if dims:
        last = cfg.layer_group if cfg.layer_group > 1 else per_stage
        stack_layers(blocks, StackShape(layers, (*dims, last), cfg.stages > 1, cfg.repeats),
                     tuple(outer))


def stack_layers(blocks: nnx.Module, stack: StackShape, outer: tuple[str, ...]) -> None:
    """Reshapes every stacked [L, ...] weight of ``blocks`` to [*stack.dims, ...] in
    place (the outer dims named ``outer``), with zero padding layers: the same
    values, so a canonical checkpoint is a reshape and a slice away. The owner
    runner skips padding in a last group; a pipeline stage runs its padding
    layers, which zero weights make the identity with zero gradients (every
    projection is zero: attention and MLP add nothing, and nothing flows back
    into them)."""
    for _, var in nnx.iter_graph(blocks):
        if isinstance(var, nnx.Variable):
            var.set_value(stack.to_live(var[...]))
            var.set_metadata(out_sharding=(*outer, *logical_axes_of(var)),
                             real_layers=stack.layers)
            if stack.repeats > 1:
                var.set_metadata(repeats=stack.repeats)


def real_layers(var) -> int | None:
    """The layers a grouped [G, g, ...] variable holds before its padding (None:
    not grouped)."""
    return var.get_metadata().get("real_layers") if hasattr(var, "get_metadata") else None


def grouped_layers(params) -> dict[str, int]:
    """Path (``keystr``) -> real layers, for every grouped variable of ``params``."""
    return {jax.tree_util.keystr(path): real_layers(v)
            for path, v in jax.tree.leaves_with_path(params, is_leaf=_is_variable)
            if _is_variable(v) and real_layers(v) is not None}


def ungroup(params: nnx.State) -> nnx.State:
    """Block weights back to [L, ...] from [G, g, ...], padding dropped (other
    leaves unchanged)."""
    def flat(v):
        stack = stack_of(v)
        if stack is None:
            return v
        out = v.replace(stack.to_canonical(v[...]),
                        out_sharding=logical_axes_of(v)[len(stack.dims) - 1:])
        out.del_metadata("real_layers")
        if "repeats" in out.get_metadata():
            out.del_metadata("repeats")
        return out
    return jax.tree.map(flat, params, is_leaf=_is_variable)
