"""Newton-Schulz orthogonalization: X -> approximately U V^T for X = U S V^T."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jmegatron.optim import kernels
from jmegatron.optim.coefficients import Coefficients, CoefficientSet, coefficient_set
from jmegatron.optim.kernels import resolve_backend, syrk_flops

# The input is first scaled by its largest entry, so its Frobenius norm is at
# least 1 and this epsilon never changes a nonzero input: tiny and huge inputs
# stay scale-invariant, and a zero matrix stays zero.
_EPS = 1e-7

Reduce = Callable[[jax.Array], jax.Array]
_local: Reduce = lambda v: v


def _matmul(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """a @ b with operands cast to ``dtype`` and fp32 accumulation."""
    return jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _gram(x: jax.Array, dtype, syrk: str | None = None) -> jax.Array:
    """X X^T of a stack [..., r, c], contracting the last axes in place: written as
    ``x @ swapaxes(x)``, XLA:CPU copies a transpose of X every iteration of a
    batched stack (measured 144 vs 190 GFLOP/s on 1 x 1024 x 4096). With a
    ``syrk`` backend, by the SYRK kernel (lower-triangle tiles only) where that
    saves FLOPs."""
    x = x.astype(dtype)
    if syrk and _kernel_saves(*x.shape[-2:]):
        return kernels.syrk(x, backend=syrk, out_dtype=jnp.float32)
    return jnp.einsum("...ij,...kj->...ik", x, x, preferred_element_type=jnp.float32)


def _poly(gram: jax.Array, b: float, c: float, dtype, syrk: str | None = None) -> jax.Array:
    """b A + c A A for the symmetric Gram A (fp32). A A = A A^T, so SYRK applies,
    with b A added to each tile as it is stored (``beta * c`` with c = A)."""
    if syrk and _kernel_saves(*gram.shape[-2:]):
        return kernels.syrk(gram.astype(dtype), gram, alpha=c, beta=b, backend=syrk,
                            out_dtype=jnp.float32)
    return b * gram + c * _matmul(gram, gram, dtype)


def _kernel_saves(n: int, k: int) -> bool:
    """Whether the SYRK kernel's tiles do fewer FLOPs than the plain product
    (2 n^2 k) of an [n, k] operand. Whole diagonal tiles and padding to the
    128-row tile grid can cost more than the upper triangle saves: p = 136 pads
    to 2 x 2 tiles (3.2x the plain X X^T at q = 264), and any single tile
    (p <= 128) is never cheaper. There the plain product runs."""
    return syrk_flops(n, k) < 2 * n * n * k


def _product_flops(n: int, k: int, syrk: bool) -> int:
    """FLOPs of a symmetric product of an [n, k] operand as ``_gram``/``_poly`` run
    it: the kernel's tiles where it saves, else the plain 2 n^2 k."""
    plain = 2 * n * n * k
    return min(syrk_flops(n, k), plain) if syrk else plain


def iterate(x: jax.Array, schedule: list[Coefficients], normalization: str, matmul_dtype,
            sum_over_columns: Reduce = _local, max_over_columns: Reduce = _local,
            syrk: str | None = None) -> jax.Array:
    """Newton-Schulz on the rows of x [..., r, c] through the r x r Gram X X^T.

    When the columns are split over devices, ``sum_over_columns`` (a psum) makes
    each Gram whole and ``max_over_columns`` (a pmax) the scale: the scale and
    one Gram per iteration are then the only communication. The Frobenius norm
    is the square root of the trace of the first Gram, computed in fp32.
    ``syrk`` (a backend of ``jmegatron.optim.kernels.syrk``, or None) computes
    the two symmetric products of each iteration by the SYRK kernel wherever
    its tiles do fewer FLOPs than the plain product; a local Gram is then a
    SYRK before its sum.
    """
    x = x.astype(jnp.float32)
    peak = max_over_columns(jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True))
    x = x / jnp.where(peak > 0, peak, 1.0)          # entries in [-1, 1]: no under/overflow
    gram = sum_over_columns(_gram(x, jnp.float32, syrk))
    norm = jnp.sqrt(jnp.trace(gram, axis1=-2, axis2=-1))[..., None, None] + _EPS
    x, gram = x / norm, gram / (norm * norm)
    if normalization == "aol":
        # AOL (Prach & Lampert 2022): X <- D^-1/2 X, D = rowsum |X X^T|; spectral norm <= 1.
        s = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=-1), 1e-30))[..., :, None]
        x, gram = x * s, gram * s * jnp.swapaxes(s, -1, -2)
    for i, coeffs in enumerate(schedule):
        x = ns_step(x, coeffs, matmul_dtype, None if i else gram, sum_over_columns, syrk)
    return x


