"""Newton-Schulz on matrices split over the tensor axis, in ``jax.shard_map``.

Under Megatron tensor parallelism no device holds a whole weight, yet Muon
orthogonalizes whole matrices. Left to the compiler, Newton-Schulz on sharded
arrays communicates inside every iteration. The modes (after NVIDIA's
Megatron Muon):

  duplicated   one all-gather of the shards, full Newton-Schulz on every
               tensor rank, keep the local slice. Exact.
  distributed  X is split along columns c (the split side); each iteration
               sums the local Grams X_i X_i^T over ranks (one psum of r x r,
               r = the unsplit side) and updates its own columns; plus one
               scalar pmax for the scale. Exact; cheap when the split side is
               the long one (the Gram is of the short side). When the short
               side is split, the Gram is of the long side (r = long): still
               exact, but r^2 bytes per iteration; ``auto`` then prefers
               duplicated, and ``describe`` prints the Gram size. With the
               Gram method (``method="gram"``) it sums one Gram per restart
               segment instead: the rest is r x r and local.
  gathered     each iteration gathers X and the row blocks of the Gram of the
               split side, so every rank computes only its own rows of
               A = X X^T, of B = b A + c A A and of the new X: the FLOPs split
               t ways, for 2 all-gathers per iteration (X and A). Exact; what
               XLA does when the short side is split, and the mode that splits
               the work when distributed's Gram would be of the long side.
               Plain iterations: no SYRK, no Gram method, no AOL (``mode_for``
               falls back to duplicated).
  blockwise    Newton-Schulz of the local block alone, no communication: an
               approximation (block orthogonalization). Its update scale uses
               the block's shape, so a spectral-scaled block has the same RMS
               as an exact update.
  auto         per matrix, the exact mode with the lower modeled time
               (``TPCostModel``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jmegatron.optim.coefficients import coefficient_set
from jmegatron.optim.newton_schulz import (_EPS, NSMethod, _matmul, iterate, newton_schulz,
                                           ns_flops, resolve_method, resolve_schedule,
                                           syrk_backend)
from jmegatron.optim.routing import MatrixSpec
from jmegatron.sharding.rules import spec_axes

TPMode = Literal["duplicated", "distributed", "gathered", "blockwise", "auto"]
TP_MODES = ("duplicated", "distributed", "gathered", "blockwise", "auto")
EXACT_MODES = ("duplicated", "distributed", "gathered")
Side = Literal["in", "out"]      # the split dim of a [fan_in, fan_out] matrix


@dataclasses.dataclass(frozen=True)
class TPCostModel:
    """The modeled time of each tensor-parallel mode, by which "auto" chooses.

    Time of one mode = collectives x latency + bytes / bandwidth + FLOPs / rate,
    per device. Defaults: an H100-class GPU running fp32 Newton-Schulz on TF32
    tensor cores (~4e14 FLOP/s), NVLink (~4.5e11 B/s per direction), ~10 us
    per collective. With them, latency decides for small matrices (one
    all-gather beats steps + 1 all-reduces) and FLOPs for large ones. It counts
    plain Newton-Schulz FLOPs: what the SYRK kernel saves is ignored.

    Attributes:
      flops_per_s: the matmul rate per device, FLOP/s.
      bytes_per_s: the collectives' bandwidth per device and direction, bytes/s.
      latency_s: the fixed cost of one collective, seconds.
      dtype_bytes: the bytes of one element sent (4: fp32).
    """

    flops_per_s: float = 4e14
    bytes_per_s: float = 4.5e11
    latency_s: float = 1e-5
    dtype_bytes: int = 4

    def terms(self, mode: str, t: int, m: int, n: int, side: Side,
              steps: int) -> tuple[int, float, float]:
        """(collectives, bytes sent per device, FLOPs per device) of one matrix."""
        if mode == "duplicated":
            return 1, (t - 1) / t * m * n * self.dtype_bytes, float(ns_flops(m, n, steps))
        if mode == "distributed":
            r, c = (n, m) if side == "in" else (m, n)     # Gram of the unsplit side r
            per_step = 4 * r * r * (c / t) + 2 * r ** 3
            gram_bytes = 2 * (t - 1) / t * r * r * self.dtype_bytes
            return steps + 1, steps * gram_bytes, steps * per_step
        if mode == "gathered":
            c, r = (m, n) if side == "in" else (n, m)     # Gram of the split side c
            gathers = (t - 1) / t * (c * r + c * c) * self.dtype_bytes
            return 2 * steps, steps * gathers, steps * (4 * r * c * c + 2 * c ** 3) / t
        if mode == "blockwise":
            mb, nb = (m // t, n) if side == "in" else (m, n // t)
            return 0, 0.0, float(ns_flops(mb, nb, steps))
        raise ValueError(f"unknown tensor-parallel mode {mode!r}; one of {TP_MODES}")

    def seconds(self, mode: str, t: int, m: int, n: int, side: Side, steps: int) -> float:
        count, nbytes, flops = self.terms(mode, t, m, n, side, steps)
        return count * self.latency_s + nbytes / self.bytes_per_s + flops / self.flops_per_s

    def choose(self, t: int, m: int, n: int, side: Side, steps: int) -> str:
        """The exact mode (``EXACT_MODES``) with the lowest modeled time."""
        return min(EXACT_MODES, key=lambda mode: self.seconds(mode, t, m, n, side, steps))


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The mesh, its tensor axis, and the mode Newton-Schulz uses on split matrices.

    Attributes:
      mesh: the device mesh.
      mode: "duplicated", "distributed", "gathered", "blockwise" or "auto" (per
        matrix, the exact mode ``cost_model`` times lowest); module docstring.
      axis: the mesh axis matrices are split over.
      cost_model: the ``TPCostModel`` that "auto" chooses by.
    """

    mesh: jax.sharding.Mesh
    mode: TPMode = "auto"
    axis: str = "tensor"
    cost_model: TPCostModel = TPCostModel()

    def __post_init__(self):
        if self.mode not in TP_MODES:
            raise ValueError(f"tp_mode={self.mode!r}; choose one of {TP_MODES}")

    @property
    def size(self) -> int:
        return self.mesh.shape.get(self.axis, 1)

    def side(self, spec: MatrixSpec, leaf_spec: P) -> Side | None:
        """Which side of the matrix view ``leaf_spec`` splits over the tensor axis
        (None: neither; a split batch axis, as with per-head blocks, is local)."""
        entries = tuple(leaf_spec) + (None,) * (max(spec.in_axes + spec.out_axes) + 1)
        dims = [i for i, e in enumerate(entries) if self.axis in spec_axes(e)]
        if not dims or self.size == 1:
            return None
        unit_split = spec.split_axis if set(spec.split_sizes) == {1} else None  # size-1 slots
        for side, axes in (("in", spec.in_axes), ("out", spec.out_axes)):
            axes = tuple(a for a in axes if a != unit_split)
            if dims[0] in axes:
                if dims[0] != axes[0]:
                    raise ValueError(f"the tensor-split dim {dims[0]} must lead its side of the "
                                     f"matrix view {spec} to keep shards contiguous")
                return side
        return None

    def mode_for(self, m: int, n: int, side: Side, steps: int, aol: bool = False) -> str:
        """The mode for an m x n matrix split along ``side``. AOL rescales the rows
        of the Gram's side, which must be the short side to match the single-device
        result: with the long side unsplit, distributed falls back to duplicated."""
        mode = self.mode if self.mode != "auto" else self.cost_model.choose(
            self.size, m, n, side, steps)
        unsplit = n if side == "in" else m
        if aol and (mode == "gathered" or mode == "distributed" and unsplit > min(m, n)):
            return "duplicated"
        return mode


