"""The matrix-optimizer skeleton: the placement pipeline, written once.

A matrix optimizer (Muon, SOAP, ...) supplies its per-stack math only:

  init_stack(x, leaf)          -> the leaf's state fields (a tuple, in the order of
                                  its state NamedTuple after ``count``)
  update_stack(g, fields, count, leaf) -> (direction, new fields)

where ``x`` is the param leaf, ``g`` the gradient (fp32) and ``direction`` the
update, all shaped as the leaf's owners hold it: under the layerwise layout
its stack axis padded and reordered over the owners, elsewhere as the param
(``jmegatron.optim.placement``). ``leaf`` is the plan's ``LeafPlan``. The
skeleton routes every leaf through the plan (every leaf it sees must be a
matrix), pads, constrains gradients to the owners, calls the math,
unpads, and constrains the update back to where the param lives and the new
state to the plan's placement (``HELD`` and ``BLOCKS`` fields, declared on
the state type with ``plan.matrix_state``).

Where the math runs is the skeleton's decision too: math that needs whole
matrices (an SVD, an eigenbasis, a top-k over a side) declares
``whole_matrices`` and is written as single-device code, which the skeleton
runs on the matrices' owners (``on_owners``); math that communicates on its
own terms (Newton-Schulz's tensor-parallel modes) gets the arrays as held.

Every optimizer takes its placement as one argument, ``plan=``: a
``ShardingPlan`` (made once, a static input), or a ``PlanSpec`` (routing,
mesh, layout, rules) from which a plan is made from the tree each call sees
(a pure function of the tree's paths, shapes and logical axes). Updates that
carry no logical axes (``nnx.Optimizer`` hands over plain arrays) need a
``ShardingPlan``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.optim import checks
from jmegatron.optim.plan import BLOCKS, HELD, LeafPlan, ShardingPlan, make_plan, state_forms
from jmegatron.optim.routing import ADAMW, Routing, batch_axes
from jmegatron.sharding.layouts import Layout
from jmegatron.sharding.rules import DEFAULT_RULES, Rules

InitStack = Callable[[jax.Array, LeafPlan], tuple]
UpdateStack = Callable[[jax.Array, tuple, jax.Array, LeafPlan], tuple[jax.Array, tuple]]


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW for the leaves a matrix optimizer does not take.

    Embeddings, the head, norms and biases (see ``Routing``) get ``optax.adamw``
    with these options, checked when they are given (``jmegatron.optim.checks``).

    Attributes:
      learning_rate: a number or an optax schedule of the step; None: the matrix
        optimizer's.
      b1: the first moment's decay.
      b2: the second moment's decay (0.95, not optax's 0.999).
      eps: added to sqrt(v) in the denominator.
      weight_decay: the decoupled weight decay coefficient (``p -= lr * wd * p``;
        0: none).
      weight_decay_mask: ``optax.adamw``'s ``mask``: a tree of bools, or a function
        of the params giving one, that says which leaves decay; None: all.
    """

    learning_rate: optax.ScalarOrSchedule | None = None
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mask: object = None

    def __post_init__(self):
        checks.learning_rate(self.learning_rate, "AdamW learning_rate", optional=True)
        checks.fraction("AdamW b1", self.b1)
        checks.fraction("AdamW b2", self.b2)
        checks.positive("AdamW eps", self.eps)   # a zero gradient would give 0 / 0
        checks.non_negative("AdamW weight_decay", self.weight_decay)

    def tx(self, default_lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
        lr = default_lr if self.learning_rate is None else self.learning_rate
        return optax.adamw(lr, b1=self.b1, b2=self.b2, eps=self.eps,
                           weight_decay=self.weight_decay, mask=self.weight_decay_mask)


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What an optimizer makes its plan of, from each tree it sees.

    ``make_plan(tree, mesh, layout, routing, rules)`` on every call: for when no
    params are at hand to make a ``ShardingPlan`` once. Without a mesh: routes only.

    Attributes:
      routing: which leaves are matrices and how each splits into blocks (``Routing``).
      mesh: the device mesh; None: no ``shard_map`` (arrays as XLA places them).
      layout: a ``Layout`` or "replicated", "layerwise", "fsdp" or "owner"; None:
        "fsdp". Used only with a mesh.
      rules: the logical-to-mesh axis rules a layout given by name (or None) is built on.
    """

    routing: Routing = Routing()
    mesh: jax.sharding.Mesh | None = None
    layout: Layout | str | None = None
    rules: Rules = DEFAULT_RULES


# Every matrix optimizer's one placement argument: a plan made once, or what to make one of.
PlanLike = ShardingPlan | PlanSpec | None


@dataclasses.dataclass(frozen=True)
class PlanSource:
    """Where a transformation's plan comes from: given, or made from each tree."""

    plan: ShardingPlan | None = None
    spec: PlanSpec = PlanSpec()

    @classmethod
    def of(cls, plan: PlanLike) -> "PlanSource":
        """The source of an optimizer's ``plan`` argument; anything else is refused."""
        if plan is None or isinstance(plan, PlanSpec):
            return cls(spec=plan or PlanSpec())
        if isinstance(plan, ShardingPlan):
            return cls(plan)
        raise ValueError(f"plan must be a ShardingPlan (make_plan), a PlanSpec or None, got "
                         f"{type(plan).__name__}")

    @property
    def placed_on(self) -> jax.sharding.Mesh | None:
        """The mesh the state is placed on (the plan's, when given)."""
        return self.plan.mesh if self.plan is not None else self.spec.mesh

    def __call__(self, tree) -> ShardingPlan:
        if self.plan is not None:   # a model's plan covers variables no optimizer trains
            return self.plan.for_optimizer()
        s = self.spec
        return make_plan(tree, s.mesh, s.layout, s.routing, s.rules)

    def at_init(self, params, who: str) -> ShardingPlan:
        """The plan, at init; a plan given must be of params of these shapes (one made
        for another model would fail inside JAX, or worse, run)."""
        plan = self(params)
        if self.plan is None:
            return plan
        for leaf, sub in zip(plan.leaves, plan.split(params)):   # split: the structure
            arrays = jax.tree.leaves(sub)   # none where a wrapper masked the leaf out
            if arrays and tuple(arrays[0].shape) != leaf.shape:
                raise ValueError(f"{who}: the plan does not fit the params: {leaf.path} has "
                                 f"shape {tuple(arrays[0].shape)} in the params and "
                                 f"{leaf.shape} in the plan; make the plan from these "
                                 "params (make_plan)")
        return plan


def matrix_leaves(plan: ShardingPlan, subs: list, who: str) -> list[tuple[int, LeafPlan]]:
    """(index, leaf plan) of every leaf present in ``subs`` (``plan.split`` of a
    tree; masked-out leaves skipped); each must be a matrix."""
    out = []
    for i, (leaf, sub) in enumerate(zip(plan.leaves, subs)):
        if not jax.tree.leaves(sub):
            continue
        if not leaf.is_matrix:
            why = "which is not trained (not an nnx.Param)" if leaf.route is None else \
                f"which routing sends to AdamW ({leaf.route.rule})"
            raise ValueError(f"{who} got {leaf.path}, {why}; combine it with AdamW "
                             "(jmegatron.optim.muon or soap) to split the tree")
        out.append((i, leaf))
    return out


def _array(sub) -> jax.Array:
    return jax.tree.leaves(sub)[0]


def _like(sub, value):
    """``value`` in ``sub``'s wrapper (a variable stays a variable)."""
    return jax.tree.structure(sub).unflatten([value])


def _constrain(x, mesh, spec: P | None):
    if mesh is None or spec is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def place_fields(fields: tuple, forms: tuple[str, ...], leaf: LeafPlan, mesh) -> tuple:
    """The state fields of one leaf constrained to the plan's placement."""
    placed = []
    for value, form in zip(fields, forms):
        if form == HELD:
            placed.append(jax.tree.map(lambda x: _constrain(x, mesh, leaf.held), value))
        else:
            placed.append(jax.tree.map(
                lambda x: _constrain(x, mesh, leaf.blocks_spec(x.ndim)), value))
    return tuple(placed)


# Whether an optimizer's math of a leaf needs whole matrices (SVD, eigh, a top-k over a
# whole side): True, False (it communicates itself, as Newton-Schulz's tensor-parallel
# modes), or a function of the leaf.
WholeMatrices = bool | Callable[[LeafPlan], bool]


def whole_spec(leaf: LeafPlan) -> P:
    """The sharding of arrays held like ``leaf`` with every matrix whole: the stack
    axes split as held, the matrix dims not at all."""
    held = tuple(leaf.held) + (None,) * (len(leaf.shape) - len(tuple(leaf.held)))
    stack = batch_axes(leaf.route.spec, len(leaf.shape))
    return P(*(held[d] if d in stack else None for d in range(len(leaf.shape))))


def on_owners(update_stack: UpdateStack, kinds: tuple[str, ...], mesh) -> UpdateStack:
    """``update_stack`` run where the layout puts whole matrices: in ``jax.shard_map``,
    each device on its own slice of the stack (the owners under layerwise and owner;
    under fsdp every device gathers every matrix: duplicated work), as plain
    single-device code. Without a mesh or a placement, as it is."""

    def run(g, fields, count, leaf):
        if mesh is None or leaf.placement is None:
            return update_stack(g, fields, count, leaf)
        whole = whole_spec(leaf)
        specs = tuple(jax.tree.map(lambda x: whole if kind == HELD else
                                   leaf.blocks_spec(x.ndim), value)
                      for value, kind in zip(fields, kinds))
        return jax.shard_map(lambda g, fields, count: update_stack(g, fields, count, leaf),
                             mesh=mesh, in_specs=(whole, specs, P()),
                             out_specs=(whole, specs))(g, fields, count)
    return run


def scale_by_matrix_optimizer(who: str, state_type: type[NamedTuple], init_stack: InitStack,
                              update_stack: UpdateStack, source: PlanSource,
                              whole_matrices: WholeMatrices = False
                              ) -> optax.GradientTransformation:
    """The skeleton (see the module docstring) around one optimizer's math.

    Args:
      who: the transformation's name, for error messages.
      state_type: the state, a NamedTuple ``(count, *fields)`` whose fields are
        declared with ``matrix_state``.
      init_stack: ``init_stack(x, leaf) -> fields``, a matrix leaf's initial
        state fields (in ``state_type``'s order after ``count``).
      update_stack: ``update_stack(g, fields, count, leaf) -> (direction, fields)``
        for one matrix leaf; ``g`` is fp32 and ``count`` the step, 1 at the first
        update.
      source: where the plan comes from (``jmegatron.optim.matrix.PlanSource``:
        the one given, or one made from each tree).
      whole_matrices: whether ``update_stack`` needs whole matrices (True: the
        skeleton runs it on their owners, ``on_owners``, and the math is
        single-device code; False: it gets the arrays as held and communicates
        itself; or a function of the ``LeafPlan`` deciding per leaf).

    Returns:
      An ``optax.GradientTransformation`` with state ``state_type``.
    """
    forms = state_forms(state_type)
    names = state_type._fields[1:]
    kinds = tuple(forms[name] for name in names)
    assert set(kinds) <= {HELD, BLOCKS} and len(kinds) == len(forms), (who, forms)
    whole = whole_matrices if callable(whole_matrices) else lambda leaf: whole_matrices
    owned = on_owners(update_stack, kinds, source.placed_on)

    def init_fn(params):
        plan = source.at_init(params, who)
        subs = plan.split(params)
        columns = [list(subs) for _ in names]   # masked-out leaves keep their node
        for i, leaf in matrix_leaves(plan, subs, who):
            checks.matrix_leaf(who, leaf.path, _array(subs[i]))
            mine = place_fields(init_stack(_array(subs[i]), leaf), kinds, leaf, plan.mesh)
            for column, value in zip(columns, mine):
                column[i] = value
        return state_type(jnp.zeros([], jnp.int32), *(plan.join(c) for c in columns))

    def update_fn(updates, state, params=None):
        del params
        plan = source(updates)
        count = optax.safe_increment(state.count)
        subs = plan.split(updates)
        fields = [plan.split(getattr(state, name)) for name in names]
        out, new_fields = list(subs), [list(f) for f in fields]
        for i, leaf in matrix_leaves(plan, subs, who):
            mesh, g = plan.mesh, _array(subs[i])
            g32 = g.astype(jnp.float32)
            if leaf.placement is not None:   # gradients reach the owners of their matrices
                g32 = _constrain(leaf.placement.pad(g32), mesh, leaf.held)
            step = owned if whole(leaf) else update_stack
            direction, mine = step(g32, tuple(f[i] for f in fields), count, leaf)
            if leaf.placement is not None:   # updates go back to where the params live
                direction = _constrain(leaf.placement.unpad(direction), mesh, leaf.param)
            out[i] = _like(subs[i], direction.astype(g.dtype))
            for column, value in zip(new_fields, place_fields(mine, kinds, leaf, mesh)):
                column[i] = value
        return plan.join(out), state_type(count, *(plan.join(f) for f in new_fields))

    return optax.GradientTransformation(init_fn, update_fn)


def per_matrix(fn: Callable, x: jax.Array):
    """``fn`` on every matrix of a stack [..., m, n] (``fn`` returns a pytree of
    [..., *] arrays). On CPU one at a time: XLA:CPU splits a batched eigh, QR or
    SVD over the thread pool its devices also run on, and with 8 virtual devices
    waiting on each other that deadlocks (seen with jaxlib 0.10.2). Elsewhere
    batched."""
    if jax.default_backend() != "cpu" or x.ndim == 2:
        return fn(x)
    flat = x.reshape(-1, *x.shape[-2:])
    return jax.tree.map(lambda y: y.reshape(*x.shape[:-2], *y.shape[1:]), jax.lax.map(fn, flat))


def held_zeros(x: jax.Array, leaf: LeafPlan, dtype) -> jax.Array:
    """Zeros shaped as the leaf's owners hold it (the stack padded under layerwise)."""
    zeros = jnp.zeros_like(x, dtype=dtype)
    return zeros if leaf.placement is None else leaf.placement.pad(zeros)


def with_adamw(name: str, matrix: optax.GradientTransformation, plan: PlanLike,
               learning_rate: optax.ScalarOrSchedule, adamw: AdamW
               ) -> optax.GradientTransformation:
    """``matrix`` (labelled ``name``) for the leaves the plan (the optimizer's ``plan``
    argument) calls matrices, AdamW for the others. A plan given is checked against
    the whole tree at init."""
    if not isinstance(adamw, AdamW):
        raise ValueError(f"adamw must be a jmegatron.optim.AdamW, got {type(adamw).__name__}")
    source = PlanSource.of(plan)
    both = optax.partition({name: matrix, ADAMW: adamw.tx(learning_rate)},
                           lambda params: source(params).labels(name, params))

    def init_fn(params):
        source.at_init(params, name)   # the AdamW leaves too, which ``matrix`` never sees
        return both.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, both.update)


