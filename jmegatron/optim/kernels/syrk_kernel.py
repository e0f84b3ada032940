"""SYRK: alpha * A A^T + beta * C computing only the lower-triangle tiles.

A A^T is symmetric, so half of a plain matmul's work is redundant. The n x n
output is cut into T x T tiles of ``block`` rows; one Pallas program computes
one tile (i, j) with j <= i, T (T + 1) / 2 programs in all, and stores it at
(i, j) and, transposed, at (j, i). Each program loops over the contraction
dimension in chunks of ``block_k`` and accumulates in fp32 (bf16 inputs too).

Both operand refs are whole matrices (one batch element each) and programs
slice their rows with ``pl.ds``: on GPU these are plain pointers into global
memory, and a program writes two output tiles, which no BlockSpec can express.
On TPU the whole matrix would have to fit in VMEM, so this kernel is meant for
GPU (Triton) and for interpret mode; TPU is neither tuned nor tested.

Backends: ``pallas`` (compiled), ``interpret`` (Pallas interpret mode, what CPU
tests use: slow), ``jnp`` (one einsum, the full product), and ``auto``:
``pallas`` on GPU, ``jnp`` elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

Backend = Literal["auto", "pallas", "interpret", "jnp"]
BACKENDS = ("auto", "pallas", "interpret", "jnp")
DEFAULT_BLOCK = 128      # output tile rows: Triton wants powers of two
DEFAULT_BLOCK_K = 64     # contraction chunk per loop step
_MIN_TILE = 16           # Triton's dot needs at least 16 along every dim


def _pow2_at_least(n: int) -> int:
    return max(_MIN_TILE, 1 << max(n - 1, 0).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class SyrkPlan:
    """The tiling of one n x n output from an n x k operand: everything the
    kernel launches follows from it, and so does its FLOP count."""

    n: int
    k: int
    block: int        # tile side b (<= the requested block for small n)
    block_k: int      # contraction chunk

    @property
    def tiles_per_side(self) -> int:
        return -(-self.n // self.block)

    @property
    def programs(self) -> int:
        """Programs per matrix: the lower-triangle tiles, diagonal included."""
        t = self.tiles_per_side
        return t * (t + 1) // 2

    @property
    def n_pad(self) -> int:
        return self.tiles_per_side * self.block

    @property
    def k_pad(self) -> int:
        return _round_up(self.k, self.block_k)

    def flops(self, batch: int = 1) -> int:
        """FLOPs the programs execute (padding and whole diagonal tiles included)."""
        return batch * self.programs * 2 * self.block * self.block * self.k_pad


def syrk_plan(n: int, k: int, block: int = DEFAULT_BLOCK,
              block_k: int = DEFAULT_BLOCK_K) -> SyrkPlan:
    """Tiles for an [n, k] operand; tiles shrink to the next power of two >= n
    (or k) so that a small matrix is not padded up to a whole 128-block."""
    for name, v in (("block", block), ("block_k", block_k)):
        if v < _MIN_TILE or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two >= {_MIN_TILE}")
    return SyrkPlan(n, k, min(block, _pow2_at_least(n)), min(block_k, _pow2_at_least(k)))


def syrk_flops(n: int, k: int, batch: int = 1, block: int = DEFAULT_BLOCK,
               block_k: int = DEFAULT_BLOCK_K) -> int:
    """FLOPs of ``syrk`` on a [batch, n, k] operand, from the kernel's tile count
    (compare 2 n^2 k for the full product)."""
    return syrk_plan(n, k, block, block_k).flops(batch)


def tile_of(t):
    """(i, j), j <= i, of the t-th lower-triangle tile in row-major order, i.e.
    t = i (i + 1) / 2 + j. The float square root can land one off near perfect
    squares; the two integer tests put i back."""
    t = jnp.asarray(t, jnp.int32)
    i = jnp.floor((jnp.sqrt(8.0 * t.astype(jnp.float32) + 1.0) - 1.0) / 2.0).astype(jnp.int32)
    tri = lambda r: lax.div(r * (r + 1), 2)
    i = lax.select(tri(i) > t, i - 1, i)
    i = lax.select(tri(i + 1) <= t, i + 1, i)
    return i, t - tri(i)


def resolve_backend(backend: str = "auto", interpret: bool | None = None) -> str:
    """The concrete backend: ``interpret=True`` forces interpret mode; ``auto``
    compiles only on GPU (the Triton lowering this kernel is written for)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown syrk backend {backend!r}; one of {BACKENDS}")
    if interpret:
        return "interpret"
    if backend == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "jnp"
    return backend