def tp_note(tp: TensorParallel, leaf_spec_of: Callable, steps: int | None,
            coefficients) -> Callable:
    """``describe`` note per block: the tensor-parallel mode it gets
    (``leaf_spec_of(leaf)`` gives the PartitionSpec the block is split by)."""
    cset = coefficient_set(coefficients)
    n_steps = cset.default_steps if steps is None else steps

    def note(leaf, piece) -> str:
        side = tp.side(leaf.route.spec, leaf_spec_of(leaf))
        if side is None:
            return "[local]"
        mode = tp.mode_for(piece.fan_in, piece.fan_out, side, n_steps,
                           cset.normalization == "aol")
        if mode != "distributed":
            return f"[tensor {side}: {mode}]"
        r = piece.fan_out if side == "in" else piece.fan_in
        return f"[tensor {side}: distributed, Gram {r}x{r}]"
    return note


def tp_newton_schulz(stack: jax.Array, side: Side | None, mode: str, tp: TensorParallel, *,
                     batch_spec: tuple = (), steps: int | None = None, coefficients="quintic",
                     matmul_dtype=jnp.float32, syrk: bool | str = False,
                     method: NSMethod = "standard", real: np.ndarray | None = None) -> jax.Array:
    """Newton-Schulz of a stack [*batch, m, n] whose matrices may be split over devices.

    It runs in ``jax.shard_map``: the batch dims split as ``batch_spec`` says
    (each device orthogonalizes its own matrices), the matrices split over
    ``tp.axis`` along ``side`` and handled in ``mode`` (not "auto"), or whole
    when ``side`` is None. Any other split of the input (an fsdp-split embed
    dim) is gathered on the way in. ``syrk`` (see ``newton_schulz``) applies in
    every mode: in distributed, each rank's local Gram is a SYRK before the
    psum. ``method`` (see ``newton_schulz``) applies in every mode too: whole
    matrices and blocks resolve it by their own shape; in distributed, "gram"
    sums one r x r Gram per restart segment instead of one per iteration, and
    "auto" resolves by the per-device FLOPs (``_distributed_method``). ``real``
    marks the entries of the first batch dim that hold a matrix
    (``Placement.real_slots``: padding is at most each device's last): a device
    skips its padding, except in the modes that communicate inside
    Newton-Schulz.

    Args:
      stack: the matrices [*batch, m, n] (a global array, as sharded).
      side: "in" (the rows m split over ``tp.axis``), "out" (the columns n), or
        None (each matrix whole on every device).
      mode: "duplicated", "distributed", "gathered" or "blockwise" (resolved, as
        by ``TensorParallel.mode_for``); unused when ``side`` is None.
      tp: the ``TensorParallel`` (its mesh and axis).
      batch_spec: the mesh axes of the leading batch dims, as PartitionSpec
        entries; dims past it are not split.
      steps: Newton-Schulz iterations; None: the set's ``default_steps``.
      coefficients: the coefficient set (see ``coefficient_set``).
      matmul_dtype: the dtype of the matmul operands (fp32 accumulation).
      syrk: False, True or a SYRK backend name (see ``newton_schulz``).
      method: "standard", "gram" or "auto" (see ``newton_schulz``).
      real: a bool array over the first batch dim, True where it holds a matrix;
        padding is skipped only when ``side`` is None or in blockwise. None: all
        real.

    Returns:
      The orthogonalized stack, fp32, sharded as it came in over ``batch_spec``
      and ``side`` (any other split is gathered).
    """
    schedule, normalization = resolve_schedule(coefficients, steps)
    ns = dict(steps=steps, coefficients=coefficients, matmul_dtype=matmul_dtype, syrk=syrk,
              method=method)
    batch_spec = tuple(batch_spec) + (None,) * (stack.ndim - 2 - len(batch_spec))
    row, col = stack.ndim - 2, stack.ndim - 1
    unsplit = stack.shape[col] if side == "in" else stack.shape[row]
    if mode == "distributed" and normalization == "aol" and unsplit > min(stack.shape[-2:]):
        raise ValueError("distributed Newton-Schulz with AOL needs the short side unsplit; "
                         "use duplicated (mode_for picks it)")
    dim = row if side == "in" else col
    split = {None: (None, None), "in": (tp.axis, None), "out": (None, tp.axis)}[side]
    spec = P(*batch_spec, *split)
    axis = tp.axis

    def duplicated(block):                   # [..., m/t, n] or [..., m, n/t]
        whole = lax.all_gather(block, axis, axis=dim, tiled=True)
        size = block.shape[dim]
        return lax.dynamic_slice_in_dim(newton_schulz(whole, **ns),
                                        lax.axis_index(axis) * size, size, axis=dim)

    def distributed(block):
        cols = jnp.swapaxes(block, row, col) if side == "in" else block   # split side last
        resolved = _distributed_method(method, *cols.shape[-2:], len(schedule),
                                       bool(syrk_backend(syrk)))
        out = iterate(cols, schedule, normalization, matmul_dtype,
                      sum_over_columns=lambda g: lax.psum(g, axis),
                      max_over_columns=lambda v: lax.pmax(v, axis), syrk=syrk_backend(syrk),
                      method=resolved)
        return jnp.swapaxes(out, row, col) if side == "in" else out

    def gathered(block):
        rows = jnp.swapaxes(block, row, col) if side == "out" else block   # split side first
        if normalization == "aol":
            raise ValueError("gathered Newton-Schulz has no AOL; use duplicated "
                             "(mode_for picks it)")
        out = _gathered_iterate(rows, schedule, matmul_dtype, axis)
        return jnp.swapaxes(out, row, col) if side == "out" else out

    local = {"duplicated": duplicated, "distributed": distributed, "gathered": gathered,
             "blockwise": lambda block: newton_schulz(block, **ns)}
    if side is None:
        fn = local["blockwise"]     # whole matrices on every device: plain Newton-Schulz
    elif mode in local:
        fn = local[mode]
    else:
        raise ValueError(f"tp_newton_schulz needs an explicit mode, not {mode!r}")
    operands, in_specs = (stack,), (spec,)
    if real is not None and not real.all() and (side is None or mode == "blockwise"):
        fn = _skipping_padding(fn)
        operands, in_specs = (stack, jnp.asarray(real)), (spec, P(batch_spec[0]))
    # An interpreted Pallas kernel indexes varying blocks with unvarying program
    # ids, which shard_map's type check rejects (check_vma: a pallas_call's output
    # is not typed as varying over the manual axes unless its out_shape says so):
    # off with SYRK (also when compiled, where no GPU has yet told us whether it
    # must be).
    return jax.shard_map(fn, mesh=tp.mesh, in_specs=in_specs, out_specs=spec,
                         check_vma=syrk_backend(syrk) in (None, "jnp"))(*operands)


