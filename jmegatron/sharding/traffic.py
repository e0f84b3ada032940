"""What a layout sends per step, as ``--layout auto`` models it: the pieces each
layout's ``traffic`` is built from (``sharding.layouts``), and what it is told of
one trained leaf (``LeafTraffic``) and of how the stacks run (``RunOptions``).
``optim.auto_layout`` fills them in from a model's params and times the result."""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple


class Transfer(NamedTuple):
    """One collective a layout runs (``analysis.cost_model.CollectiveLike``)."""

    kind: str
    axes: tuple[str, ...]
    group_size: int
    executions: int
    bytes_per_device: float   # per execution


class LeafTraffic(NamedTuple):
    """What the traffic model needs of one trained leaf under one layout."""

    elements: int           # the whole leaf
    local: float            # elements a device stores
    gathered: tuple         # live ZeRO-3 mesh axes the leaf is split over (gathered to use)
    reduced: tuple          # live batch axes holding copies (gradients summed over them)
    sizes: Mapping[str, int]
    master: int             # bytes per element as stored (fp32 masters: 4)
    wire: int               # bytes per element in the compute dtype (gathers)
    summed: int             # bytes per element of its gradient's sums (grad_dtype_of)
    layers: int             # leading stack of layers (1: none)
    matrix_flops: float     # the optimizer's FLOPs on the whole leaf (0: not a matrix)
    owners: int             # ranks its matrices are dealt to (1: every rank runs them all)
    masters_on_owners: bool = False   # layerwise: stored on its owners, gathered to compute

    def size(self, axes) -> int:
        return math.prod(self.sizes[a] for a in axes)

    @property
    def padding(self) -> float:
        """A stack dealt to its owners in whole rounds: padded slots over real layers."""
        return self.groups * self.owners / self.layers

    @property
    def groups(self) -> int:
        """Rounds of ``owners`` layers (owner: the groups the stack is gathered in)."""
        return -(-self.layers // self.owners)

    @property
    def used(self) -> float:
        """Elements a device computes with: the stored part gathered over ZeRO-3 (and
        over its owners, for masters kept there)."""
        return self.local * self.size(self.gathered) * (self.owners if self.masters_on_owners
                                                        else 1)


class RunOptions(NamedTuple):
    """The owner runner's options a candidate is modelled with (``GPTConfig``)."""

    keep_gathered: bool = False
    prefetch: bool = False
    manual: bool = True   # the runner's own shard_map (else XLA's sharding constraints)


def ring(kind: str, axes: tuple, leaf: LeafTraffic, elements: float, width: int,
         executions: int) -> list[Transfer]:
    """A ring collective of ``elements`` (the whole, per device) over ``axes``."""
    n = leaf.size(axes)
    if n <= 1:
        return []
    factor = 2 if kind == "all-reduce" else 1
    return [Transfer(kind, axes, n, executions, factor * (n - 1) / n * elements * width
                     / executions)]


def all_reduced(leaf: LeafTraffic) -> list[Transfer]:
    """Each layer's gradients summed over the ranks holding copies (data parallelism)."""
    return ring("all-reduce", leaf.reduced, leaf, leaf.used, leaf.summed, leaf.layers)


def sharded(leaf: LeafTraffic, gathers: int, launches: int, used: float) -> list[Transfer]:
    """ZeRO-3's traffic: ``gathers`` all-gathers and a reduce-scatter of ``used``
    elements over the ZeRO-3 group, ``launches`` each, then the shard's sum over the
    other batch axes."""
    g = leaf.gathered
    out = []
    for _ in range(gathers):
        out += ring("all-gather", g, leaf, used, leaf.wire, launches)
    out += ring("reduce-scatter", g, leaf, used, leaf.summed, launches)
    return out + ring("all-reduce", leaf.reduced, leaf, used / leaf.size(g), leaf.summed,
                      launches)
