"""Which optimizer each parameter gets, and how a matrix optimizer sees it.

Hidden matrices (and stacked [L, ...] or per-expert [L, E, ...] batches of
them) go to the matrix optimizer (Muon, SOAP); embeddings, the output head,
norms, biases and the MoE router go to AdamW. Decisions come from the
parameter's logical axes when it carries jmegatron's (see
``jmegatron.sharding.rules``), otherwise from its path and shape. A leaf no
rule matches is an error.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmegatron.sharding import rules as ax
from jmegatron.sharding.rules import DEFAULT_RULES, logical_axes_of

MATRIX, ADAMW = "matrix", "adamw"
# Logical axes that stack matrices (each index is a matrix of its own), and those that
# do too in per-head mode.
STACK_AXES = (ax.STAGES, ax.LAYER_GROUPS, ax.LAYERS, ax.EXPERTS)
HEAD_AXES = (ax.HEADS, ax.KV_HEADS, ax.QKV)
KNOWN_AXES = frozenset(name for name, _ in DEFAULT_RULES)
_ADAMW_NAME = re.compile(r"(^|[_.])(embed\w*|wte|wpe|lm_head|head|unembed\w*|\w*norm\w*|ln_\w+|"
                         r"bias|\w+_bias|scale)$")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One block of a leaf orthogonalized on its own: ``count`` matrices fan_in x fan_out.

    Attributes:
      name: the block's name ("q", "k", "v", "gate", "up"; "" for a leaf not split).
      count: the matrices of this block in the leaf (the product of its batch dims).
      fan_in: each matrix's rows (the product of the spec's ``in_axes``).
      fan_out: each matrix's columns (the product of its ``out_axes``).
    """

    name: str
    count: int
    fan_in: int
    fan_out: int


