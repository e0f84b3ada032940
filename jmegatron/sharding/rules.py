"""Logical axis names and the rules that map them to mesh axes.

Model code names logical axes only (``('layers', 'embed', 'mlp')``); a rules
table, chosen per parallel setup, says which mesh axes shard each of them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.sharding.mesh import BATCH_AXES

# Parameter axes.
LAYERS, EMBED, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EXPERTS = (
    "layers", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "experts")
LAYER_GROUPS = "layer_groups"   # outer axis of block weights stacked [L/g, g, ...]
STAGES = "stages"               # outer axis of block weights stacked [S, L/S, ...] (pipeline)
QKV = "qkv"     # the query-group / key / value slot of a fused QKV weight
GLU = "glu"     # the gate / up slot of a fused SwiGLU input weight
NORM = "norm"   # scale vectors of norms (tiny; replicated)
# Activation axes.
BATCH, SEQ = "batch", "seq"
ACT_EMBED, ACT_MLP, ACT_HEADS, ACT_KV_HEADS, ACT_VOCAB = (
    "act_embed", "act_mlp", "act_heads", "act_kv_heads", "act_vocab")
ACTIVATION_AXES = (BATCH, SEQ, ACT_EMBED, ACT_MLP, ACT_HEADS, ACT_KV_HEADS, ACT_VOCAB)

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Megatron tensor parallelism (column-parallel QKV and MLP-in, row-parallel
# outputs, vocab-parallel embedding and head), ZeRO-3 over `fsdp` (params
# sharded along `embed`, gathered for use), data parallelism over the rest.
# An axis of size 1 costs nothing, so this one table serves every product of
# data, fsdp and tensor; experts are spread over `expert`.
DEFAULT_RULES: Rules = (
    (STAGES, "stage"),
    (LAYER_GROUPS, None),
    (LAYERS, None),
    (EMBED, "fsdp"),
    (MLP, "tensor"),
    (HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (HEAD_DIM, None),
    (QKV, None),
    (GLU, None),
    (VOCAB, "tensor"),
    (EXPERTS, "expert"),
    (NORM, None),
    (BATCH, BATCH_AXES),
    (SEQ, "context"),
    (ACT_EMBED, None),
    (ACT_MLP, "tensor"),
    (ACT_HEADS, "tensor"),
    (ACT_KV_HEADS, "tensor"),
    (ACT_VOCAB, "tensor"),
)

# Plain data parallelism: every parameter replicated, only the tokens split (the
# batch, and the sequence over `context`).
DATA_PARALLEL_RULES: Rules = tuple(
    (name, entry if name in (BATCH, SEQ) else None) for name, entry in DEFAULT_RULES)


def with_rules(base: Rules, **overrides: MeshAxes) -> Rules:
    """Returns ``base`` with some logical axes mapped elsewhere."""
    unknown = set(overrides) - {name for name, _ in base}
    if unknown:
        raise ValueError(f"unknown logical axes {sorted(unknown)}")
    return tuple((name, overrides.get(name, axes)) for name, axes in base)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def mesh_axes_of(logical: str | None, rules: Rules) -> tuple[str, ...]:
    """Mesh axes that shard one logical axis (``()`` for replicated)."""
    if logical is None:
        return ()
    table = dict(rules)
    if logical not in table:
        raise ValueError(f"logical axis {logical!r} has no rule; known: {sorted(table)}")
    return _as_tuple(table[logical])


@dataclasses.dataclass(frozen=True)
class AxisRoles:
    """What the mesh axes do in a step, as a rules table declares them (``axis_roles``);
    code outside the rules and ``mesh.py`` asks these, not for mesh axes by name.

    Attributes:
      batch: the axes that split the batch (each of their groups holds other examples).
      sequence: the axes that split the sequence (context parallelism).
      stages: the axes that hold pipeline stages.
    """

    batch: tuple[str, ...]
    sequence: tuple[str, ...]
    stages: tuple[str, ...]

    @property
    def tokens(self) -> tuple[str, ...]:
        """The axes holding other tokens: a sum over all tokens (a weight's gradient, the
        MoE routing statistics) runs over them."""
        return self.batch + self.sequence


    def ranks(self, mesh_shape: Mapping[str, int], role: str = "batch") -> int:
        """How many parts the axes of ``role`` cut their dimension into on ``mesh_shape``."""
        return math.prod(mesh_shape.get(a, 1) for a in getattr(self, role))


def axis_roles(rules: Rules) -> AxisRoles:
    """The roles ``rules`` gives the mesh axes: those mapped to the batch, sequence and
    stage logical axes."""
    return AxisRoles(batch=mesh_axes_of(BATCH, rules), sequence=mesh_axes_of(SEQ, rules),
                     stages=mesh_axes_of(STAGES, rules))


def spec_axes(entry) -> tuple[str, ...]:
    """Mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    return _as_tuple(entry)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules,
                    exclude: Iterable[str] = ()) -> P:
    """PartitionSpec for an array whose dims carry ``logical_axes``.

    A mesh axis already used by an earlier dim is dropped from later ones (an
    array cannot be split twice over the same devices), as are the mesh axes
    in ``exclude``.
    """
    used: set[str] = set(exclude)
    spec = []
    for logical in logical_axes:
        axes = tuple(a for a in mesh_axes_of(logical, rules) if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def logical_axes_of(node) -> tuple[str | None, ...] | None:
    """The logical axes a Flax variable carries (its ``out_sharding`` metadata), or
    None for plain arrays and unannotated variables."""
    get_metadata = getattr(node, "get_metadata", None)
    return None if get_metadata is None else get_metadata().get("out_sharding")


def compute_dtype_of(node) -> jnp.dtype:
    """The dtype a Flax variable computes in (its ``compute_dtype`` metadata, set where
    the model creates it: ``models.layers.param``); fp32 for anything else. Runners
    gather a weight in it and sum its gradient in it."""
    get_metadata = getattr(node, "get_metadata", None)
    return jnp.dtype((get_metadata() if get_metadata else {}).get("compute_dtype", "float32"))


def grad_dtype_of(node) -> jnp.dtype:
    """The dtype a Flax variable's gradient is computed and summed in (its
    ``grad_dtype`` metadata: ``GPTConfig.grad_reduce_dtype``); else its compute dtype."""
    get_metadata = getattr(node, "get_metadata", None)
    meta = get_metadata() if get_metadata else {}
    return jnp.dtype(meta.get("grad_dtype", compute_dtype_of(node)))


def split_size(mesh_shape: Mapping[str, int], rules: Rules, logical: str) -> int:
    """How many parts the mesh axes the rules map ``logical`` to split it into."""
    return math.prod(mesh_shape.get(a, 1) for a in mesh_axes_of(logical, rules))


def check_vocab_apart_from_batch(mesh_shape: Mapping[str, int], rules: Rules) -> None:
    """The vocab-parallel embedding and loss sum over the vocab axes: those must
    not also split the batch, or rows of different sequences would be added."""
    live = lambda name: {a for a in mesh_axes_of(name, rules) if mesh_shape.get(a, 1) > 1}
    for vocab in (VOCAB, ACT_VOCAB):
        shared = live(vocab) & live(BATCH)
        if shared:
            raise ValueError(f"{vocab} and batch both use mesh axes {sorted(shared)}; "
                             "map them to different axes in the rules")


def check_divisible(dims: Mapping[str, int], mesh_shape: Mapping[str, int],
                    rules: Rules) -> None:
    """Raises ValueError if a logical dim does not divide by the mesh axes sharding it.

    ``dims`` maps logical axis names to sizes, e.g. ``{'heads': 6, 'batch': 12}``.
    """
    found = indivisible(dims, mesh_shape, rules)
    if found:
        logical, size, axes = found
        split = " x ".join(f"{a}={mesh_shape[a]}" for a in axes)
        parts = math.prod(mesh_shape[a] for a in axes)
        raise ValueError(f"{logical}={size} is not divisible by {split}"
                         f"{f' = {parts}' if len(axes) > 1 else ''}")


def indivisible(dims: Mapping[str, int], mesh_shape: Mapping[str, int],
                rules: Rules) -> tuple[str, int, list[str]] | None:
    """The first (logical axis, size, live mesh axes) of ``dims`` whose mesh axes do
    not divide it; None where all do."""
    for logical, size in dims.items():
        axes = [a for a in mesh_axes_of(logical, rules) if mesh_shape.get(a, 1) > 1]
        if size % math.prod(mesh_shape[a] for a in axes):
            return logical, size, axes
    return None


# --- activation sharding constraints ----------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[jax.sharding.Mesh, Rules] | None] = (
    contextvars.ContextVar("jmegatron_activation_sharding", default=None))


