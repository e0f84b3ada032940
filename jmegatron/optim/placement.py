"""Where each matrix's optimizer state lives and who orthogonalizes it, per layout.

The layout (``jmegatron.sharding.layouts``) fixes the sharding of params and
of each matrix stack's state. The stack axis is the first batch axis of the
matrix view (layers). Under ``layerwise`` it is padded to a multiple of the
n owners, reordered round-robin (matrix i to rank i mod n) and split over
them, so each rank holds and orthogonalizes whole matrices of its own; under
``owner`` the params themselves are split that way; under ``fsdp`` the state
is split element-wise and Newton-Schulz gathers whole matrices first; under
``replicated`` everyone does everything.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.optim.owners import assign, load_report, ns_cost, rank_loads
from jmegatron.optim.routing import MATRIX, LeafRoute, batch_axes
from jmegatron.sharding.layouts import Layout, make_layout
from jmegatron.sharding.rules import DEFAULT_RULES, LAYER_GROUPS, Rules


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

    @property
    def blocks(self) -> P:
        """Sharding of per-matrix state [*stack, k, k] (SOAP's factors): the
        stack split like ``state``, each matrix whole."""
        return P(*self.stack, None, None)

    def for_blocks(self) -> "Placement":
        """This placement for per-matrix state, whose stack axis leads."""
        return dataclasses.replace(self, param=self.blocks, state=self.blocks, stack_axis=0)

    def pad(self, x: jax.Array) -> jax.Array:
        """The stack padded and reordered for round-robin ownership that continues
        across stacks: matrix i of this stack goes to rank (offset + i) mod n, and
        rank r's slice holds its matrices in order, then padding."""
        if self.owners == 1:
            return x
        a, n = self.stack_axis, self.owners
        widths = [(0, 0)] * x.ndim
        widths[a] = (self.offset, self.padded - self.length - self.offset)
        x = jnp.pad(x, widths)
        split = x.reshape(x.shape[:a] + (self.padded // n, n) + x.shape[a + 1:])
        return jnp.swapaxes(split, a, a + 1).reshape(x.shape)

    def unpad(self, x: jax.Array) -> jax.Array:
        if self.owners == 1:
            return x
        a, n = self.stack_axis, self.owners
        split = x.reshape(x.shape[:a] + (n, self.padded // n) + x.shape[a + 1:])
        x = jnp.swapaxes(split, a, a + 1).reshape(x.shape)
        return jax.lax.slice_in_dim(x, self.offset, self.offset + self.length, axis=a)


def place(leaf: LeafRoute, layout: Layout, offset: int = 0) -> Placement:
    """The placement of a matrix leaf (with logical axes) under ``layout``; its
    stack's first matrix goes to rank ``offset`` under layerwise."""
    logical = leaf.logical or (None,) * len(leaf.shape)
    if layout.name == "owner" and layout.owners > 1 and logical[0] != LAYER_GROUPS:
        raise ValueError(f"the owner layout needs block weights stacked [L/f, f, ...], but "
                         f"{leaf.path} has logical axes {logical}: build the model with "
                         f"GPTConfig(layer_group={layout.layer_group})")
    batch = batch_axes(leaf.route.spec, len(leaf.shape))
    state = _full(layout.state_spec(logical, batch), len(leaf.shape))
    stack_axis = batch[0] if batch else None
    length = leaf.shape[stack_axis] if batch else 1
    owners = layout.owners if layout.name == "layerwise" and batch else 1
    offset %= owners
    padded = -(-(length + offset) // owners) * owners
    return Placement(_full(layout.param_spec(logical), len(leaf.shape)), state,
                     tuple(state[a] for a in batch), stack_axis, length, padded, owners, offset,
                     logical[0] == LAYER_GROUPS)


def place_all(leaves: list[LeafRoute], layout: Layout) -> list[Placement | None]:
    """Placements of the matrix leaves in order (None for the others), with
    round-robin ownership continuing from one stack to the next."""
    out, seen = [], 0
    for leaf in leaves:
        if leaf.route.kind != MATRIX or leaf.logical is None:
            out.append(None)
            continue
        out.append(place(leaf, layout, seen))
        seen += out[-1].length
    return out


def resolve_layout(layout: Layout | str | None, mesh: jax.sharding.Mesh,
                   rules: Rules = DEFAULT_RULES) -> Layout:
    """A Layout, by name (built on ``rules`` for ``mesh``) or as given; default fsdp."""
    if isinstance(layout, Layout):
        return layout
    return make_layout(layout or "fsdp", mesh.shape, rules)


def matrix_placements(leaves: list[LeafRoute], mesh: jax.sharding.Mesh | None,
                      layout: Layout | str | None, rules: Rules) -> list[Placement | None]:
    """``place_all`` under the resolved layout; all None without a mesh."""
    if mesh is None:
        return [None] * len(leaves)
    return place_all(leaves, resolve_layout(layout, mesh, rules))


def ownership_report(leaves: list[LeafRoute], layout: Layout) -> str:
    """Who owns which whole matrices under ``layout`` (layerwise, owner): per-rank
    Newton-Schulz load, imbalance, what LPT would give, and padding."""
    if layout.owners == 1:
        return f"{layout.name}: no rank owns whole matrices"
    costs, owner, padding = [], [], 0
    for leaf, where in zip(leaves, place_all(leaves, layout)):
        if where is None:
            continue
        # Owner stacks are [L/g, g, ...]: layer l = group * g + rank, owned by l mod g.
        slots = where.length * (layout.layer_group if layout.name == "owner" else 1)
        per_slot = sum(p.count * ns_cost(p.fan_in, p.fan_out)
                       for p in leaf.route.spec.pieces(leaf.shape)) / slots
        costs += [per_slot] * slots
        owner += [(where.offset + i) % layout.owners for i in range(slots)]
        padding += where.padded - where.length
    balanced = assign(costs, layout.owners, "balanced")
    lpt = max(rank_loads(costs, balanced, layout.owners)) / (sum(costs) / layout.owners)
    return (f"{layout.name} over {layout.owners} ranks, round-robin: "
            f"{load_report(costs, owner, layout.owners)} | LPT would give {lpt:.3f} | "
            f"padding {padding} of {len(costs)} matrices ({100 * padding / len(costs):.0f}%)")


def _full(spec: P, ndim: int) -> P:
    return P(*(tuple(spec) + (None,) * (ndim - len(spec))))


def constrain_to(x: jax.Array, mesh: jax.sharding.Mesh, spec: P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
