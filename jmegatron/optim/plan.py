"""The sharding plan: where every leaf lives, decided once, read by everyone.

``make_plan(abstract_params, mesh, layout, routing)`` runs before anything is
compiled. For each leaf of the params tree it records the logical axes, the
live shape, the param's sharding, the route (which optimizer, which matrix
blocks), the placement of a matrix leaf's optimizer state (owners, stack
padding; ``jmegatron.optim.placement``) and the codec between the live and
the canonical (checkpoint) form (``jmegatron.optim.codec``). The optimizers
take the plan as a static input, the train state and checkpoints place and
encode every leaf from it, and the routing and ownership reports print it.

Optimizer state is placed by tree structure: a subtree that mirrors the
params tree (optax's ``mu``, ``nu``; any wrapper's inner state) takes the
params' shardings, and the fields a matrix optimizer's state declares
(``matrix_state``) take the plan's state placement: ``HELD`` for arrays
shaped like the leaf as its owners hold it, ``BLOCKS`` for per-block state
(a tuple, one entry per matrix block, arrays ``[*stack, ...]``). Everything
else (counts, scalars) is replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.optim import auto_layout
from jmegatron.optim.codec import LeafCodec
from jmegatron.optim.owners import ns_cost
from jmegatron.optim.placement import Placement, ownership_report, place_all
from jmegatron.optim.routing import (ADAMW, MATRIX, LeafRoute, MatrixFlops, Route, Routing,
                                     describe_leaves,
                                     routed)
from jmegatron.sharding import rules as ax
from jmegatron.sharding.layouts import Layout, make_layout
from jmegatron.sharding.rules import DEFAULT_RULES, Rules
from jmegatron.sharding.stacks import stack_of

HELD, BLOCKS = "held", "blocks"
_STATE_FORMS: dict[type, dict[str, str]] = {}


def matrix_state(**forms: str) -> Callable[[type], type]:
    """Declares which fields of a matrix optimizer's state NamedTuple mirror the params.

    The plan places those fields (``ShardingPlan.state_shardings``); the other
    fields (the count) are replicated. Use as a class decorator.

    Args:
      **forms: field name -> ``HELD`` (arrays shaped like the leaf as its owners
        hold it) or ``BLOCKS`` (per leaf a tuple, one entry per matrix block,
        arrays [*stack, ...]).

    Returns:
      The decorator, which registers the class and returns it unchanged.
    """
    def register(cls: type) -> type:
        _STATE_FORMS[cls] = forms
        return cls
    return register


def state_forms(cls: type) -> dict[str, str]:
    """The forms ``matrix_state`` declared for ``cls``'s fields."""
    return _STATE_FORMS[cls]