def _kernel(*refs, plan: SyrkPlan, alpha: float, beta: float, has_c: bool, mirror: bool,
            precision):
    a_ref, o_ref = refs[0], refs[-1]          # [n_pad, k_pad], [n_pad, n_pad]
    b, bk = plan.block, plan.block_k
    i, j = tile_of(pl.program_id(1))
    rows = pl.ds(pl.multiple_of(i * b, b), b)
    cols = pl.ds(pl.multiple_of(j * b, b), b)

    def step(kk, acc):
        ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
        # Contract the last dims of both row blocks: A_i A_j^T without a transpose copy.
        return acc + lax.dot_general(a_ref[rows, ks], a_ref[cols, ks], (((1,), (1,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, plan.k_pad // bk, step, jnp.zeros((b, b), jnp.float32))
    tile = acc if alpha == 1.0 else alpha * acc
    if has_c:
        tile = tile + beta * refs[1][rows, cols].astype(jnp.float32)
    tile = tile.astype(o_ref.dtype)
    o_ref[rows, cols] = tile
    if mirror:
        @pl.when(i != j)            # a diagonal tile is its own mirror: store it once
        def _():
            o_ref[cols, rows] = tile.T


def _compiler_params(itemsize: int):
    """Triton launch settings on GPU (None elsewhere): 8 warps for 128 x 128 tiles;
    fewer pipeline stages for fp32, whose chunks take twice the shared memory."""
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return None
    from jax.experimental.pallas import triton as plt
    return plt.CompilerParams(num_warps=8, num_stages=3 if itemsize <= 2 else 2)


def syrk_call(a, c=None, *, plan: SyrkPlan, alpha=1.0, beta=0.0, out_dtype=jnp.float32,
              interpret=False, precision=None, mirror=True, poison=None):
    """The ``pallas_call`` on padded operands a [B, n_pad, k_pad], c [B, n_pad, n_pad].
    ``mirror=False`` skips the transposed stores and ``poison`` pre-fills the output
    (aliased in): together they let tests see which elements the kernel writes."""
    batch = a.shape[0]
    whole = lambda rows, cols: pl.BlockSpec((pl.Squeezed(), rows, cols), lambda b, t: (b, 0, 0))
    operands, in_specs = [a], [whole(plan.n_pad, plan.k_pad)]
    if c is not None:
        operands.append(c)
        in_specs.append(whole(plan.n_pad, plan.n_pad))
    aliases = {}
    if poison is not None:
        aliases = {len(operands): 0}
        operands.append(jnp.full((batch, plan.n_pad, plan.n_pad), poison, out_dtype))
        in_specs.append(whole(plan.n_pad, plan.n_pad))
    kernel = functools.partial(_kernel, plan=plan, alpha=alpha, beta=beta, has_c=c is not None,
                               mirror=mirror, precision=precision)
    if poison is not None:      # the aliased poison input is never read
        kernel = functools.partial(_drop_input, kernel, len(operands) - 1)
    out_bytes = batch * plan.n_pad ** 2 * jnp.dtype(out_dtype).itemsize
    return pl.pallas_call(
        kernel, grid=(batch, plan.programs),
        out_shape=jax.ShapeDtypeStruct((batch, plan.n_pad, plan.n_pad), out_dtype),
        in_specs=in_specs, out_specs=whole(plan.n_pad, plan.n_pad),
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=None if interpret else _compiler_params(a.dtype.itemsize),
        cost_estimate=pl.CostEstimate(flops=plan.flops(batch), transcendentals=0,
                                      bytes_accessed=a.nbytes + out_bytes),
        name="syrk")(*operands)


def _drop_input(kernel, index, *refs):
    return kernel(*refs[:index], *refs[index + 1:])


def syrk(a: jax.Array, c: jax.Array | None = None, *, alpha: float = 1.0, beta: float = 0.0,
         block: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK_K,
         interpret: bool | None = None, backend: Backend = "auto", out_dtype=None,
         precision=None) -> jax.Array:
    """``alpha * a @ a^T + beta * c`` for a [..., n, k] (c [..., n, n] symmetric).

    Only lower-triangle tiles are computed and each is mirrored on store, so
    the result is exactly symmetric; every element is written. Products
    accumulate in fp32; the result has ``out_dtype`` (default ``a.dtype``).
    ``alpha`` and ``beta`` are Python floats (baked into the kernel). Shapes
    that do not divide the tiles are zero-padded; leading dims are a batch.
    ``backend``: "pallas", "interpret", "jnp" or "auto" (see the module doc);
    ``interpret=True`` is the same as ``backend="interpret"``.

    References:
      Dongarra et al., "A Set of Level 3 Basic Linear Algebra Subprograms",
        ACM TOMS 16(1), 1990 (the SYRK routine).
      Tillet, Kung & Cox, "Triton: An Intermediate Language and Compiler for
        Tiled Neural Network Computations", MAPL 2019.
    """
    if a.ndim < 2:
        raise ValueError(f"syrk needs [..., n, k], got {a.shape}")
    *lead, n, k = a.shape
    if c is not None and c.shape != (*lead, n, n):
        raise ValueError(f"c must have shape {(*lead, n, n)}, got {c.shape}")
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    backend = resolve_backend(backend, interpret)
    if backend == "jnp":
        return _syrk_jnp(a, c, alpha, beta, out_dtype, precision)
    plan = syrk_plan(n, k, block, block_k)
    a3 = _pad(a.reshape(-1, n, k), plan.n_pad, plan.k_pad)
    c3 = None if c is None else _pad(c.reshape(-1, n, n), plan.n_pad, plan.n_pad)
    out = syrk_call(a3, c3, plan=plan, alpha=alpha, beta=beta, out_dtype=out_dtype,
                    interpret=backend == "interpret", precision=precision)
    return out[:, :n, :n].reshape(*lead, n, n)


def _pad(x, rows: int, cols: int):
    """Zero rows and columns up to the tile grid: zeros add nothing to A A^T."""
    extra = ((0, 0), (0, rows - x.shape[1]), (0, cols - x.shape[2]))
    return x if not any(e for _, e in extra) else jnp.pad(x, extra)


def _syrk_jnp(a, c, alpha, beta, out_dtype, precision):
    """The full product as one einsum (contracting last dims: no transpose copy)."""
    out = jnp.einsum("...ik,...jk->...ij", a, a, precision=precision,
                     preferred_element_type=jnp.float32)
    out = out if alpha == 1.0 else alpha * out
    if c is not None:
        out = out + beta * c.astype(jnp.float32)
    return out.astype(out_dtype)
