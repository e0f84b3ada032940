"""Between a leaf as it lives on the mesh and its canonical (checkpoint) form.

The canonical form does not depend on the mesh or the layout: block weights
[L, ...] (not stacked [G, g, ...] or [S, L/S, ...] with padding layers), the vocabulary
unpadded, matrix-optimizer state in its parameter's shape (not padded and
reordered for layerwise owners). The plan (``jmegatron.optim.plan``) gives
every leaf of params and optimizer state its codec.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.optim.placement import Placement
from jmegatron.sharding.rules import spec_axes
from jmegatron.sharding.stacks import StackShape


@dataclasses.dataclass(frozen=True)
class LeafCodec:
    """How one live leaf maps to its canonical form (the default: unchanged)."""

    stack: StackShape | None = None     # a live stack [*dims, ...] <-> [L, ...] (None: [L, ...])
    vocab_dim: int | None = None        # padded vocabulary <-> the real one
    vocab: tuple[int, int] = (0, 0)     # (real, padded) vocabulary sizes
    placement: Placement | None = None  # layerwise matrix-optimizer state: the stack padded

    def encode(self, x: jax.Array) -> jax.Array:
        if self.placement is not None:
            x = self.placement.unpad(x)
        if self.stack is not None:
            x = self.stack.to_canonical(x)
        if self.vocab_dim is not None:
            x = jax.lax.slice_in_dim(x, 0, self.vocab[0], axis=self.vocab_dim)
        return x

    def decode(self, x: jax.Array) -> jax.Array:
        if self.vocab_dim is not None:
            widths = [(0, 0)] * x.ndim
            widths[self.vocab_dim] = (0, self.vocab[1] - self.vocab[0])
            x = jnp.pad(x, widths)
        if self.stack is not None:
            x = self.stack.to_live(x)
        if self.placement is not None:
            x = self.placement.pad(x)
        return x


def canonical_sharding(sharding: jax.sharding.Sharding, codec: LeafCodec,
                       shape: tuple) -> jax.sharding.Sharding:
    """Where a canonical leaf of ``shape`` is placed when loaded: its live split,
    merged for ungrouped layers, dropped where the canonical size does not divide."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    depth = 1 if codec.stack is None else len(codec.stack.dims)
    spec = list(sharding.spec) + [None] * (len(shape) + depth - 1 - len(sharding.spec))
    if depth > 1:
        spec = [sum((spec_axes(e) for e in spec[:depth]), ()) or None] + spec[depth:]
    mesh = sharding.mesh
    size = lambda entry: int(np.prod([mesh.shape[a] for a in spec_axes(entry)]))
    spec = [entry if entry is not None and shape[i] % size(entry) == 0 else None
            for i, entry in enumerate(spec[:len(shape)])]
    return NamedSharding(mesh, P(*spec))
