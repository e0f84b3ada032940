"""Text samples from the model: greedy and top-k, so a person can see what it learned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jmegatron.data import tokenizer
from jmegatron.models.config import GPTConfig
from jmegatron.sharding import rules as ax
from jmegatron.sharding.mesh import axis_size
from jmegatron.sharding.rules import (Rules, activation_sharding, axis_roles, logical_to_spec,
                                      mesh_axes_of, without_axes)


def make_sampler(graphdef: nnx.GraphDef, model_cfg: GPTConfig, mesh: jax.sharding.Mesh,
                 rules: Rules, top_k: int):
    """A jitted ``sample(params, tokens [R, seq_len], start, stop, key) -> tokens``
    that fills positions start..stop-1.

    Row 0 decodes greedily, the other rows sample from the top-k logits. Each
    new token reruns the whole window (no KV cache: samples are short and rare), on
    each rank of a context axis whole (``whole_sequences``).
    """
    rules = whole_sequences(rules)

    def pick(logits, key):                       # [R, V]
        logits = jnp.where(jnp.arange(logits.shape[-1]) < model_cfg.vocab_size, logits, -jnp.inf)
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        sampled = jax.random.categorical(key, jnp.where(logits < kth, -jnp.inf, logits))
        return jnp.where(jnp.arange(logits.shape[0]) == 0, jnp.argmax(logits, -1), sampled)

    def sample(params, tokens, start, stop, key):
        model = nnx.merge(graphdef, params)

        def write_next(i, tokens):
            with activation_sharding(mesh, rules):
                logits = model(tokens)[:, i - 1]
            return tokens.at[:, i].set(pick(logits, jax.random.fold_in(key, i)))

        return jax.lax.fori_loop(start, stop, write_next, tokens)

    return jax.jit(sample)


def whole_sequences(rules: Rules) -> Rules:
    """``rules`` with the sequence split over no mesh axis: a context axis's ranks then
    each run the sampled windows whole (they read the logits at one position)."""
    return without_axes(rules, axis_roles(rules).sequence, (ax.SEQ,))


def sample_texts(sampler, params, prompt: str, n_tokens: int, seq_len: int,
                 mesh: jax.sharding.Mesh, rules: Rules, seed: int,
                 tok=tokenizer.Bytes()) -> tuple[str, str]:
    """(greedy, top-k) continuations of ``prompt``, encoded and decoded by ``tok``."""
    shards = axis_size(mesh, mesh_axes_of(ax.BATCH, rules))
    rows = shards * -(-2 // shards)          # at least 2 rows, whole data shards
    # Training documents are separated by EOS, so EOS is how a document begins.
    prompt_ids = np.concatenate([[tok.eos], tok.encode(prompt)])[-(seq_len - 1):]
    end = min(len(prompt_ids) + n_tokens, seq_len)
    window = np.full((rows, seq_len), tok.pad, np.int32)
    window[:, :len(prompt_ids)] = prompt_ids
    # Rows over the batch ranks, each window whole (the sampler runs whole sequences).
    window = jax.device_put(window, NamedSharding(mesh, logical_to_spec((ax.BATCH, None), rules)))
    out = sampler(params, window, len(prompt_ids), end, jax.random.key(seed))
    out = multihost_utils.process_allgather(out, tiled=True)   # rows of every process
    texts = [prompt + tok.decode(row[len(prompt_ids):end]) for row in out[:2]]
    return texts[0], texts[-1]
