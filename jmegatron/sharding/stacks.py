"""Where each of a stack's L layers sits in its live form [*dims, ...].

  [L, ...]          as it is (no ``StackShape``)
  [G, g, ...]       owner groups: the layers in order, the last group padded
  [S, L/S, ...]     pipeline stages: S contiguous parts of ceil(L / S) layers,
                    the last padded
  [S, G, g, ...]    both: each stage's ceil(L / S) layers in owner groups, each
                    stage padded to G * g slots
  [S, V * c, ...]   circular pipeline stages of V repeats: S * V chunks of
                    c = ceil(L / (S * V)) layers, chunk j on stage j % S as its
                    repeat j // S (stage s holds chunks s, S + s, 2S + s, ...);
                    the last chunks padded
  [S, V * Gc, g, ...]  both: each chunk in Gc = ceil(c / g) owner groups

Padding slots hold zero layers. The model builds its stacks with ``to_live``,
the codec between live and canonical (checkpoint) form uses both directions,
and the runners read which slots are real.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.sharding.rules import LAYER_GROUPS, STAGES, logical_axes_of


@dataclasses.dataclass(frozen=True)
class StackShape:
    """L layers in a live stack of leading dims ``dims``; ``staged``: dims[0] is
    pipeline stages (each stage padded on its own), else the layers fill the
    slots in order."""

    layers: int
    dims: tuple[int, ...]
    staged: bool = False
    repeats: int = 1    # V chunks per stage, interleaved (circular pipelines)

    @property
    def per_stage(self) -> int:
        """Layer slots a stage fills (all L without stages; V * c when circular)."""
        if not self.staged:
            return self.layers
        return self.repeats * -(-self.layers // (self.dims[0] * self.repeats))

    @property
    def slots(self) -> int:
        """Slots of one stage (of the whole stack without stages)."""
        return math.prod(self.dims[1:] if self.staged else self.dims)

    def to_live(self, x: jax.Array, xp=jnp) -> jax.Array:
        """[L, ...] -> [*dims, ...], zero padding layers where no layer sits (``xp``:
        the array module, numpy for static tables)."""
        rest = x.shape[1:]
        pad = lambda a, dim, length: xp.pad(a, [(0, 0)] * dim + [(0, length - a.shape[dim])]
                                            + [(0, 0)] * (a.ndim - dim - 1))
        if self.staged:   # [S, V, c] chunks, each padded to its share of a stage's slots
            stages, per, v = self.dims[0], self.per_stage, self.repeats
            x = xp.swapaxes(pad(x, 0, stages * per).reshape(v, stages, per // v, *rest), 0, 1)
            return pad(x, 2, self.slots // v).reshape(*self.dims, *rest)
        return pad(x, 0, self.slots).reshape(*self.dims, *rest)

    def to_canonical(self, x: jax.Array) -> jax.Array:
        """[*dims, ...] -> [L, ...], the padding dropped."""
        rest = x.shape[len(self.dims):]
        if self.staged:
            stages, per, v = self.dims[0], self.per_stage, self.repeats
            x = x.reshape(stages, v, self.slots // v, *rest)[:, :, :per // v].swapaxes(0, 1)
        return x.reshape(-1, *rest)[:self.layers]

    def layer_at(self) -> np.ndarray:
        """The layer each slot holds, shaped ``dims``; -1 for padding."""
        return self.to_live(np.arange(1, self.layers + 1), np) - 1

    def real(self) -> np.ndarray:
        """Which slots hold a layer, shaped ``dims``."""
        return self.layer_at() >= 0

    def slot_of(self, layer: int) -> tuple[int, ...]:
        """Where ``layer`` sits in ``dims``."""
        return tuple(int(i) for i in np.argwhere(self.layer_at() == layer)[0])

    def stage_layers(self) -> np.ndarray:
        """The real layers of each stage (one entry without stages)."""
        return self.real().reshape(self.dims[0] if self.staged else 1, -1).sum(axis=1)


def stack_shape(logical, shape, layers: int, repeats: int = 1) -> StackShape:
    """The ``StackShape`` of a stacked weight of ``layers`` real layers whose leading
    dims carry the logical axes ``stages``, ``layer_groups`` (either or both) and
    ``layers``; ``repeats``: V chunks per stage of a circular pipeline."""
    depth = 1 + sum(a in (STAGES, LAYER_GROUPS) for a in logical[:2])
    return StackShape(layers, tuple(shape[:depth]), logical[0] == STAGES, repeats)


def stack_of(var) -> StackShape | None:
    """The ``StackShape`` a stacked variable declares (its ``real_layers`` and
    ``repeats`` metadata, its logical axes and shape); None for a plain [L, ...] or
    unstacked one."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    if meta.get("real_layers") is None:
        return None
    return stack_shape(logical_axes_of(var), var.shape, meta["real_layers"],
                       meta.get("repeats", 1))