def ns_step(x: jax.Array, coeffs: Coefficients, matmul_dtype, gram: jax.Array | None = None,
            sum_over_columns: Reduce = _local, syrk: str | None = None) -> jax.Array:
    """One iteration X <- a X + (b A + c A A) X on x [..., r, c] (fp32), with
    A = X X^T in ``matmul_dtype`` (summed over columns) unless ``gram`` is given:
    ``iterate`` passes the first iteration's fp32 normalization Gram."""
    a, b, c = coeffs
    if gram is None:
        gram = sum_over_columns(_gram(x, matmul_dtype, syrk))
    poly = _poly(gram, b, c, matmul_dtype, syrk)
    return a * x + _matmul(poly, x, matmul_dtype)


def resolve_schedule(coefficients, steps: int | None) -> tuple[list[Coefficients], str]:
    """(per-iteration coefficients, normalization) for a set and a step count."""
    cset = coefficient_set(coefficients)
    return cset.schedule(cset.default_steps if steps is None else steps), cset.normalization


def newton_schulz(x: jax.Array, *, steps: int | None = None,
                  coefficients: str | CoefficientSet | tuple = "quintic",
                  matmul_dtype=jnp.float32, syrk: bool | str = False) -> jax.Array:
    """Orthogonalizes a matrix or a stack of matrices [..., m, n] (fp32 result).

    Each iteration computes A = X X^T, B = b A + c A A, X <- a X + B X on the
    short side (tall inputs are transposed internally). The input is scaled to
    unit Frobenius norm in fp32 before any cast; a zero matrix gives zero.
    ``matmul_dtype=jnp.bfloat16`` runs the matmuls in bf16 with fp32
    accumulation while X stays fp32. ``steps`` defaults to the set's own.
    ``syrk=True`` computes A and B by the SYRK kernel where it saves FLOPs
    (``auto`` backend: the compiled Pallas kernel on GPU, jnp elsewhere), B as
    ``syrk(A, c=A, alpha=c, beta=b)`` since A is symmetric; a backend name
    ("pallas", "interpret", "jnp") picks one.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural
        networks", 2024 (kellerjordan.github.io/posts/muon).
      Amsel et al., "The Polar Express: Optimal Matrix Sign Methods and Their
        Application to the Muon Algorithm", arXiv:2505.16932, 2025.
      Grishina et al., "Accelerating Newton-Schulz Iteration for
        Orthogonalization via Chebyshev-type Polynomials" (CANS),
        arXiv:2506.10935, 2025.
      Boissin et al., "Turbo-Muon: Accelerating Orthogonality-Based
        Optimization with Pre-Conditioning", arXiv:2512.04632, 2025.
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack [..., m, n], got {x.shape}")
    schedule, normalization = resolve_schedule(coefficients, steps)
    tall = x.shape[-2] > x.shape[-1]
    x = jnp.swapaxes(x, -1, -2) if tall else x
    x = iterate(x, schedule, normalization, matmul_dtype, syrk=syrk_backend(syrk))
    return jnp.swapaxes(x, -1, -2) if tall else x


def syrk_backend(syrk: bool | str | None) -> str | None:
    """The SYRK backend a ``syrk=`` option asks for (None: plain matmuls)."""
    if syrk is None or syrk is False:
        return None
    return resolve_backend("auto" if syrk is True else syrk)


def ns_flops(m: int, n: int, steps: int, syrk: bool = False) -> int:
    """Matmul FLOPs of Newton-Schulz on one m x n matrix (p = min, q = max):
    steps * (4 p^2 q + 2 p^3). With ``syrk``, each of the two symmetric
    products counts what runs: the SYRK kernel's tiles (``syrk_flops``) where
    they are fewer than the plain product's FLOPs, else the plain product.
    About steps * (3 p^2 q + p^3) for large p (only the lower triangle, but
    whole diagonal tiles and padded rows); never more than without ``syrk``."""
    p, q = min(m, n), max(m, n)
    per_step = _product_flops(p, q, syrk) + _product_flops(p, p, syrk) + 2 * p * p * q
    return steps * per_step
