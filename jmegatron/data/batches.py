"""Deterministic, resumable batches of token windows, sharded over the data axes.

The batch of step s is a pure function of (seed, s): B windows of T+1
tokens at offsets drawn by a counter-based generator keyed on both. Resuming
at step k therefore needs nothing but k, and each process reads only the
rows its own devices hold.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from jmegatron.data.corpus import DataError

_EVAL_STREAM = 1 << 40   # offsets the eval windows' keys away from any train step


def require_window(n_tokens: int, seq_len: int, what: str = "the split") -> None:
    """A stream must hold at least one window of seq_len + 1 tokens."""
    if n_tokens < seq_len + 1:
        raise DataError(f"seq_len={seq_len} needs at least {seq_len + 1} tokens, but "
                        f"{what} has only {n_tokens}")


def window_offsets(n_tokens: int, batch_size: int, seq_len: int, seed: int,
                   step: int) -> np.ndarray:
    """Start offsets [B] of the windows of one step."""
    require_window(n_tokens, seq_len)
    rng = np.random.Generator(np.random.Philox(key=[seed, step]))
    return rng.integers(0, n_tokens - seq_len, size=batch_size)


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The contiguous block of batch rows held by this process's devices."""
    blocks = {(rows.start or 0, shape[0] if rows.stop is None else rows.stop)
              for rows, *_ in sharding.addressable_devices_indices_map(shape).values()}
    lo, hi = min(b[0] for b in blocks), max(b[1] for b in blocks)
    if sum(stop - start for start, stop in blocks) != hi - lo:
        raise ValueError(f"this process's batch rows {sorted(blocks)} are not one block; "
                         "order the mesh devices process by process")
    return slice(lo, hi)


def make_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int,
               sharding: NamedSharding | None = None) -> jax.Array | np.ndarray:
    """Token windows [B, T+1] (int32) of ``step``; a global array when ``sharding`` is given."""
    offsets = window_offsets(len(tokens), batch_size, seq_len, seed, step)
    if sharding is None:
        return np.stack([tokens[o:o + seq_len + 1] for o in offsets]).astype(np.int32)
    shape = (batch_size, seq_len + 1)
    rows = local_rows(sharding, shape)
    local = np.stack([tokens[o:o + seq_len + 1] for o in offsets[rows]]).astype(np.int32)
    return jax.make_array_from_process_local_data(sharding, local, shape)


def eval_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, index: int,
               sharding: NamedSharding | None = None) -> jax.Array | np.ndarray:
    """The ``index``-th fixed evaluation batch (the same at every evaluation)."""
    return make_batch(tokens, batch_size, seq_len, seed, _EVAL_STREAM + index, sharding)
