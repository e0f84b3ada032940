"""Where each matrix's optimizer state lives and who orthogonalizes it, per layout.

The layout (``jmegatron.sharding.layouts``) fixes the sharding of params and
of each matrix stack's state. The stack axis is the first batch axis of the
matrix view (layers). Under ``layerwise`` it is split over the n owners, so
each rank holds and orthogonalizes whole matrices of its own: in contiguous
blocks where n divides it (as any array is split, so the model can send the
gradients there directly: ``sharding.scatter``), else padded to a multiple
of n and reordered (matrix i to rank (offset + i) mod n, in slot i // n);
under ``owner`` the params themselves are split over the owners; under
``fsdp`` the state is split element-wise and Newton-Schulz gathers whole
matrices first; under ``replicated`` everyone does everything.

A stack split evenly gives every rank the same number of matrices; where the
owners do not divide it, each rank's last slot may be padding, which Muon's
Newton-Schulz skips (``real_slots``). Which ranks carry the padding of each
stack is the assignment: round-robin continues from one stack to the next;
balanced places the heaviest stacks first where they even the per-rank load
(``owners.stack_offsets``). ``ownership_report`` prints the loads.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jmegatron.optim.owners import assign, load_report, ns_cost, rank_loads, stack_offsets
from jmegatron.optim.routing import MATRIX, LeafRoute, MatrixFlops, batch_axes
from jmegatron.sharding.layouts import Layout
from jmegatron.sharding.rules import LAYER_GROUPS
from jmegatron.sharding.stacks import stack_shape


@dataclasses.dataclass(frozen=True)
class Placement:
    """One matrix leaf under a layout."""

    param: P                  # the param's sharding; updates leave with it
    state: P                  # momentum and Newton-Schulz input (stack padded)
    stack: tuple              # ``state`` entries of the batch axes, for the shard_map
    stack_axis: int | None    # leaf axis of the stack
    length: int               # stack length
    padded: int               # stack length with padding (layerwise)
    owners: int               # ranks the state's stack is split over (layerwise)
    offset: int = 0           # matrices of earlier stacks, mod owners (layerwise)
    grouped: bool = False     # stacked [L/g, g, ...] (owner layout)
    leads: bool = True        # the stack axis is the first of the matrices' stacking axes
                              # (not under pipeline stages, which come first)

    @property
    def dealt(self) -> bool:
        """Padded and dealt round-robin (the owners do not divide the stack);
        else split in contiguous blocks."""
        return self.owners > 1 and self.padded != self.length

    def owner_of(self, i: int) -> int:
        """The owner of matrix i of the stack."""
        if self.dealt:
            return (self.offset + i) % self.owners
        return i // (self.length // self.owners)

    @property
    def blocks(self) -> P:
        """Sharding of per-matrix state [*stack, k, k] (SOAP's factors): the
        stack split like ``state``, each matrix whole."""
        return P(*self.stack, None, None)

    def for_blocks(self) -> "Placement":
        """This placement for per-matrix state [*stack, k, k], whose stacking axes lead:
        the stack axis is the first of them, or the second after pipeline stages."""
        return dataclasses.replace(self, param=self.blocks, state=self.blocks,
                                   stack_axis=0 if self.leads else 1)

    def pad(self, x: jax.Array) -> jax.Array:
        """The stack as its owners hold it: unchanged where the n owners divide it,
        else padded and reordered rank-major: matrix i goes to rank (offset + i)
        mod n, in its slot i // n, so every rank holds ceil(length / n) slots (its
        matrices in order, then at most one padding)."""
        if not self.dealt:
            return x
        a, n = self.stack_axis, self.owners
        widths = [(0, 0)] * x.ndim
        widths[a] = (0, self.padded - self.length)
        x = jnp.pad(x, widths)
        rows = x.reshape(x.shape[:a] + (self.padded // n, n) + x.shape[a + 1:])
        rows = jnp.roll(rows, self.offset, axis=a + 1)            # slot (i // n, (offset + i) % n)
        return jnp.swapaxes(rows, a, a + 1).reshape(x.shape)       # rank-major

    def real_slots(self) -> np.ndarray | None:
        """Which entries of the padded stack (in ``pad``'s rank-major order) hold a
        matrix: all but at most each rank's last slot. None where the stack axis does
        not lead (pipeline stages come first): then the padding is computed (zeros
        give zeros)."""
        if not self.leads:
            return None
        n, rows = self.owners, self.padded // self.owners
        rank, slot = np.divmod(np.arange(self.padded), rows)
        return slot * n + (rank - self.offset) % n < self.length

    def unpad(self, x: jax.Array) -> jax.Array:
        if not self.dealt:
            return x
        a, n = self.stack_axis, self.owners
        ranks = x.reshape(x.shape[:a] + (n, self.padded // n) + x.shape[a + 1:])
        rows = jnp.roll(jnp.swapaxes(ranks, a, a + 1), -self.offset, axis=a + 1)
        return jax.lax.slice_in_dim(rows.reshape(x.shape), 0, self.length, axis=a)


def place(leaf: LeafRoute, layout: Layout) -> Placement:
    """The placement of a matrix leaf (with logical axes) under ``layout``, its
    stack's first matrix on rank 0 (``place_all`` sets offsets)."""
    logical = leaf.logical or (None,) * len(leaf.shape)
    layout.check_matrix(leaf.path, logical)
    batch = batch_axes(leaf.route.spec, len(leaf.shape))
    state = _full(layout.state_spec(logical, batch), len(leaf.shape))
    stack_axis = layout.stack_dim(logical, batch)
    length = leaf.shape[stack_axis] if batch else 1
    owners = layout.stack_owners(state, stack_axis) if batch else 1
    padded = -(-length // owners) * owners
    return Placement(_full(layout.param_spec(logical), len(leaf.shape)), state,
                     tuple(state[a] for a in batch), stack_axis, length, padded, owners, 0,
                     LAYER_GROUPS in logical[:2], not batch or stack_axis == batch[0])


def place_all(leaves: list[LeafRoute], layout: Layout,
              cost: MatrixFlops = ns_cost) -> list[Placement | None]:
    """Placements of the matrix leaves in order (None for the others), each
    stack's first owner set by ``layout.assignment`` (``owners.stack_offsets``,
    matrices weighed by ``cost``) among the stacks split over as many owners."""
    out = [None if leaf.route.kind != MATRIX or leaf.logical is None else place(leaf, layout)
           for leaf in leaves]
    for owners in {where.owners for where in out if where is not None}:
        mine = [i for i, where in enumerate(out) if where is not None and where.owners == owners]
        stacks = [(out[i].length, _matrix_cost(leaves[i], cost) / out[i].length) for i in mine]
        for i, offset in zip(mine, stack_offsets(stacks, owners, layout.assignment)):
            out[i] = dataclasses.replace(out[i], offset=offset)
    return out


def _matrix_cost(leaf: LeafRoute, cost: MatrixFlops) -> float:
    """The optimizer's cost of a whole leaf (every matrix of its stack)."""
    return sum(p.count * cost(p.fan_in, p.fan_out) for p in leaf.route.spec.pieces(leaf.shape))


def ownership_report(leaves: list[LeafRoute], layout: Layout,
                     layers: Callable[[str], int] | None = None,
                     cost: MatrixFlops = ns_cost) -> str:
    """Who owns which whole matrices under ``layout`` (layerwise, owner): per-rank
    load of real matrices by ``cost`` (the optimizer's FLOPs per matrix; Muon skips
    padding slots, so its step takes the heaviest rank's), its imbalance, what LPT
    over single matrices would give, the cost with padding computed (SOAP does),
    and the padding. ``layers(path)``: real layers of a grouped (owner) stack."""
    if layout.owners == 1:
        return f"{layout.name}: no rank owns whole matrices"
    n, costs, owner, padding, spmd = layout.owners, [], [], 0, 0.0
    for leaf, where in zip(leaves, place_all(leaves, layout, cost)):
        if where is None:
            continue
        per_stack = _matrix_cost(leaf, cost)
        if where.grouped:   # [(S,) G, g, ...]: group slot j on rank j, padding skipped
            real = layers(leaf.path) if layers else None
            stack = stack_shape(leaf.logical, leaf.shape, real or 0)
            mask = stack.real() if real else np.ones(stack.dims, bool)
            costs += [per_stack / mask.size] * int(mask.sum())
            owner += list(np.nonzero(mask)[-1])
            padding += int(mask.size - mask.sum())
            spmd += per_stack / n
            continue
        # Slot i on owner (offset + i) mod owners; a stack whose matrices are already
        # split over some owner axes (experts) shares each slot among `share` ranks.
        share = n // where.owners
        costs += [per_stack / (where.length * share)] * (where.length * share)
        owner += [where.owner_of(i) * share + t for i in range(where.length)
                  for t in range(share)]
        padding += (where.padded - where.length) * share
        spmd += per_stack / where.length * where.padded / n
    mean = sum(costs) / n
    lpt = max(rank_loads(costs, assign(costs, n, "balanced"), n)) / mean
    return (f"{layout.name} over {n} ranks, {layout.assignment}: {load_report(costs, owner, n)} | "
            f"LPT would give {lpt:.3f} | with padding computed (SOAP): {spmd / mean:.3f} "
            f"of the mean | padding {padding} of {len(costs)} slots "
            f"({100 * padding / len(costs):.0f}%)")


def _full(spec: P, ndim: int) -> P:
    return P(*(tuple(spec) + (None,) * (ndim - len(spec))))