def _gathered_iterate(y: jax.Array, schedule, matmul_dtype, axis: str) -> jax.Array:
    """Newton-Schulz on Y [..., c, r] whose rows are split over ``axis`` (this
    rank's [..., c/t, r]): each iteration gathers Y and this rank's rows of the
    Gram, A_i = Y_i Y^T, then B_i = b A_i + c A_i A and Y_i <- a Y_i + B_i Y.
    Normalized as ``iterate`` does (largest entry, then Frobenius norm), from
    the gathered Y; the first Gram in fp32, as there."""
    gather = lambda v: lax.all_gather(v, axis, axis=v.ndim - 2, tiled=True)
    y = y.astype(jnp.float32)
    whole = gather(y)                                                 # [..., c, r]
    peak = jnp.max(jnp.abs(whole), axis=(-2, -1), keepdims=True)
    peak = jnp.where(peak > 0, peak, 1.0)
    y, whole = y / peak, whole / peak
    norm = jnp.sqrt(jnp.sum(whole * whole, axis=(-2, -1), keepdims=True)) + _EPS
    y, whole = y / norm, whole / norm
    for i, (a, b, c) in enumerate(schedule):
        dtype = matmul_dtype if i else jnp.float32
        if i:
            whole = gather(y)
        gram_rows = _matmul(y, jnp.swapaxes(whole, -1, -2), dtype)   # [..., c/t, c]
        poly_rows = b * gram_rows + c * _matmul(gram_rows, gather(gram_rows), matmul_dtype)
        y = a * y + _matmul(poly_rows, whole, matmul_dtype)
    return y


def _distributed_method(method: NSMethod, rows: int, local_cols: int, steps: int,
                        syrk: bool) -> str:
    """The Newton-Schulz variant distributed mode runs on a device's [rows, local_cols]
    columns. The Gram side (rows) is whole on every device, so "auto" compares
    the FLOPs of that local shape, oriented: when the rows are the longer side,
    the Gram iteration never saves (it would need local_cols > 1.5 rows)."""
    if method == "auto" and rows > local_cols:
        return "standard"
    return resolve_method(method, rows, local_cols, steps, syrk)


def _skipping_padding(fn: Callable) -> Callable:
    """``fn`` on a device's slots [R, ...] whose last may be padding (``real`` [R]):
    Newton-Schulz runs on that one only where it holds a matrix."""
    def body(block, real):
        last = lax.cond(real[-1], fn, jnp.zeros_like, block[-1:])
        return last if block.shape[0] == 1 else jnp.concatenate([fn(block[:-1]), last])
    return body