@dataclasses.dataclass(frozen=True)
class MatrixSpec:
    """A leaf seen as a batch of matrices, optionally cut into blocks.

    Axes not in ``in_axes``/``out_axes`` are batch axes; an optional
    ``split_axis`` cuts the leaf into blocks (Q, K, V of a fused QKV weight) that
    are orthogonalized separately.

    Attributes:
      in_axes: the leaf's axes merged, in order, into each matrix's rows (fan_in).
      out_axes: the axes merged into its columns (fan_out).
      split_axis: the axis cut into blocks; None: one block.
      split_sizes: the blocks' sizes along ``split_axis`` (a fused QKV weight:
        (G, 1, 1) for its G query slots, the key and the value).
      split_names: the blocks' names, one per size.
    """

    in_axes: tuple[int, ...]
    out_axes: tuple[int, ...]
    split_axis: int | None = None
    split_sizes: tuple[int, ...] = ()
    split_names: tuple[str, ...] = ()

    def parts(self, x: jax.Array) -> list[jax.Array]:
        if self.split_axis is None:
            return [x]
        cuts = [sum(self.split_sizes[:i]) for i in range(1, len(self.split_sizes))]
        return jnp.split(x, cuts, axis=self.split_axis)

    def pieces(self, shape: tuple[int, ...]) -> list[Piece]:
        """The blocks of a leaf of ``shape`` with their matrix sizes."""
        sizes = self.split_sizes or (None,)
        names = self.split_names or ("",)
        out = []
        for name, size in zip(names, sizes):
            part = list(shape)
            if size is not None:
                part[self.split_axis] = size
            fan_in = math.prod(part[a] for a in self.in_axes)
            fan_out = math.prod(part[a] for a in self.out_axes)
            out.append(Piece(name, math.prod(part) // (fan_in * fan_out), fan_in, fan_out))
        return out


def to_matrices(x: jax.Array, spec: MatrixSpec) -> list[jax.Array]:
    """The blocks of ``x`` as stacks [*batch, fan_in, fan_out].

    The batch dims keep their order (``batch_axes``) and are not merged, so a
    batch dim split over devices stays split the same way.

    Args:
      x: a leaf (or an array shaped like one).
      spec: its ``MatrixSpec``.

    Returns:
      One stack per block, in the spec's order.
    """
    order = batch_axes(spec, x.ndim) + spec.in_axes + spec.out_axes
    stacks = []
    for part in spec.parts(x):
        moved = part.transpose(order)
        fan_in = math.prod(part.shape[a] for a in spec.in_axes)
        fan_out = math.prod(part.shape[a] for a in spec.out_axes)
        n_batch = x.ndim - len(spec.in_axes) - len(spec.out_axes)
        stacks.append(moved.reshape(moved.shape[:n_batch] + (fan_in, fan_out)))
    return stacks


def from_matrices(stacks: list[jax.Array], spec: MatrixSpec, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of ``to_matrices``: the leaf of ``shape`` the blocks came from.

    Args:
      stacks: one stack [*batch, fan_in, fan_out] per block, as ``to_matrices``
        gives them.
      spec: the leaf's ``MatrixSpec``.
      shape: the leaf's shape.

    Returns:
      The leaf, of ``shape``.
    """
    order = batch_axes(spec, len(shape)) + spec.in_axes + spec.out_axes
    sizes = spec.split_sizes or (None,)
    outs = []
    for stack, size in zip(stacks, sizes):
        part = list(shape)
        if size is not None:
            part[spec.split_axis] = size
        moved = stack.reshape([part[a] for a in order])
        outs.append(moved.transpose(_inverse(order)))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=spec.split_axis)


def map_matrices(fn: Callable[[jax.Array, int, int], jax.Array], x: jax.Array,
                 spec: MatrixSpec) -> jax.Array:
    """Applies ``fn(stack [*batch, fan_in, fan_out], fan_in, fan_out)`` to every block.

    Args:
      fn: maps a block's stack and its fans to a stack of the same shape.
      x: the leaf.
      spec: its ``MatrixSpec``.

    Returns:
      The leaf of x's shape made of ``fn``'s blocks.
    """
    outs = [fn(stack, *stack.shape[-2:]) for stack in to_matrices(x, spec)]
    return from_matrices(outs, spec, x.shape)


def batch_axes(spec: MatrixSpec, ndim: int) -> tuple[int, ...]:
    """The axes of a leaf that stack independent matrices, in order."""
    return tuple(a for a in range(ndim) if a not in spec.in_axes + spec.out_axes)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


@dataclasses.dataclass(frozen=True)
class Route:
    """The decision for one leaf: ADAMW, or MATRIX with its spec; ``rule`` says why.

    Attributes:
      kind: ``MATRIX`` ("matrix") or ``ADAMW`` ("adamw").
      rule: the rule that decided, in words (for reports and errors).
      spec: the leaf's ``MatrixSpec`` when it is a matrix; None for AdamW.
    """

    kind: str
    rule: str
    spec: MatrixSpec | None = None


@dataclasses.dataclass(frozen=True)
class Routing:
    """Routing options: which optimizer each leaf gets, and its matrix view.

    Attributes:
      split_qkv: orthogonalize Q, K and V of a fused QKV weight separately (and
        gate and up of a fused SwiGLU weight); read from logical axes.
      per_head: orthogonalize each attention head's block on its own (the head
        and QKV slot axes become batch axes).
      router: where an MoE router (a leaf with "router" in its path) goes:
        "adamw" or "matrix".
      custom: ``custom(path, shape, logical_axes) -> Route | None``, tried first;
        None falls through to the built-in rules. ``logical_axes`` is None for
        plain arrays and for axis names jmegatron does not know.
    """

    split_qkv: bool = True
    per_head: bool = False
    router: str = ADAMW
    custom: Callable[[str, tuple[int, ...], tuple | None], Route | None] | None = None

    def route(self, path: str, shape: tuple[int, ...], logical: tuple | None) -> Route:
        if logical is not None and not set(filter(None, logical)) <= KNOWN_AXES:
            logical = None   # someone else's axis names: decide by name and shape
        if self.custom is not None:
            decision = self.custom(path, shape, logical)
            if decision is not None:
                return decision
        for rule in (_vector, _router, _logical, _by_name_and_shape):
            decision = rule(self, path, shape, logical)
            if decision is not None:
                return decision
        raise ValueError(f"no routing rule matches {path} (shape {shape}, logical axes "
                         f"{logical}); pass Routing(custom=...) to decide it, or give the "
                         "optimizer a plan (jmegatron.optim.make_plan) made from params "
                         "that carry logical axes")


def _vector(opts, path, shape, logical) -> Route | None:
    return Route(ADAMW, "scalar or vector") if len(shape) < 2 else None


def _router(opts, path, shape, logical) -> Route | None:
    if "router" not in path.lower():
        return None
    if opts.router == ADAMW:
        return Route(ADAMW, "MoE router")
    return Route(MATRIX, "MoE router", MatrixSpec((len(shape) - 2,), (len(shape) - 1,)))


def _logical(opts, path, shape, logical) -> Route | None:
    """jmegatron params: [batch..., embed, out...] or [batch..., in..., embed]."""
    if logical is None:
        return None
    if ax.VOCAB in logical:
        return Route(ADAMW, "embedding or output head (vocab axis)")
    if ax.NORM in logical:
        return Route(ADAMW, "norm scale")
    if ax.EMBED not in logical:
        return Route(ADAMW, "bias (no embed axis)")
    stacked = set(STACK_AXES) | (set(HEAD_AXES) if opts.per_head else set())
    rest = [i for i, name in enumerate(logical) if name not in stacked]
    if len(rest) < 2 or ax.EMBED not in (logical[rest[0]], logical[rest[-1]]):
        return None
    if logical[rest[0]] == ax.EMBED:
        in_axes, out_axes = (rest[0],), tuple(rest[1:])
    else:
        in_axes, out_axes = tuple(rest[:-1]), (rest[-1],)
    split = _split(logical, shape) if opts.split_qkv else None
    spec = MatrixSpec(in_axes, out_axes, *split) if split else MatrixSpec(in_axes, out_axes)
    return Route(MATRIX, "hidden matrix (logical axes)", spec)


def _split(logical, shape):
    if ax.QKV in logical:
        axis = logical.index(ax.QKV)
        return axis, (shape[axis] - 2, 1, 1), ("q", "k", "v")
    if ax.GLU in logical:
        axis = logical.index(ax.GLU)
        return axis, (1, 1), ("gate", "up")
    return None


def _by_name_and_shape(opts, path, shape, logical) -> Route | None:
    """Plain pytrees: named embeddings, heads, norms and biases go to AdamW;
    other 2-D leaves are matrices [fan_in, fan_out]."""
    if logical is not None:
        return None
    keys = [k for k in re.split(r"[\[\]'\"./]+", path) if k and k != "value"]
    if any(_ADAMW_NAME.search(k) for k in keys[-2:]):   # the leaf or its module
        return Route(ADAMW, "embedding, head, norm or bias (by name)")
    if len(shape) == 2:
        return Route(MATRIX, "2-D matrix", MatrixSpec((0,), (1,)))
    return None


class LeafRoute(NamedTuple):
    """A leaf's path, shape, logical axes (None for plain arrays) and Route.

    Attributes:
      path: the leaf's ``jax.tree_util.keystr`` path, without ".value".
      shape: the leaf's shape.
      logical: its logical axes; None for a plain array.
      route: its ``Route``; None when it is not trained (not an ``nnx.Param``).
    """

    path: str
    shape: tuple[int, ...]
    logical: tuple | None
    route: Route


def _is_annotated(node) -> bool:
    return hasattr(node, "get_metadata")   # a Flax variable


def is_trained(node) -> bool:
    """What an optimizer trains: nnx.Param variables and plain arrays (other
    variables, such as the MoE expert bias, are set by the train step)."""
    return isinstance(node, nnx.Param) or not isinstance(node, nnx.Variable)


def routed(path, node, routing: Routing) -> LeafRoute:
    """The LeafRoute of one leaf (or Flax variable) at ``path``; its route is None
    when it is not trained (``is_trained``)."""
    name = jax.tree_util.keystr(path).removesuffix(".value")
    if len(jax.tree.leaves(node)) != 1:
        raise ValueError(f"{name} holds {len(jax.tree.leaves(node))} arrays, expected 1")
    logical = logical_axes_of(node)
    shape = tuple(jnp.shape(jax.tree.leaves(node)[0]))
    return LeafRoute(name, shape, logical,
                     routing.route(name, shape, logical) if is_trained(node) else None)


def leaf_routes(tree, routing: Routing = Routing()) -> list[LeafRoute]:
    """The LeafRoute of every trained leaf of ``tree``, in ``jax.tree.leaves`` order.

    The plan (``jmegatron.optim.plan``) keeps them with the rest of each leaf.

    Args:
      tree: the params: arrays (decided by path and shape) or Flax variables
        (by their logical axes); variables that are not ``nnx.Param`` are skipped.
      routing: the ``Routing`` options.

    Returns:
      A list of ``LeafRoute``.
    """
    leaves = [routed(path, node, routing)
              for path, node in jax.tree.leaves_with_path(tree, is_leaf=_is_annotated)]
    return [leaf for leaf in leaves if leaf.route is not None]


def route(params, routing: Routing = Routing()):
    """A tree of Routes (a prefix of ``params``: one per leaf or Flax variable).

    Args:
      params: the trained params (``trainable_params``): arrays or ``nnx.Param``
        variables.
      routing: the ``Routing`` options.

    Returns:
      ``params``' structure with a ``Route`` per leaf.
    """
    treedef = jax.tree.structure(params, is_leaf=_is_annotated)
    return treedef.unflatten([leaf.route for leaf in leaf_routes(params, routing)])


def labels(params, routing: Routing = Routing(), matrix_label: str = "muon"):
    """``optax.partition`` labels: ``matrix_label`` or "adamw" per leaf.

    Args:
      params: the trained params, as for ``route``.
      routing: the ``Routing`` options.
      matrix_label: the label of the matrix leaves.

    Returns:
      ``params``' structure with a label per leaf.
    """
    return jax.tree.map(lambda r: matrix_label if r.kind == MATRIX else ADAMW,
                        route(params, routing), is_leaf=lambda r: isinstance(r, Route))


def describe(params, routing: Routing = Routing(), matrix_name: str = "muon",
             block_note: Callable[[LeafRoute, Piece], str] | None = None) -> str:
    """A table: every leaf with its optimizer, matrix blocks and batch axes.

    Args:
      params: the params (real or abstract; only shapes and logical axes are read).
      routing: the ``Routing`` options.
      matrix_name: the matrix optimizer's name in the "optimizer" column.
      block_note: ``block_note(leaf, piece) -> str`` appended to each block
        (e.g. its tensor-parallel mode); None: no note.

    Returns:
      The table, one line per trained leaf under a header.
    """
    return describe_leaves(leaf_routes(params, routing), matrix_name, block_note)


def describe_leaves(leaves: list[LeafRoute], matrix_name: str = "muon",
                    block_note: Callable[[LeafRoute, Piece], str] | None = None) -> str:
    rows = [("leaf", "shape", "optimizer", "matrices", "batch axes", "rule")]
    for leaf in leaves:
        name, shape, logical, r = leaf
        if r.kind != MATRIX:
            rows.append((name, str(shape), ADAMW, "-", "-", r.rule))
            continue
        blocks = ", ".join(
            f"{p.name + ': ' if p.name else ''}{p.count} x [{p.fan_in}, {p.fan_out}]"
            + (f" {block_note(leaf, p)}" if block_note else "") for p in r.spec.pieces(shape))
        names = [logical[i] if logical else str(i) for i in batch_axes(r.spec, len(shape))]
        rows.append((name, str(shape), matrix_name, blocks, ",".join(names) or "-", r.rule))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


MatrixFlops = Callable[[int, int], float]   # (fan_in, fan_out) -> FLOPs of one matrix's step


def flops_over_matrices(params, routing: Routing, per_matrix: MatrixFlops) -> int:
    """``per_matrix(fan_in, fan_out)`` summed over every block of ``params`` (an int)."""
    total = 0
    for piece in matrix_pieces(params, routing):
        total += piece.count * per_matrix(piece.fan_in, piece.fan_out)
    return int(total)


def matrix_pieces(params, routing: Routing = Routing()) -> list[Piece]:
    """Every block the matrix optimizer orthogonalizes (for FLOP counts).

    Args:
      params: the params (real or abstract; only shapes and logical axes are read).
      routing: the ``Routing`` options.

    Returns:
      A list of ``Piece``, per matrix leaf in order.
    """
    return [p for leaf in leaf_routes(params, routing) if leaf.route.kind == MATRIX
            for p in leaf.route.spec.pieces(leaf.shape)]
