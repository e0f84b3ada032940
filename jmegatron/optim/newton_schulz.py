"""Newton-Schulz orthogonalization: X -> approximately U V^T for X = U S V^T."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jmegatron.optim.coefficients import Coefficients, CoefficientSet, coefficient_set

# The input is first scaled by its largest entry, so its Frobenius norm is at
# least 1 and this epsilon never changes a nonzero input: tiny and huge inputs
# stay scale-invariant, and a zero matrix stays zero.
_EPS = 1e-7

Reduce = Callable[[jax.Array], jax.Array]
_local: Reduce = lambda v: v


def _matmul(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """a @ b with operands cast to ``dtype`` and fp32 accumulation."""
    return jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _gram(x: jax.Array, dtype) -> jax.Array:
    """X X^T of a stack [..., r, c], contracting the last axes in place: written as
    ``x @ swapaxes(x)``, XLA:CPU copies a transpose of X every iteration of a
    batched stack (measured 144 vs 190 GFLOP/s on 1 x 1024 x 4096)."""
    x = x.astype(dtype)
    return jnp.einsum("...ij,...kj->...ik", x, x, preferred_element_type=jnp.float32)


def iterate(x: jax.Array, schedule: list[Coefficients], normalization: str, matmul_dtype,
            sum_over_columns: Reduce = _local, max_over_columns: Reduce = _local) -> jax.Array:
    """Newton-Schulz on the rows of x [..., r, c] through the r x r Gram X X^T.

    When the columns are split over devices, ``sum_over_columns`` (a psum) makes
    each Gram whole and ``max_over_columns`` (a pmax) the scale: the scale and
    one Gram per iteration are then the only communication. The Frobenius norm
    is the square root of the trace of the first Gram, computed in fp32.
    """
    x = x.astype(jnp.float32)
    peak = max_over_columns(jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True))
    x = x / jnp.where(peak > 0, peak, 1.0)          # entries in [-1, 1]: no under/overflow
    gram = sum_over_columns(_gram(x, jnp.float32))
    norm = jnp.sqrt(jnp.trace(gram, axis1=-2, axis2=-1))[..., None, None] + _EPS
    x, gram = x / norm, gram / (norm * norm)
    if normalization == "aol":
        # AOL (Prach & Lampert 2022): X <- D^-1/2 X, D = rowsum |X X^T|; spectral norm <= 1.
        s = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=-1), 1e-30))[..., :, None]
        x, gram = x * s, gram * s * jnp.swapaxes(s, -1, -2)
    for i, (a, b, c) in enumerate(schedule):
        if i:
            gram = sum_over_columns(_gram(x, matmul_dtype))
        poly = b * gram + c * _matmul(gram, gram, matmul_dtype)
        x = a * x + _matmul(poly, x, matmul_dtype)
    return x


def resolve_schedule(coefficients, steps: int | None) -> tuple[list[Coefficients], str]:
    """(per-iteration coefficients, normalization) for a set and a step count."""
    cset = coefficient_set(coefficients)
    return cset.schedule(cset.default_steps if steps is None else steps), cset.normalization


def newton_schulz(x: jax.Array, *, steps: int | None = None,
                  coefficients: str | CoefficientSet | tuple = "quintic",
                  matmul_dtype=jnp.float32) -> jax.Array:
    """Orthogonalizes a matrix or a stack of matrices [..., m, n] (fp32 result).

    Each iteration computes A = X X^T, B = b A + c A A, X <- a X + B X on the
    short side (tall inputs are transposed internally). The input is scaled to
    unit Frobenius norm in fp32 before any cast; a zero matrix gives zero.
    ``matmul_dtype=jnp.bfloat16`` runs the matmuls in bf16 with fp32
    accumulation while X stays fp32. ``steps`` defaults to the set's own.

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
    x = iterate(x, schedule, normalization, matmul_dtype)
    return jnp.swapaxes(x, -1, -2) if tall else x


def ns_flops(m: int, n: int, steps: int, syrk: bool = False) -> int:
    """Matmul FLOPs of Newton-Schulz on one m x n matrix (p = min, q = max):
    steps * (4 p^2 q + 2 p^3), or steps * (3 p^2 q + p^3) when the two
    symmetric products compute only one triangle (SYRK)."""
    p, q = min(m, n), max(m, n)
    per_step = 3 * p * p * q + p ** 3 if syrk else 4 * p * p * q + 2 * p ** 3
    return steps * per_step