WeightDecayMethod = Literal["decoupled", "independent", "l2", "palm"]
WEIGHT_DECAY_METHODS: tuple[str, ...] = get_args(WeightDecayMethod)


def at_step(value: optax.ScalarOrSchedule, count: jax.Array):
    """A number, or a schedule's value at ``count``."""
    return value(count) if callable(value) else value


def add_scheduled_decay(rate: Callable[[jax.Array], jax.Array] | float
                        ) -> optax.GradientTransformation:
    """``updates + rate * params``, with ``rate`` a number or a function of the step
    (counted from 0, as ``optax.scale_by_learning_rate`` counts)."""

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params):
        if params is None:
            raise ValueError("weight decay needs the params: call update(updates, state, params)")
        r = at_step(rate, state.count)
        updates = jax.tree.map(lambda g, p: g + r * p, updates, params)
        return updates, optax.ScaleByScheduleState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def add_decay(rate) -> optax.GradientTransformation:
    """``updates + rate * params``: optax's for a number (its state stays empty),
    ``add_scheduled_decay`` for a function of the step."""
    return add_scheduled_decay(rate) if callable(rate) else optax.add_decayed_weights(rate)


Decay = Callable[[Callable[[jax.Array], jax.Array] | float], optax.GradientTransformation]


def descend(direction: optax.GradientTransformation, learning_rate: optax.ScalarOrSchedule,
            weight_decay: float, method: WeightDecayMethod = "decoupled",
            decay: Decay = add_decay) -> optax.GradientTransformation:
    """``-lr * direction`` with weight decay by ``method`` (p: the weights before the step):

      decoupled:   p -= lr * wd * p         (Loshchilov & Hutter; optax.adamw's)
      independent: p -= wd * p              (not tied to the learning rate)
      l2:          g += wd * p              (before ``direction``: enters its moments)
      palm:        p -= lr^2 * wd * p       (PaLM's lr-squared decay)

    ``decay(rate)`` adds ``rate * p`` to the updates after ``direction`` (``rate`` a
    number or a function of the step); SOAP's skips its basis-building first step.

    Args:
      direction: the transformation giving the update direction (e.g.
        ``scale_by_muon``).
      learning_rate: a finite number > 0 or an optax schedule of the step (a
        schedule's values are not checked: they exist only during updates).
      weight_decay: the decay coefficient wd, finite, >= 0 (0: none).
      method: "decoupled", "independent", "l2" or "palm" (above).
      decay: ``decay(rate)`` builds the transformation that adds ``rate * p`` in
        every method but "l2"; default ``add_decay`` (optax's
        ``add_decayed_weights`` for a number).

    Returns:
      An ``optax.GradientTransformation`` whose updates are added to the params.

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
        arXiv:1711.05101, 2017.
      Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways",
        arXiv:2204.02311, 2022.
    """
    checks.learning_rate(learning_rate)
    checks.non_negative("weight_decay", weight_decay)
    if method not in WEIGHT_DECAY_METHODS:
        raise ValueError(f"unknown weight_decay_method {method!r}; one of {WEIGHT_DECAY_METHODS}")
    lr = optax.scale_by_learning_rate(learning_rate)
    if method == "l2":
        return optax.chain(add_decay(weight_decay), direction, lr)
    if method == "decoupled":
        return optax.chain(direction, decay(weight_decay), lr)
    if method == "independent":   # after the -lr scaling: -lr * d - wd * p
        return optax.chain(direction, lr, decay(-weight_decay))
    return optax.chain(direction, decay(lambda count: weight_decay * at_step(learning_rate, count)),
                       lr)