class ModelCopy(NamedTuple):
    """The weights a model computes with, where they are not its params."""

    spec: P             # their sharding: whole over the owners
    dtype: jnp.dtype    # the dtype the leaf computes in


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Everything decided about one leaf.

    Attributes:
      path: the leaf's ``jax.tree_util.keystr`` path, without ".value".
      shape: the live shape (grouped stacks [G, g, ...], the padded vocabulary).
      logical: its logical axes; None for a plain array.
      route: its ``Route``; None when it is not trained (not an ``nnx.Param``).
      param: the param's PartitionSpec; None without a mesh.
      placement: a matrix leaf's state placement under the layout
        (``jmegatron.optim.placement.Placement``); None for the other leaves,
        without a mesh, and for plain arrays.
      codec: the ``LeafCodec`` between the live param (and params-shaped state)
        and its canonical (checkpoint) form.
      model: where the fp32 param lives on its owners (``Layout.masters_on_owners``),
        the copy the model computes with: its sharding and dtype; None: the param.
    """

    path: str
    shape: tuple[int, ...]            # live shape
    logical: tuple | None             # logical axes (None: a plain array)
    route: Route | None               # None: not trained (not an nnx.Param)
    param: P | None                   # the param's sharding (None without a mesh)
    placement: Placement | None       # a matrix leaf's state under the layout
    codec: LeafCodec                  # the param (and params-shaped state) <-> canonical
    model: ModelCopy | None = None    # the model's copy of a master on its owners

    @property
    def is_matrix(self) -> bool:
        return self.route is not None and self.route.kind == MATRIX

    @property
    def held(self) -> P | None:
        """Sharding of state held like the leaf (the stack padded under layerwise)."""
        return self.placement.state if self.placement is not None else self.param

    @property
    def held_codec(self) -> LeafCodec:
        return dataclasses.replace(self.codec, placement=self.placement)

    def blocks_spec(self, ndim: int) -> P | None:
        """Sharding of per-block state [*stack, ...] of ``ndim`` dims."""
        if self.placement is None:
            return None if self.param is None else P()
        return P(*self.placement.stack, *(None,) * (ndim - len(self.placement.stack)))

    @property
    def blocks_codec(self) -> LeafCodec:
        if self.placement is None:
            return LeafCodec()
        return LeafCodec(self.codec.stack, placement=self.placement.for_blocks())

    def as_route(self) -> LeafRoute:
        return LeafRoute(self.path, self.shape, self.logical, self.route)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The plan of one params tree (``make_plan``).

    Attributes:
      leaves: one ``LeafPlan`` per Flax variable or array, in tree order.
      treedef: the params' structure down to the variables.
      trained_treedef: the same of ``trainable_params(params)``.
      mesh: the mesh; None: no mesh.
      layout: the ``Layout``; None without a mesh.
      routing: the ``Routing`` the routes were made with.
      cost: a matrix's optimizer work, ``(fan_in, fan_out) -> FLOPs``, by which the
        balanced assignment spreads matrices over their owners.
    """

    leaves: tuple[LeafPlan, ...]
    treedef: Any                      # the params' structure down to the variables
    trained_treedef: Any              # the same of ``trainable_params(params)``
    mesh: jax.sharding.Mesh | None
    layout: Layout | None
    routing: Routing
    cost: MatrixFlops = ns_cost

    def split(self, tree) -> list:
        """The subtree of ``tree`` at each leaf (a variable, an array, or an empty
        node where a wrapper masked the leaf out). Raises ValueError naming a leaf
        the plan does not hold (an optimizer given the expert bias)."""
        try:
            return self.treedef.flatten_up_to(tree)
        except (ValueError, TypeError):
            raise ValueError(self._mismatch(tree)) from None

    def _mismatch(self, tree) -> str:
        """One line naming the first leaf of ``tree`` the plan lacks, or else the first
        the tree lacks, with its shape."""
        given = {jax.tree_util.keystr(path).removesuffix(".value"): node for path, node
                 in jax.tree.leaves_with_path(tree, is_leaf=_is_variable)}
        planned = {leaf.path: leaf.shape for leaf in self.leaves}
        extra = [path for path in given if path not in planned]
        if extra:
            arrays = jax.tree.leaves(given[extra[0]])   # a variable holds one array
            shape = tuple(getattr(arrays[0], "shape", ())) if arrays else ()
            return (f"the plan has no leaf {extra[0]} (shape {shape}): it is not trained (not "
                    "an nnx.Param) or not in the params the plan was made from; give the "
                    "optimizer trainable_params(params), or make the plan from these params")
        missing = [path for path in planned if path not in given]
        if missing:
            return (f"the params have no leaf {missing[0]}, which the plan has (shape "
                    f"{planned[missing[0]]}): the plan was made for other params; make it "
                    "from these (make_plan)")
        return ("the params' tree structure differs from the plan's (same leaf paths); "
                "make the plan from these params (make_plan)")

    def join(self, subtrees) -> Any:
        return self.treedef.unflatten(list(subtrees))

    def labels(self, matrix_label: str, params=None):
        """``optax.partition`` labels of ``params`` (checked against the plan):
        ``matrix_label`` or "adamw" per leaf."""
        if params is not None:
            self.split(params)
        untrained = [leaf.path for leaf in self.leaves if leaf.route is None]
        if untrained:
            raise ValueError(f"the optimizer got {untrained[0]}, which is not trained (not "
                             "an nnx.Param); give it trainable_params(params)")
        return self.join(matrix_label if leaf.is_matrix else ADAMW for leaf in self.leaves)

    def sharding(self, spec: P | None) -> NamedSharding | None:
        return None if self.mesh is None or spec is None else NamedSharding(self.mesh, spec)

    def for_optimizer(self) -> "ShardingPlan":
        """The plan of what an optimizer gets: the trained leaves (``trainable_params``)."""
        return dataclasses.replace(
            self, leaves=tuple(leaf for leaf in self.leaves if leaf.route is not None),
            treedef=self.trained_treedef)

    def param_shardings(self):
        return self.join(self.sharding(leaf.param) for leaf in self.leaves)

    def model_weights(self, params):
        """``params`` as the model computes with them: each master that lives on its
        owners (``LeafPlan.model``) cast to its compute dtype, then gathered (once a
        step: the train step calls this before its microbatches); the rest as is."""
        if not any(leaf.model for leaf in self.leaves):
            return params
        pin = lambda x, spec: jax.lax.with_sharding_constraint(x, self.sharding(spec))
        # Cast where the master lives (pinned there: XLA would gather fp32, then cast).
        copy = lambda leaf: lambda x: pin(pin(x.astype(leaf.model.dtype), leaf.param),
                                          leaf.model.spec)
        return self.join(sub if leaf.model is None else jax.tree.map(copy(leaf), sub)
                         for leaf, sub in zip(self.leaves, self.split(params)))

    def param_codecs(self, params):
        """A LeafCodec for every array of ``params`` (inside its variable)."""
        return self.join(jax.tree.map(lambda _: leaf.codec, sub)
                         for leaf, sub in zip(self.leaves, self.split(params)))

    def state_shardings(self, state):
        """A NamedSharding for every array of an optimizer state of this plan's
        (trained) params."""
        replicated = self.sharding(P())
        return self._follow(
            state, param=lambda leaf, x: self.sharding(leaf.param) if x.shape == leaf.shape
            else replicated, held=lambda leaf, x: self.sharding(leaf.held),
            blocks=lambda leaf, x: self.sharding(leaf.blocks_spec(len(x.shape))),
            other=lambda x: replicated)

    def state_codecs(self, state):
        """A LeafCodec for every array of an optimizer state of this plan's (trained)
        params."""
        return self._follow(
            state, param=lambda leaf, x: leaf.codec if x.shape == leaf.shape else LeafCodec(),
            held=lambda leaf, x: leaf.held_codec, blocks=lambda leaf, x: leaf.blocks_codec,
            other=lambda x: LeafCodec())

    def _follow(self, tree, *, param, held, blocks, other):
        """Maps every array of ``tree`` by where it lies: in a field a matrix state
        declares (``held``, ``blocks``), in a subtree mirroring the params (``param``),
        or elsewhere (``other``)."""
        plan = self.for_optimizer()   # optimizer state mirrors the trained params
        per_leaf = lambda fn, sub: [jax.tree.map(lambda x: fn(leaf, x), part)
                                    for leaf, part in zip(plan.leaves, plan.split(sub))]

        def walk(node):
            forms = _STATE_FORMS.get(type(node))
            if forms is not None:
                return type(node)(*(
                    plan.join(per_leaf({HELD: held, BLOCKS: blocks}[forms[name]], value))
                    if name in forms else walk(value)
                    for name, value in zip(node._fields, node)))
            if plan.treedef.num_nodes > 1:
                try:   # does ``node`` mirror the params? (a probe: no error message)
                    plan.treedef.flatten_up_to(node)
                except (ValueError, TypeError):
                    pass
                else:
                    return plan.join(per_leaf(param, node))
            children, treedef = jax.tree.flatten(node, is_leaf=lambda n: n is not node)
            if treedef.num_nodes == 1 and treedef.num_leaves == 1:   # an array
                return other(node)
            return treedef.unflatten([walk(child) for child in children])

        return walk(tree)

    def describe(self, matrix_name: str = "muon",
                 block_note: Callable | None = None) -> str:
        """Who gets which optimizer (``routing.describe``) and, under a layout that
        gives whole matrices to owners, who owns what."""
        table = describe_leaves([leaf.as_route() for leaf in self.leaves if leaf.route],
                                matrix_name, block_note)
        if self.layout is not None:
            table += "\n\n" + self.ownership()
        return table

    def ownership(self) -> str:
        leaves = [leaf.as_route() for leaf in self.leaves if leaf.route]
        layers = {leaf.path: leaf.codec.stack.layers for leaf in self.leaves
                  if leaf.codec.stack is not None}
        return ownership_report(leaves, self.layout, layers.get, self.cost)