@contextlib.contextmanager
def activation_sharding(mesh: jax.sharding.Mesh | None, rules: Rules = DEFAULT_RULES):
    """Within this context (while tracing), ``constrain`` pins activations to
    ``mesh`` under ``rules``; outside it, ``constrain`` does nothing."""
    token = _ACTIVE.set(None if mesh is None else (mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, logical_axes: Iterable[str | None]) -> jax.Array:
    """Sharding constraint on an array named by logical axes."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(tuple(logical_axes), rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def without_axes(rules: Rules, axes: Iterable[str],
                 names: Iterable[str] | None = None) -> Rules:
    """``rules`` with ``axes`` removed from the entries of ``names`` (None: every entry)."""
    drop, names = set(axes), None if names is None else set(names)
    keep = lambda entry: tuple(a for a in _as_tuple(entry) if a not in drop) or None
    return tuple((name, keep(entry) if names is None or name in names else entry)
                 for name, entry in rules)


def sum_dtype(dtype) -> jnp.dtype:
    """The dtype a collective sums ``dtype`` values in: their own, but float32 for
    bfloat16 on XLA:CPU. Its pass that widens bf16 all-reduces and reduce-scatters to
    f32 (AllReducePromotion) aborts the compiler ("Invalid binary instruction opcode
    copy") on a reduction JAX lowers inside a map manual over some mesh axes, whose
    body ends in a sharding constraint (jax 0.10.2). Where the pass does not abort, it
    sums in f32 anyway: summing in f32 here differs only by not rounding the sum."""
    cpu = jax.devices()[0].platform == "cpu"
    return jnp.dtype(jnp.float32) if cpu and dtype == jnp.bfloat16 else jnp.dtype(dtype)


def scatter_to_owners(d: jax.Array, owners: tuple[str, ...], others: tuple[str, ...],
                      master) -> jax.Array:
    """A gathered weight's gradient ``d`` back on its owners: reduce-scattered over
    ``owners`` in ``sum_dtype`` (of ``d``'s, the compute dtype), then summed over the
    ``others`` batch axes, in the ``master`` dtype (the transpose of ``gather_in``)."""
    d = d.astype(sum_dtype(d.dtype))
    d = jax.lax.psum_scatter(d, owners, scatter_dimension=0, tiled=True) if owners else d
    return (jax.lax.psum(d, others) if others else d).astype(master)


def gather_in(block: jax.Array, dtype, owners: tuple[str, ...], others: tuple[str, ...],
              grad_dtype=None):
    """``block`` cast to ``dtype`` on its owner, then all-gathered over ``owners`` (in a
    ``shard_map`` manual over them): bf16 on the wire for a bf16 weight, the same
    values as casting the gathered fp32. Its gradient is reduce-scattered back in
    ``dtype`` (``sum_dtype``), then summed over the ``others`` batch axes, and
    reaches the master in its own dtype. With a wider ``grad_dtype`` the gathered
    weight is handed on in it (the same values), so the layers' gradient of it, and
    its sums, are in that dtype (``models.products``)."""
    wide = dtype if grad_dtype is None else grad_dtype

    @jax.custom_vjp
    def gather(b):
        b = jax.lax.pcast(b.astype(dtype), others, to="varying") if others else b.astype(dtype)
        return jax.lax.all_gather(b, owners, axis=0, tiled=True).astype(wide)

    def backward(_, g):
        return (scatter_to_owners(g, owners, others, block.dtype),)

    gather.defvjp(lambda b: (gather(b), None), backward)
    return gather(block)


# Collective outputs that run_gathered's backward keeps (``checkpoint_name``).
EXCHANGED = "exchanged"
_GATHERED = "gathered"   # run_gathered's whole weights, kept with keep=True
# The outputs of ``models.products``' products with fp32 weight gradients, without and
# with batch dims: a remat policy that saves dots cannot see the dot inside their
# custom_vjp, so ``dots_policy`` saves these names too.
PRODUCT, BATCHED_PRODUCT = "weight_product", "batched_weight_product"


def dots_policy(batch_dims: bool = False):
    """JAX's ``dots_saveable`` (with ``batch_dims``) or ``dots_with_no_batch_dims_saveable``,
    which also save the like products of ``models.products`` (by name)."""
    policies = jax.checkpoint_policies
    dots = policies.dots_saveable if batch_dims else policies.dots_with_no_batch_dims_saveable
    names = (PRODUCT, BATCHED_PRODUCT) if batch_dims else (PRODUCT,)
    return policies.save_from_both_policies(dots, policies.save_only_these_names(*names))


def _gathered_policy(keep: bool):
    names = (EXCHANGED, _GATHERED) if keep else (EXCHANGED,)
    return jax.checkpoint_policies.save_from_both_policies(
        dots_policy(), jax.checkpoint_policies.save_only_these_names(*names))


def run_gathered(fn: Callable, x: jax.Array, leaves: Sequence[jax.Array],
                 leaf_axes: Sequence[Sequence[str | None]], name: str,
                 summed: Iterable[str] = (), keep: bool = False,
                 dtypes: Sequence[jnp.dtype] | None = None,
                 grad_dtypes: Sequence[jnp.dtype] | None = None):
    """``fn(x, leaves)`` with each leaf gathered whole along its dim ``name`` (dim 0),
    in its ``dtypes`` entry (the dtype it computes in; None: its own, ``gather_in``),
    handed to ``fn`` in its ``grad_dtypes`` one (None: the same);
    ``fn`` returns (x, per-layer stats, a dict), each stats leaf [layers, B, ...],
    except the entries ``summed``: [layers, ...], summed over the whole batch inside
    ``fn`` (MoE loads), the same on every rank.

    Runs in ``jax.shard_map``, manual over the batch axes: each leaf moves by one
    all-gather over the mesh axes that split ``name``, and its gradient comes back
    by the transpose, one reduce-scatter onto those axes (plus the sum over the
    other batch axes). Inside, activations are constrained over the remaining
    (auto) axes only. With ``keep`` the backward keeps the gathered leaves rather
    than gather them again (FSDP's ``reshard_after_forward=False``). Without an
    active mesh, just ``fn(x, leaves)``.
    """
    active = _ACTIVE.get()
    if active is None:
        return fn(x, leaves)
    mesh, rules = active
    split = manual_split(mesh, rules, mesh_axes_of(name, rules), leaf_axes)
    manual, owners, summed = split.manual, split.owners, set(summed)
    dtypes = [leaf.dtype for leaf in leaves] if dtypes is None else dtypes
    grad_dtypes = dtypes if grad_dtypes is None else grad_dtypes

    # Unless ``keep``, the backward gathers the weights again instead of keeping
    # every group's alive (which would hold all weights on every device): only the
    # outputs of the projections are saved, as FSDP does, and those of collectives
    # named EXCHANGED (the expert all-to-all), which recomputing would send again.
    # (A policy that saves everything but the gathered weights keeps their
    # transposed and cast copies instead.)
    @functools.partial(jax.checkpoint, policy=_gathered_policy(keep))
    def body(x_block, *blocks):
        # Typed as varying over the other batch axes before the gather: the gradient's
        # sum over them (the cast's transpose) then runs after the reduce-scatter, on
        # this rank's part only, not on the whole group.
        others = lambda b: tuple(a for a in manual if a not in varying(b))
        whole = [checkpoint_name(gather_in(b, dtype, owners, others(b), wide), _GATHERED)
                 if owners else jax.lax.pcast(b, others(b), to="varying")
                 for b, dtype, wide in zip(blocks, dtypes, grad_dtypes)]
        with activation_sharding(jax.sharding.get_abstract_mesh(), split.inner_rules):
            x_block, stats = fn(x_block, whole)
        return x_block, ({k: v for k, v in stats.items() if k not in summed},
                         {k: v for k, v in stats.items() if k in summed})

    x, (each, whole_batch) = jax.shard_map(
        body, mesh=mesh, in_specs=(split.x_spec, *split.leaf_specs),
        out_specs=(split.x_spec, (split.stats_spec, P())), axis_names=set(manual))(x, *leaves)
    return x, {**each, **whole_batch}


@dataclasses.dataclass(frozen=True)
class ManualSplit:
    """How a ``shard_map`` manual over the batch axes sees layer weights whose
    dim ``name`` is split over some of them (``manual_split``)."""

    manual: tuple[str, ...]            # the live batch axes: manual inside
    owners: tuple[str, ...]            # those that split ``name``
    x_spec: P                          # activations [B, T, D]
    leaf_specs: tuple[P, ...]          # each leaf, over the manual axes only
    inner_rules: Rules                 # activations inside, over the other axes; the
                                       # weights' entries as outside (MoE reads them)

    @property
    def stats_spec(self) -> P:
        """Per-layer, per-example statistics [layers, B, ...]."""
        return P(None, self.x_spec[0])


def only_batch_axes_live(mesh_shape: Mapping[str, int], rules: Rules) -> bool:
    """Whether every mesh axis of size > 1 splits the batch, so that a ``shard_map``
    manual over the batch axes is manual over every live axis (``run_gathered``,
    ``scatter.run_stack``, ``prefetch``). Where another axis (tensor) stays auto in
    such a ``shard_map``, Shardy (jax 0.10.2) replicates the operands of its
    collectives over that axis: the weights' all-gather gathered them over tensor
    too, and every rank ran whole layers (3.7x the train-step bytes of a 7B model
    at fsdp 8 x tensor 8)."""
    batch = set(axis_roles(rules).batch)
    return all(size == 1 or axis in batch for axis, size in mesh_shape.items())


def manual_split(mesh, rules: Rules, owners: Sequence[str],
                 leaf_axes: Sequence[Sequence[str | None]]) -> ManualSplit:
    """The ``ManualSplit`` of leaves with ``leaf_axes`` whose layers are split over
    the mesh axes ``owners``; raises ValueError if one is not a batch axis."""
    live = lambda axes: tuple(a for a in axes if mesh.shape[a] > 1)
    manual = live(mesh_axes_of(BATCH, rules))
    owners = live(owners)
    if not set(owners) <= set(manual):
        raise ValueError(f"layers split over {owners}, which are not all batch axes {manual}")
    manual_only = lambda spec: P(*(tuple(a for a in spec_axes(e) if a in manual) or None
                                   for e in spec))
    return ManualSplit(manual, owners, manual_only(logical_to_spec((BATCH, SEQ, ACT_EMBED), rules)),
                       tuple(manual_only(logical_to_spec(axes, rules)) for axes in leaf_axes),
                       without_axes(rules, manual, ACTIVATION_AXES))


def run_constrained(fn: Callable, x: jax.Array, leaves: Sequence[jax.Array],
                    leaf_axes: Sequence[Sequence[str | None]], name: str, keep: bool = False):
    """``fn(x, leaves)`` with each leaf made whole along its dim ``name`` (dim 0) by
    a sharding constraint: XLA picks the collectives (an all-gather forward; the
    gradients return as it partitions them). ``run_gathered``'s counterpart where
    axes other than the batch axes are live (``only_batch_axes_live``), and for
    layers with a ``shard_map`` of their own (MoE), which cannot nest in
    ``run_gathered``'s: the transpose of nested manual computations fails to lower
    (Shardy, jax 0.10.2). Like there, the backward gathers the weights again
    unless ``keep``."""
    active = _ACTIVE.get()
    if active is None:
        return fn(x, leaves)
    mesh, rules = active
    owners = mesh_axes_of(name, rules)
    whole_spec = lambda axes: logical_to_spec((None, *axes[1:]), rules, exclude=owners)

    @functools.partial(jax.checkpoint, policy=_gathered_policy(keep))
    def body(x, leaves):
        return fn(x, [checkpoint_name(jax.lax.with_sharding_constraint(
            leaf, NamedSharding(mesh, whole_spec(axes))), _GATHERED)
            for leaf, axes in zip(leaves, leaf_axes)])

    return body(x, leaves)


def varying(x: jax.Array) -> frozenset:
    """The manual mesh axes ``x`` varies over (inside ``shard_map``)."""
    return jax.typeof(x).manual_axis_type.varying


def active_mesh_and_rules() -> tuple[jax.sharding.Mesh, Rules] | None:
    """The (mesh, rules) of the enclosing ``activation_sharding``, if any."""
    return _ACTIVE.get()
