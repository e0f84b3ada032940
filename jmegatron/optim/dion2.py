"""Dion2: orthogonalize only an alpha-fraction of the momentum's rows or columns.

What the reference does (microsoft/dion, ``dion/dion2.py`` and the helpers it
imports; read at commit 0a059a4), single device (no process group), and what
this module does:

- **Momentum.** ``dion2_pre_orthogonalize``: ``M <- M + G`` (no decay factor;
  ``G`` cast to M's dtype, M zeros in the param's dtype). The ``betas`` of
  ``Dion2`` are only for its AdamW/Lion parameter groups. Here: the same sum, in
  fp32, stored in ``momentum_dtype`` (default the param's).
- **Selection.** ``dion2_update_megabatch_async`` picks ``select_dim`` from the
  shape of the torch weight [out, in]: rows (dim -2) if ``num_rows <= num_cols``
  else columns, i.e. the slices along the shorter side, output neurons on ties
  (a sharded matrix instead selects along its shard dim). ``dion2_pre_orthogonalize``
  ranks the slices by their L1 norm (``M.norm(p=1)`` over the other dim) and
  keeps the top ``k = max(1, ceil(fraction * size))`` (``torch.topk``, unsorted);
  a 3-D param is a batch of matrices (``flatten=False``), each selecting its own.
  Here: jmegatron's matrices are [fan_in, fan_out] (``to_matrices``), so the
  reference's rows are our columns: the slices along fan_out (axis -1) when
  ``fan_out <= fan_in``, else along fan_in (axis -2); the same L1 norms and k
  (the same float expression). ``jax.lax.top_k`` breaks ties by the lower index,
  torch's order is unspecified.
- **Error feedback.** ``dion2_pre_orthogonalize`` copies the selected slices out
  for orthogonalization, then scales those slices of M in place by ``ef_decay``
  (default 0.95); the other slices keep accumulating undecayed. Here: the same.
- **Orthogonalization.** The default ``newton_schulz_func`` of
  ``DistributedOrthoBase`` (``dion/megabatch_base.py``, ``use_polar_express=True``)
  is ``polar_express`` (``dion/polar_express.py``): the submatrix in bf16 (the
  selection is cast to bf16 for communication), ``X / (1.02 ||X||_F + epsilon)``
  with Dion2's ``epsilon`` (1e-8), then five iterations with
  ``_POLAR_EXPRESS_COEFFS`` (Amsel et al., safety factor 1.02 folded into all but
  the last), ``A = X X^T, X <- a X + (b A + c A A) X`` on the short side (a tall
  matrix through ``X^T X`` and right products), every operation in bf16.
  Here, by default (``coefficients="dion2"``): those five tuples
  (``DION2_COEFFICIENTS``) and that normalization, computed in fp32 before any
  cast (the project's rule), with ``matmul_dtype`` bf16: bf16 operands, fp32
  accumulation, X kept in fp32 between iterations (the reference rounds X to bf16
  after every operation, so the two agree to bf16 round-off, not bitwise). Any
  other ``coefficients`` (a set's name, tuples, a ``CoefficientSet``) runs
  Muon's ``newton_schulz`` with that set, its ``steps`` and its own unit-Frobenius
  normalization; ``matmul_dtype="float32"`` makes either exact to fp32.
- **Scale.** ``adjust_lr="spectral_norm"`` (default), ``adjust_lr_spectral_norm``
  in ``dion/megabatch_base.py``: the update is multiplied by
  ``sqrt(fan_out / fan_in)`` of the whole param (``shape[-2:]`` of [out, in]);
  "rms_norm": ``0.2 sqrt(max(fan_out, fan_in))``; None: 1. Here: Muon's
  ``update_scale``, default ``scale="unit_rms"`` (the same sqrt(fan_out / fan_in));
  "spectral" with the default ``rms_factor`` is "rms_norm", "none" is None.
- **Weight decay and the step.** ``dion2_post_orthogonalize``: first
  ``X *= 1 - lr * weight_decay`` on every entry (the base lr, not the adjusted
  one; default weight_decay 0.01), then ``X[selected] += -adjusted_lr * O``
  (``scatter_add_``); unselected slices get only the decay. ``dion2`` is
  ``descend`` with decoupled decay: ``-lr * (scale * O_scattered + wd * X)``,
  X the weights before the step, the same.

Beyond the reference: fused QKV/SwiGLU leaves are split into blocks as Muon
splits them, each selected, orthogonalized and scaled on its own (the
reference refuses ``split_sizes`` for Dion2 and scales by the whole param).

Under a mesh (what moves, per device and optimizer step; ring collectives as
``jmegatron.analysis.hlo`` counts them; fp32, 4 bytes an element; a matrix's
s slices along the selected dim have t entries each; k = ``selected_count``;
the held state splits the s side gs ways and the t side gt ways, the matrix
g = gs gt ways; r = (g - 1) / g):

- **Whole matrices on their devices** (owner, layerwise, replicated layouts; no
  mesh): each block's step runs in ``jax.shard_map`` over its stack on the
  devices holding its state (``matrix.on_owners``, as MOP); no collective.
  ``selection="local"`` is the global selection there (the reference's too:
  off its row-sharded path the scope is a no-op).
- **Split matrices** (the ``fsdp`` layout: ``embed`` over ``fsdp``, and with a
  ``tensor`` axis heads/``mlp`` over ``tensor`` too; ``matrix_split``: on each
  side of the view at most one leaf dim split, over any mesh axes, led only by
  size-1 dims on its side and not the fused blocks' split axis, so each
  device's shard of a block is one contiguous block of each side): one
  ``jax.shard_map`` per leaf whose in_specs are the held spec, so each device
  keeps its own shard and nothing gathers the whole matrix
  (``sharded_dion2_block``). Muon on fsdp (and this module before) all-gathers
  every whole matrix: r s t.

  ``selection="global"`` (default): the single-device selection (the shorter
  side), equal to ``dion2_block`` to fp32 round-off. Each device sums the L1
  norms of its entries of its s/gs slices; a psum over the t side's axes
  completes them (2 (gt-1)/gt s/gs) and an all-gather over the s side's axes
  collects all s ((gs-1)/gs s). Every device takes the same top-k
  (``jax.lax.top_k``, ties by the lower index). The [k, t] submatrix is
  assembled from the selected slices only: each device writes the selected
  slices it holds (its t/gt entries of them) into a zero [k, t/gt] and a psum
  over the s side's axes adds them (2 (gs-1)/gs k t/gt), then an all-gather
  along t over the t side's axes completes the rows ((gt-1)/gt k t). A
  fixed-size all-gather cannot replace the psum: how many of the k slices a
  shard holds depends on the data (0 to min(k, s/gs)), and padding every shard
  to min(k, s/gs) rows sends gs min(k, s/gs) t/gt, the whole matrix once
  alpha >= 1/gs. Adding zeros is exact, so the submatrix is bitwise one
  device's. Total (``sharded_bytes``): 2 (gt-1)/gt s/gs + (gs-1)/gs s +
  2 (gs-1)/gs k t/gt + (gt-1)/gt k t; with one side split, 2 r s + r k t
  (t split, ~alpha of Muon's bytes) or r s + 2 r k t (s split, ~2 alpha: an
  all-reduce is a reduce-scatter and an all-gather).

  ``selection="local"`` (microsoft/dion's default ``selection_scope`` for its
  FSDP2 row-sharded path), one side split only: the slices along the split dim
  (as the reference, which aligns ``select_dim`` with the shard dim even where
  that is the longer side); each shard takes its own top k_local =
  ``selected_count(fraction, s/g)`` (the reference's ``max(1, ceil(fraction *
  ceil(s / g)))``), a fixed count, so one all-gather of [k_local, t] per device
  gives the [g k_local, t] submatrix: r g k_local t, alpha of Muon's bytes, no
  norm exchange. The selection depends on the sharding (the union of per-shard
  top-k's). With both sides split, "local" is the global selection (as where
  matrices are whole; a per-shard selection there is not built).

  Either way the submatrix is orthogonalized on every device of the shard
  group (duplicated work, as Muon on fsdp; the reference instead spreads the
  matrices of a same-shape batch over its ranks with all-to-alls) and each
  device keeps its own rows and columns of the update and of the
  error-feedback decay. Measured (one optimizer step's HLO, alpha 0.25; global,
  local, Muon): tests/test_dion2.py's 3-layer d=32 model on fsdp 8: 45,696,
  24,192, 96,768 bytes per device; on fsdp 4 x tensor 2: 35,520 (both),
  96,768; on data 2 x fsdp 2 x tensor 2 (the CLI's default): 29,952 (both),
  82,944. The default model (d=128, 2 layers, d_ff 384) on fsdp 8: 637,952,
  344,064, 1,376,256; fsdp 4 x tensor 2: 481,792, 1,376,256; data 2 x fsdp 2 x
  tensor 2: 399,360, 1,179,648.
- **Anything else** (two dims of one side split, the fused blocks' split axis
  split, a split dim after a longer one on its side): today's path,
  ``matrix.on_owners`` gathers whole matrices (r s t) and selects globally,
  whatever ``selection`` says.

NorDion2 (``dion/nordion2.py``, also exported as ``Dion3``) is
``jmegatron.optim.nordion2``: output neurons always, then NorMuon's per-neuron
normalization of the selected ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jmegatron.optim import checks
from jmegatron.optim.coefficients import CoefficientSet, coefficient_set
from jmegatron.optim.matrix import (AdamW, PlanLike, PlanSource, WeightDecayMethod, descend,
                                    held_zeros, scale_by_matrix_optimizer, with_adamw)
from jmegatron.optim.muon import ScaleMode, update_scale
from jmegatron.optim.newton_schulz import newton_schulz, ns_flops, ns_step
from jmegatron.optim.plan import HELD, LeafPlan, matrix_state
from jmegatron.optim.routing import Routing, from_matrices, matrix_pieces, to_matrices
from jmegatron.sharding.rules import spec_axes

# dion/polar_express.py's _POLAR_EXPRESS_COEFFS: Polar Express for 5 iterations,
# safety factor 2e-2 (1.02 folded into all but the last), cushion 2.
DION2_COEFFICIENTS = CoefficientSet("dion2", (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
))
SAFETY = 1.02   # the reference divides by 1.02 ||X||_F before the first iteration


@matrix_state(momentum=HELD)
class Dion2State(NamedTuple):
    """The state of ``scale_by_dion2``.

    Attributes:
      count: the steps taken, an int32 scalar.
      momentum: the error-feedback momentum, a tree mirroring the params; each
        matrix leaf held as its owners hold it, in ``momentum_dtype``.
    """

    count: jax.Array              # int32 scalar
    momentum: optax.Updates       # mirrors the params, each held as its owners hold it


def selection_axis(fan_in: int, fan_out: int) -> int:
    """The axis of a [fan_in, fan_out] matrix whose slices Dion2 selects.

    The shorter side's; fan_out (the reference's rows of its [out, in] weight)
    when square.

    Args:
      fan_in: the matrix's rows (input dim).
      fan_out: its columns (output dim).

    Returns:
      -1 (select columns, i.e. output neurons) or -2 (select rows).
    """
    return -1 if fan_out <= fan_in else -2


def selected_count(fraction: float, size: int) -> int:
    """How many of ``size`` slices Dion2 orthogonalizes: ``max(1, ceil(fraction * size))``.

    Args:
      fraction: the fraction alpha in (0, 1].
      size: the number of slices along the selection axis.

    Returns:
      k, an int in [1, size].
    """
    return min(size, max(1, int(math.ceil(fraction * size))))


def reference_polar_express(x: jax.Array, *, steps: int | None = None, matmul_dtype="bfloat16",
                            epsilon: float = 1e-8) -> jax.Array:
    """The reference's orthogonalization of a stack [..., m, n] (fp32 result).

    ``X / (1.02 ||X||_F + epsilon)`` in fp32, then ``DION2_COEFFICIENTS``'
    iterations ``X <- a X + (b A + c A A) X``, ``A = X X^T`` on the short side
    (tall inputs transposed), matmul operands in ``matmul_dtype`` with fp32
    accumulation. A zero matrix gives zero.

    Args:
      x: a matrix or a stack of matrices [..., m, n].
      steps: iterations; None: 5 (the reference's), more repeat the last tuple.
      matmul_dtype: the dtype of the matmul operands (accumulation is fp32).
      epsilon: added to the scaled Frobenius norm (the reference's Dion2 1e-8).

    Returns:
      The orthogonalized x, fp32, of x's shape.

    References:
      Amsel et al., "The Polar Express: Optimal Matrix Sign Methods and Their
        Application to the Muon Algorithm", arXiv:2505.16932, 2025.
      microsoft/dion, ``dion/polar_express.py``.
    """
    schedule = DION2_COEFFICIENTS.schedule(DION2_COEFFICIENTS.default_steps
                                           if steps is None else steps)
    tall = x.shape[-2] > x.shape[-1]
    x = jnp.swapaxes(x, -1, -2) if tall else x
    x = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    x = x / (SAFETY * norm + epsilon)
    for coeffs in schedule:
        x = ns_step(x, coeffs, jnp.dtype(matmul_dtype))
    return jnp.swapaxes(x, -1, -2) if tall else x


def orthogonalizer(coefficients, steps: int | None, matmul_dtype, epsilon: float
                   ) -> Callable[[jax.Array], jax.Array]:
    """``f(submatrix stack) -> orthogonalized`` for ``scale_by_dion2``'s options.

    Args:
      coefficients: "dion2" (``reference_polar_express``) or anything
        ``coefficient_set`` takes (Muon's ``newton_schulz``).
      steps: iterations; None: the set's default.
      matmul_dtype: the dtype of the matmul operands.
      epsilon: the reference normalization's epsilon ("dion2" only).

    Returns:
      The function, fp32 results.
    """
    checks.integer("steps", steps, 1, optional=True)
    checks.float_dtype("matmul_dtype", matmul_dtype)
    checks.positive("epsilon", epsilon)
    dtype = jnp.dtype(matmul_dtype)
    if isinstance(coefficients, str) and coefficients == "dion2":
        return lambda x: reference_polar_express(x, steps=steps, matmul_dtype=dtype,
                                                 epsilon=epsilon)
    try:   # an unknown name or bad tuples, refused here
        coefficient_set(coefficients)
    except ValueError as err:
        raise ValueError(f"coefficients: {err}, or 'dion2' (the reference's Polar "
                         "Express)") from None
    return lambda x: newton_schulz(x, steps=steps, coefficients=coefficients, matmul_dtype=dtype)


class Selected(NamedTuple):
    """The top slices of a momentum stack [..., s, t] whose rows are the slices."""

    idx: jax.Array       # [..., k] their row indices
    sub: jax.Array       # [..., k, t] the submatrix
    decayed: jax.Array   # [..., s, t] the momentum with those rows times ef_decay

    def place(self, rows: jax.Array) -> jax.Array:
        """``rows`` [..., k, t] at the selected rows of a zero [..., s, t]."""
        where = jnp.broadcast_to(self.idx[..., None], rows.shape)
        return jnp.put_along_axis(jnp.zeros_like(self.decayed), where, rows, axis=-2,
                                  inplace=False)


def select_rows(m: jax.Array, fraction: float, ef_decay: float) -> Selected:
    """The ``selected_count`` rows of ``m`` [..., s, t] with the largest L1 norms
    (``jax.lax.top_k``: ties to the lower index), and the momentum with them decayed."""
    _, idx = jax.lax.top_k(jnp.sum(jnp.abs(m), axis=-1), selected_count(fraction, m.shape[-2]))
    where = jnp.broadcast_to(idx[..., None], (*idx.shape, m.shape[-1]))
    chosen = jnp.any(idx[..., :, None] == jnp.arange(m.shape[-2]), axis=-2)[..., None]
    return Selected(idx, jnp.take_along_axis(m, where, axis=-2),
                    jnp.where(chosen, ef_decay * m, m))


def dion2_block(g: jax.Array, m: jax.Array, fraction: float, ef_decay: float,
                orthogonalize: Callable[[jax.Array], jax.Array]
                ) -> tuple[jax.Array, jax.Array]:
    """One Dion2 step of a block stack [..., fan_in, fan_out] (fp32).

    ``M <- M + G``; the ``selected_count`` slices along ``selection_axis`` with
    the largest L1 norms are orthogonalized (as one submatrix per matrix) and
    scaled by ``ef_decay`` in the momentum.

    Args:
      g: the gradient stack, fp32.
      m: the momentum stack, fp32.
      fraction: the fraction of slices selected.
      ef_decay: the decay of the selected slices of the momentum.
      orthogonalize: the orthogonalization of the submatrix stack.

    Returns:
      (the update: the orthogonalized slices in place, zeros elsewhere, unscaled;
      the new momentum).
    """
    axis = selection_axis(*g.shape[-2:])
    rows = lambda a: a if axis == -2 else jnp.swapaxes(a, -1, -2)   # selected slices as rows
    picked = select_rows(rows(m + g), fraction, ef_decay)
    return rows(picked.place(orthogonalize(picked.sub))), rows(picked.decayed)


Selection = Literal["global", "local"]
SELECTIONS: tuple[str, ...] = get_args(Selection)


@dataclasses.dataclass(frozen=True)
class MatrixSplit:
    """How a leaf's held state splits each matrix [fan_in, fan_out] of its view: each
    side in contiguous blocks over its own mesh axes (either possibly none).

    Attributes:
      in_axes: the mesh axes splitting fan_in (its PartitionSpec entry, in order:
        a device's block is its row-major index over them, ``lax.axis_index``).
      out_axes: those splitting fan_out.
      in_size: fan_in's blocks, the product of ``in_axes``' sizes (1: whole).
      out_size: fan_out's blocks.
    """

    in_axes: tuple[str, ...]
    out_axes: tuple[str, ...]
    in_size: int
    out_size: int

    def axes_of(self, side: int) -> tuple[str, ...]:
        """The mesh axes splitting ``side`` (-2 fan_in, -1 fan_out)."""
        return self.in_axes if side == -2 else self.out_axes

    def size_of(self, side: int) -> int:
        """The blocks of ``side`` (-2 fan_in, -1 fan_out)."""
        return self.in_size if side == -2 else self.out_size

    @property
    def side(self) -> int | None:
        """The one split side (-2 or -1); None when both are split."""
        if self.in_axes and self.out_axes:
            return None
        return -2 if self.in_axes else -1

    @property
    def axes(self) -> tuple[str, ...]:
        """Every splitting mesh axis, fan_in's first."""
        return self.in_axes + self.out_axes

    @property
    def size(self) -> int:
        """The shards of a matrix, ``in_size * out_size``."""
        return self.in_size * self.out_size


def matrix_split(leaf: LeafPlan, mesh: jax.sharding.Mesh | None) -> MatrixSplit | None:
    """The split of ``leaf``'s matrices that ``sharded_dion2_block`` handles, or None.

    Handled: on each side of the matrix view (``in_axes``, ``out_axes``) the held
    spec (``leaf.held``) splits at most one leaf axis over mesh axes of size > 1
    (any of them, ``tensor`` included), and at least one side is split; a split
    axis is not the blocks' ``split_axis`` and only size-1 axes come before it on
    its side, so each device's shard of every block is one contiguous block of
    each merged dim (``to_matrices`` of the shard is the shard of
    ``to_matrices``). Batch axes may be split (each device its own matrices, as
    in ``on_owners``).

    Args:
      leaf: a matrix leaf's plan.
      mesh: the mesh; None: no split.

    Returns:
      The ``MatrixSplit``; None where each device holds whole matrices (owner,
      layerwise, replicated layouts, no mesh) and in every case not handled (two
      dims of one side split, the fused split axis split, a split dim after a
      longer one on its side): those keep ``on_owners``, which gathers whole
      matrices.
    """
    if mesh is None or leaf.placement is None:
        return None
    spec = leaf.route.spec
    held = tuple(leaf.held) + (None,) * (len(leaf.shape) - len(tuple(leaf.held)))
    live = lambda dim: tuple(a for a in spec_axes(held[dim]) if mesh.shape[a] > 1)
    found = []
    for axes in (spec.in_axes, spec.out_axes):
        split = [dim for dim in axes if live(dim)]
        if len(split) > 1 or spec.split_axis in split:
            return None
        if not split:
            found.append(((), 1))
            continue
        before = axes[:axes.index(split[0])]
        if any((max(spec.split_sizes) if a == spec.split_axis else leaf.shape[a]) != 1
               for a in before):
            return None
        names = spec_axes(held[split[0]])
        found.append((names, math.prod(mesh.shape[a] for a in names)))
    (in_axes, in_size), (out_axes, out_size) = found
    if in_size * out_size == 1:
        return None
    return MatrixSplit(in_axes, out_axes, in_size, out_size)


def selects_locally(split: MatrixSplit, selection: Selection) -> bool:
    """Whether ``sharded_dion2_block`` selects per shard: "local" with one side split
    (with both, "local" selects globally, as where matrices are whole)."""
    return selection == "local" and split.side is not None


def sharded_dion2_block(g: jax.Array, m: jax.Array, split: MatrixSplit, fan_in: int,
                        fan_out: int, selection: Selection, fraction: float, ef_decay: float,
                        orthogonalize: Callable[[jax.Array], jax.Array]
                        ) -> tuple[jax.Array, jax.Array]:
    """One Dion2 step of this device's shard of a block stack, inside ``jax.shard_map``.

    ``g`` and ``m`` are this device's [..., fan_in, fan_out] blocks, each side cut
    as ``split`` says (module docstring, "Under a mesh"). Global selection: the
    slices along ``selection_axis(fan_in, fan_out)`` (s of them, t entries each),
    the same top-k on every device as ``dion2_block``; local (one side split
    only): the slices along the split dim, each device its own top
    ``selected_count(fraction, s / size)``. Only the selected slices travel; the
    [k, t] submatrix is orthogonalized on every device of the group and each
    keeps its own part.

    Args:
      g: this device's gradient blocks, fp32.
      m: its momentum blocks, fp32.
      split: how the matrices are split (``matrix_split``).
      fan_in: the whole matrix's rows.
      fan_out: its columns.
      selection: "global" (equal to one device) or "local" (per shard, where one
        side is split; else global).
      fraction: the fraction of slices selected (of the whole dim, or of each
        shard's under "local").
      ef_decay: the decay of the selected slices of the momentum.
      orthogonalize: the orthogonalization of the submatrix stack.

    Returns:
      (this device's part of the update, unscaled; of the new momentum).
    """
    local = selects_locally(split, selection)
    axis = split.side if local else selection_axis(fan_in, fan_out)
    rows = lambda a: a if axis == -2 else jnp.swapaxes(a, -1, -2)   # selected slices as rows
    m = rows(m + g)                              # [..., slices held here, their entries here]
    s_axes, t_axes = split.axes_of(axis), split.axes_of(-3 - axis)
    here, width = m.shape[-2:]
    slice_dim, entry_dim = m.ndim - 2, m.ndim - 1   # non-negative, as collectives take them
                                                    # (slice_dim is also the norms' last)
    norms = jnp.sum(jnp.abs(m), axis=-1)         # [..., here]; partial sums if t is split
    if local:
        # One side split, the selected one: each shard its own top-k, a fixed count, so
        # a fixed-size gather along the selected dim; no norm exchange.
        k = selected_count(fraction, here)
        rank = lax.axis_index(s_axes)
        _, idx = lax.top_k(norms, k)
        where = jnp.broadcast_to(idx[..., None], (*idx.shape, width))
        sub = lax.all_gather(jnp.take_along_axis(m, where, axis=-2), s_axes, axis=slice_dim,
                             tiled=True)                                      # [..., g k, t]
        own = lax.dynamic_slice_in_dim(orthogonalize(sub), rank * k, k, axis=slice_dim)
        update = jnp.put_along_axis(jnp.zeros_like(m), where, own, axis=-2, inplace=False)
        chosen = jnp.any(idx[..., :, None] == jnp.arange(here), axis=-2)[..., None]
        return rows(update), rows(jnp.where(chosen, ef_decay * m, m))
    # Global: the L1 norms summed over t's shards (a psum: every device gets the same
    # sums, an all-reduce's result is one), the s side's gathered; the same top-k on
    # every device.
    if t_axes:
        norms = lax.psum(norms, t_axes)                                       # [..., here]
    if s_axes:
        norms = lax.all_gather(norms, s_axes, axis=slice_dim, tiled=True)     # [..., s]
    _, idx = lax.top_k(norms, selected_count(fraction, norms.shape[-1]))
    # How many of the k selected slices an s shard holds depends on the data, so no
    # fixed-size gather fits: each shard writes its own into a zero [k, t/gt] and a
    # psum over the s side adds them up (x + 0 is exact: bitwise one device's).
    first = lax.axis_index(s_axes) * here if s_axes else 0
    local_idx = idx - first                                                   # [..., k]
    where = jnp.broadcast_to(jnp.clip(local_idx, 0, here - 1)[..., None], (*idx.shape, width))
    mine = ((local_idx >= 0) & (local_idx < here))[..., None]
    sub = jnp.where(mine, jnp.take_along_axis(m, where, axis=-2), 0.0)       # [..., k, t/gt]
    if s_axes:
        sub = lax.psum(sub, s_axes)
    if t_axes:   # then the entries, gathered along t: [..., k, t]
        sub = lax.all_gather(sub, t_axes, axis=entry_dim, tiled=True)
    ortho = orthogonalize(sub)
    if t_axes:   # this device's entries
        ortho = lax.dynamic_slice_in_dim(ortho, lax.axis_index(t_axes) * width, width,
                                         axis=entry_dim)
    hits = local_idx[..., :, None] == jnp.arange(here)                       # [..., k, here]
    chosen = jnp.any(hits, axis=-2)[..., None]                               # [..., here, 1]
    slot = jnp.broadcast_to(jnp.argmax(hits, axis=-2)[..., None], m.shape)
    update = jnp.where(chosen, jnp.take_along_axis(ortho, slot, axis=-2), 0.0)
    return rows(update), rows(jnp.where(chosen, ef_decay * m, m))


def sharded_bytes(split: MatrixSplit | None, fan_in: int, fan_out: int, selection: Selection,
                  fraction: float, count: int = 1, dtype_bytes: int = 4) -> float:
    """Bytes one device sends in one Dion2 step of ``count`` matrices (ring
    collectives, as ``jmegatron.analysis.hlo`` counts them: an all-gather
    (g-1)/g of its result, an all-reduce 2 (g-1)/g of its buffer).

    Global, the selected side's s slices split gs ways, the t entries gt ways
    (either 1): the psum of the partial norms over the t side, 2 (gt-1)/gt s/gs,
    their all-gather over the s side, (gs-1)/gs s; the psum of the masked
    [k, t/gt] over the s side, 2 (gs-1)/gs k t/gt, then its all-gather over the t
    side, (gt-1)/gt k t. Local (one side split n ways): the gather of
    [n k_local, t], (n-1)/n n k_local t, along the split dim. Unsplit (None): 0.

    Args:
      split: ``matrix_split``'s answer for the leaf; None: whole matrices.
      fan_in: the matrix's rows.
      fan_out: its columns.
      selection: "global" or "local".
      fraction: alpha.
      count: matrices of this shape.
      dtype_bytes: bytes per element (4: the fp32 momentum).

    Returns:
      The bytes, a float.
    """
    if split is None or split.size == 1:
        return 0.0
    if selects_locally(split, selection):
        n = split.size
        s, t = (fan_in, fan_out) if split.side == -2 else (fan_out, fan_in)
        elements = (n - 1) * selected_count(fraction, s // n) * t
        return count * elements * dtype_bytes
    axis = selection_axis(fan_in, fan_out)
    s, t = (fan_in, fan_out) if axis == -2 else (fan_out, fan_in)
    gs, gt = split.size_of(axis), split.size_of(-3 - axis)
    k = selected_count(fraction, s)
    elements = (2 * (gt - 1) / gt * s / gs + (gs - 1) / gs * s
                + 2 * (gs - 1) / gs * k * t / gt + (gt - 1) / gt * k * t)
    return count * elements * dtype_bytes


def check_fraction(fraction) -> None:
    """``fraction`` must be a number in (0, 1] (it fixes a shape: never traced)."""
    checks.share("fraction", fraction, is_static=True)


def scale_by_dion2(*, fraction: float = 0.25, ef_decay: float = 0.95,
                   coefficients: str | CoefficientSet | tuple = "dion2",
                   steps: int | None = None, matmul_dtype="bfloat16", epsilon: float = 1e-8,
                   scale: ScaleMode = "unit_rms", rms_factor: float | None = None,
                   momentum_dtype=None, selection: Selection = "global",
                   plan: PlanLike = None
                   ) -> optax.GradientTransformation:
    """Dion2's direction: sum momentum, a fraction of its slices orthogonalized.

    Per matrix block [fan_in, fan_out] (module docstring): ``M <- M + G``; the
    ``max(1, ceil(fraction * s))`` slices along the shorter side (s of them;
    fan_out when square) with the largest L1 norms form a submatrix that is
    orthogonalized and placed back (zeros elsewhere), times ``update_scale``;
    those slices of M are multiplied by ``ef_decay``. Fused QKV/SwiGLU leaves are
    split into blocks as ``scale_by_muon`` splits them; stacks [L, ...] select
    per matrix. ``dion2`` combines this with weight decay and AdamW.

    With a ``mesh``, each block's step runs in ``jax.shard_map`` on the devices
    holding its state (``layout``, ``plan`` as for ``scale_by_muon``): the owner
    layout's step needs no collective; under fsdp (one side of each matrix split,
    or both with a ``tensor`` axis) each device keeps its shard and only the
    selected slices (and the s L1 norms under global selection) travel; other
    splits are gathered whole (module docstring, "Under a mesh"). Arguments are checked here
    (one-line ValueError), leaves and ``plan`` at init. A non-finite gradient
    enters the momentum for good.

    Args:
      fraction: alpha, the fraction of slices orthogonalized, in (0, 1]
        (a Python number: it fixes the submatrix's shape).
      ef_decay: the error-feedback decay of the selected slices of the momentum,
        in [0, 1).
      coefficients: "dion2": the reference's Polar Express (``DION2_COEFFICIENTS``,
        ``X / (1.02 ||X||_F + epsilon)``); else a coefficient set's name, tuples or
        a ``CoefficientSet`` run by Muon's ``newton_schulz``.
      steps: the iterations; None: the set's default (5 for "dion2").
      matmul_dtype: the dtype of the orthogonalization's matmul operands
        (accumulation fp32): "bfloat16" as the reference, or "float32".
      epsilon: added to the scaled norm in the "dion2" normalization.
      scale: the multiplier of each block's update (``update_scale``): "unit_rms"
        (``sqrt(fan_out / fan_in)``, the reference's "spectral_norm"), "spectral"
        (its "rms_norm"), "shape" or "none".
      rms_factor: a factor on ``scale``; None: ``update_scale``'s default.
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      selection: "global": the top-k of each whole matrix, whatever the sharding
        (equal to one device); "local": where a matrix is split along one side
        only (fsdp without tensor), each shard its own top
        ``selected_count(fraction, shard)`` along the split dim, half the bytes
        when the split dim is the selected one (microsoft/dion's default scope;
        depends on the sharding). The global selection wherever matrices are
        whole or split on both sides.
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.

    Returns:
      An ``optax.GradientTransformation`` (state ``Dion2State``) whose updates are
      the scaled sparse orthogonalized directions, before the learning rate and sign.

    References:
      Ahn, Amsel & Langford, "Dion2: A Simple Method to Shrink Matrix in Muon",
        arXiv:2512.16928, 2025.
      Amsel et al., "The Polar Express", arXiv:2505.16932, 2025.
      microsoft/dion, ``dion/dion2.py``.
    """
    check_fraction(fraction)
    checks.fraction("ef_decay", ef_decay)
    checks.one_of("scale", scale, get_args(ScaleMode))
    checks.positive("rms_factor", rms_factor, optional=True)
    checks.float_dtype("momentum_dtype", momentum_dtype, optional=True)
    checks.one_of("selection", selection, SELECTIONS)
    orthogonalize = orthogonalizer(coefficients, steps, matmul_dtype, epsilon)
    source = PlanSource.of(plan)
    mesh = source.placed_on

    def block_step(pair):
        g, m = pair
        update, m = dion2_block(g, m, fraction, ef_decay, orthogonalize)
        return update * update_scale(scale, *g.shape[-2:], rms_factor), m

    def init_stack(x, leaf):
        return (held_zeros(x, leaf, momentum_dtype or x.dtype),)

    def split_step(g, m, spec, split, fans):
        """This device's shards of a leaf (in ``jax.shard_map``), block by block."""
        done = []
        for gb, mb, (fan_in, fan_out) in zip(to_matrices(g, spec),
                                             to_matrices(m.astype(jnp.float32), spec), fans):
            update, new = sharded_dion2_block(gb, mb, split, fan_in, fan_out, selection,
                                              fraction, ef_decay, orthogonalize)
            done.append((update * update_scale(scale, fan_in, fan_out, rms_factor), new))
        return (from_matrices([u for u, _ in done], spec, g.shape),
                from_matrices([n for _, n in done], spec, m.shape).astype(m.dtype))

    def update_stack(g, fields, count, leaf):
        (m,) = fields
        spec = leaf.route.spec
        split = matrix_split(leaf, mesh)
        if split is not None:   # the matrices split in place: only the selection moves
            fans = [(p.fan_in, p.fan_out) for p in spec.pieces(g.shape)]
            update, m = jax.shard_map(lambda g, m: split_step(g, m, spec, split, fans),
                                      mesh=mesh, in_specs=(leaf.held, leaf.held),
                                      out_specs=(leaf.held, leaf.held))(g, m)
            return update, (m,)
        pairs = zip(to_matrices(g, spec), to_matrices(m.astype(jnp.float32), spec))
        done = [block_step(pair) for pair in pairs]   # whole matrices, on their owners
        update = from_matrices([u for u, _ in done], spec, g.shape)
        return update, (from_matrices([n for _, n in done], spec, m.shape).astype(m.dtype),)

    # The split leaves communicate only their selection themselves; the others need whole
    # matrices, which the skeleton runs on their owners.
    return scale_by_matrix_optimizer("scale_by_dion2", Dion2State, init_stack, update_stack,
                                     source, whole_matrices=lambda leaf:
                                     matrix_split(leaf, mesh) is None)


def dion2(learning_rate: optax.ScalarOrSchedule, *, fraction: float = 0.25,
          ef_decay: float = 0.95, coefficients: str | CoefficientSet | tuple = "dion2",
          steps: int | None = None, matmul_dtype="bfloat16", epsilon: float = 1e-8,
          scale: ScaleMode = "unit_rms", rms_factor: float | None = None,
          weight_decay: float = 0.01, weight_decay_method: WeightDecayMethod = "decoupled",
          momentum_dtype=None, selection: Selection = "global", plan: PlanLike = None,
          adamw: AdamW = AdamW()) -> optax.GradientTransformation:
    """Dion2 for hidden matrices, AdamW for every other leaf.

    Matrices get ``-lr * (scale * O + weight_decay * W)`` by default (decoupled
    decay on every entry, with the base learning rate, as the reference's
    ``dion2_post_orthogonalize``; other methods: ``descend``), O the sparse
    orthogonalized update of ``scale_by_dion2``; the other leaves get ``adamw``'s.
    Defaults are the reference's (fraction 0.25, ef_decay 0.95, its Polar Express
    in bf16, spectral-norm lr adjustment, weight decay 0.01).

    Args:
      learning_rate: a number or an optax schedule of the step; also AdamW's
        unless ``adamw.learning_rate`` is set.
      fraction: alpha, the fraction of slices orthogonalized, in (0, 1].
      ef_decay: the error-feedback decay of the selected slices, in [0, 1).
      coefficients: "dion2" (the reference's Polar Express) or a coefficient set
        for Muon's ``newton_schulz`` (see ``scale_by_dion2``).
      steps: the iterations; None: the set's default.
      matmul_dtype: the dtype of the orthogonalization's matmul operands.
      epsilon: added to the scaled norm in the "dion2" normalization.
      scale: the multiplier of each block's update (``update_scale``); default
        "unit_rms", the reference's "spectral_norm".
      rms_factor: a factor on ``scale``; None: ``update_scale``'s default.
      weight_decay: the matrices' weight decay coefficient (0: none); the other
        leaves take ``adamw.weight_decay``.
      weight_decay_method: "decoupled", "independent", "l2" or "palm" (see
        ``descend``).
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      selection: "global" (each whole matrix's top-k) or "local" (per shard of a
        matrix split along one side only; see ``scale_by_dion2``).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.
      adamw: the AdamW of the other leaves (``AdamW``).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "dion2") and the AdamW leaves.

    References:
      Ahn, Amsel & Langford, "Dion2: A Simple Method to Shrink Matrix in Muon",
        arXiv:2512.16928, 2025.
      microsoft/dion, ``dion/dion2.py``.
    """
    direction = scale_by_dion2(
        fraction=fraction, ef_decay=ef_decay, coefficients=coefficients, steps=steps,
        matmul_dtype=matmul_dtype, epsilon=epsilon, scale=scale, rms_factor=rms_factor,
        momentum_dtype=momentum_dtype, selection=selection, plan=plan)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method)
    return with_adamw("dion2", matrix, plan, learning_rate, adamw)


def dion2_flops(params, routing: Routing = Routing(), fraction: float = 0.25,
                coefficients: str | CoefficientSet | tuple = "dion2",
                steps: int | None = None) -> int:
    """Orthogonalization FLOPs of one Dion2 step on ``params``.

    Per matrix block, the submatrix of its ``selected_count`` slices along
    ``selection_axis`` through ``ns_flops`` (the reference's Polar Express and
    Muon's Newton-Schulz iterate the same products); the selection's norms and
    top-k are not matmuls.

    Args:
      params: the params tree (real or abstract arrays, or an nnx.State; only the
        shapes and logical axes are read).
      routing: which leaves are matrices, as for ``dion2``.
      fraction: alpha, the fraction of slices selected.
      coefficients: "dion2" or a coefficient set (only its default step count is
        read).
      steps: the iterations; None: the set's default (5 for "dion2").

    Returns:
      The FLOPs, an int.
    """
    cset = DION2_COEFFICIENTS if coefficients == "dion2" else coefficient_set(coefficients)
    n = cset.default_steps if steps is None else steps
    total = 0
    for p in matrix_pieces(params, routing):
        rows, cols = ((p.fan_in, selected_count(fraction, p.fan_out))
                      if selection_axis(p.fan_in, p.fan_out) == -1
                      else (selected_count(fraction, p.fan_in), p.fan_out))
        total += p.count * ns_flops(rows, cols, n)
    return total