def _is_variable(node) -> bool:
    return isinstance(node, nnx.Variable)


def trainable_params(params):
    """The part of ``params`` the optimizer gets.

    Args:
      params: an nnx.State (its ``nnx.Param`` variables are kept; the MoE expert
        bias and other variables are dropped) or any other tree (kept whole).

    Returns:
      The trained params.
    """
    return nnx.filter_state(params, nnx.Param) if isinstance(params, nnx.State) else params


def resolve_layout(layout: Layout | str | None, mesh: jax.sharding.Mesh,
                   rules: Rules = DEFAULT_RULES) -> Layout:
    """A Layout, by name (built on ``rules`` for ``mesh``) or as given; default fsdp."""
    if isinstance(layout, Layout):
        return layout
    return make_layout(layout or "fsdp", mesh.shape, rules)


def make_plan(params, mesh: jax.sharding.Mesh | None = None, layout: Layout | str | None = None,
              routing: Routing = Routing(), rules: Rules = DEFAULT_RULES,
              cost: MatrixFlops = ns_cost) -> ShardingPlan:
    """The plan of ``params`` on ``mesh`` under ``layout``, matrices found by ``routing``.

    Without a mesh: routes and codecs only.

    Args:
      params: the params, abstract or real, with logical axes where they are nnx
        variables; variables that are not ``nnx.Param`` get a plan with no route.
      mesh: the device mesh; None: no shardings or placements.
      layout: a ``Layout`` or "replicated", "layerwise", "fsdp" or "owner"; "auto":
        the one with the shortest modelled step among those ``params`` are stacked
        for (``auto_layout.choose``); None: "fsdp". Used only with a mesh.
      routing: the ``Routing`` options.
      rules: the logical-to-mesh axis rules a layout given by name is built on.
      cost: a matrix's optimizer work, ``(fan_in, fan_out) -> FLOPs``, which the
        balanced assignment evens over the owners (the registry's ``matrix_flops``
        of the run's optimizer); default Newton-Schulz's shape, max x min^2.

    Returns:
      The ``ShardingPlan``.
    """
    if mesh is not None and isinstance(layout, str) and layout == "auto":
        layout = auto_layout.choose(params, mesh, rules, cost, routing)
    layout = None if mesh is None else resolve_layout(layout, mesh, rules)
    flat, treedef = jax.tree.flatten_with_path(params, is_leaf=_is_variable)
    routes = [routed(path, node, routing) for path, node in flat]
    trained = [r for r in routes if r.route is not None]
    placements = iter(place_all(trained, layout, cost) if layout is not None
                      else [None] * len(trained))
    leaves = tuple(_leaf_plan(node, r, layout, None if r.route is None else next(placements))
                   for (_, node), r in zip(flat, routes))
    trained_treedef = jax.tree.structure(trainable_params(params), is_leaf=_is_variable)
    return ShardingPlan(leaves, treedef, trained_treedef, mesh, layout, routing, cost)


def _leaf_plan(node, leaf: LeafRoute, layout: Layout | None,
               where: Placement | None) -> LeafPlan:
    """A leaf's plan; its param on its matrices' owners where the layout keeps fp32
    masters there (``Layout.masters_on_owners``), with the model's copy."""
    spec = None if layout is None else layout.param_spec(leaf.logical or (None,) * len(leaf.shape))
    dtype = ax.compute_dtype_of(node)
    if where is None or not layout.masters_on_owners(dtype, ax.grad_dtype_of(node), where.owners,
                                                     where.dealt):
        return LeafPlan(leaf.path, leaf.shape, leaf.logical, leaf.route, spec, where,
                        _codec(node, leaf))
    return LeafPlan(leaf.path, leaf.shape, leaf.logical, leaf.route, where.state,
                    dataclasses.replace(where, param=where.state), _codec(node, leaf),
                    ModelCopy(spec, dtype))


def _codec(node, leaf: LeafRoute) -> LeafCodec:
    """The param's codec from what its variable declares: grouped layers [G, g, ...]
    (the model's ``real_layers``) and a padded vocabulary (``real_vocab``)."""
    meta = node.get_metadata() if _is_variable(node) else {}
    stack, vocab = stack_of(node) if _is_variable(node) else None, meta.get("real_vocab")
    grouped = {} if stack is None else dict(stack=stack)
    if vocab is None:
        return LeafCodec(**grouped)
    dim = leaf.logical.index(ax.VOCAB)
    return LeafCodec(**grouped, vocab_dim=dim, vocab=(vocab, leaf.shape[dim]))
