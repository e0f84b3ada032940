"""Newton-Schulz orthogonalization: X -> approximately U V^T for X = U S V^T."""

from __future__ import annotations

from typing import Callable, Literal

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

NSMethod = Literal["standard", "gram", "auto"]
NS_METHODS = ("standard", "gram", "auto")
# Gram Newton-Schulz re-forms X and its Gram every GRAM_RESTART iterations.
# Measured with bf16 matmuls (experiments/bench_newton_schulz.py --only
# restarts: 256 x 1024, Gaussian and condition-1e6 inputs, distance to
# standard fp32): at 2 every named set stays within 0.053 (standard bf16:
# 0.030), at 3 deepseekv4 reaches 0.093 and aol 0.025, at 4 deepseekv4
# diverges (|s - 1| ~ 240) and aol reaches 0.099. In fp32 all agree to ~1e-5.
# At 256 x 8192 and 5 steps, restart 2 costs 0.62 of standard's FLOPs, 3 0.44.
GRAM_RESTART = 2


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
            syrk: str | None = None, method: str = "standard",
            restart: int = GRAM_RESTART) -> jax.Array:
    """Newton-Schulz on the rows of x [..., r, c] through the r x r Gram X X^T.

    When the columns are split over devices, ``sum_over_columns`` (a psum) makes
    each Gram whole and ``max_over_columns`` (a pmax) the scale: the scale and
    one Gram per iteration (``method="standard"``) or per restart (``"gram"``,
    see ``gram_iterate``) are then the only communication. The Frobenius norm
    is the square root of the trace of the first Gram, computed in fp32.
    ``syrk`` (a backend of ``jmegatron.optim.kernels.syrk``, or None) computes
    the two symmetric products of each iteration by the SYRK kernel wherever
    its tiles do fewer FLOPs than the plain product; a local Gram is then a
    SYRK before its sum. ``method`` must be resolved (see ``resolve_method``).
    """
    if method not in ("standard", "gram"):
        raise ValueError(f"iterate needs method 'standard' or 'gram', got {method!r}")
    x, gram = _normalize(x, normalization, sum_over_columns, max_over_columns, syrk)
    if method == "gram":
        return gram_iterate(x, gram, schedule, matmul_dtype, sum_over_columns, syrk, restart)
    for i, coeffs in enumerate(schedule):
        x = ns_step(x, coeffs, matmul_dtype, None if i else gram, sum_over_columns, syrk)
    return x


def _normalize(x: jax.Array, normalization: str, sum_over_columns: Reduce,
               max_over_columns: Reduce, syrk: str | None) -> tuple[jax.Array, jax.Array]:
    """(X0, X0 X0^T), both fp32: x scaled to unit Frobenius norm, then by AOL."""
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
    return x, gram


def gram_iterate(x: jax.Array, gram: jax.Array, schedule: list[Coefficients], matmul_dtype,
                 sum_over_columns: Reduce = _local, syrk: str | None = None,
                 restart: int = GRAM_RESTART) -> jax.Array:
    """Gram Newton-Schulz: the iterations of ``schedule`` on x [..., r, c] (fp32,
    normalized) carried out on r x r matrices, ``gram`` = X X^T given.

    Every iteration multiplies X on the left by Z = a I + b A + c A^2, a
    polynomial of A = X X^T, so after k of them X_k = Q X_0 and
    A_k = X_k X_k^T = Z A_{k-1} Z: the loop updates Q and A (r x r) and touches
    X (r x c) only to apply Q. Every ``restart`` iterations X = Q X_0 and its
    Gram are formed anew and Q restarts at I, which bounds how far rounding in
    Q and A can drift. Each segment costs one Gram of X (the first is
    ``gram``) and one product Q X; with columns split over devices, only that
    Gram is summed (``sum_over_columns``): one psum per segment.
    """
    if restart < 1:
        raise ValueError(f"Gram Newton-Schulz needs restart >= 1, got {restart}")
    for start in range(0, len(schedule), restart):
        if start:
            gram = sum_over_columns(_gram(x, matmul_dtype, syrk))
        alpha, rest = _gram_segment(gram, schedule[start:start + restart], matmul_dtype, syrk)
        x = alpha * x + _matmul(rest, x, matmul_dtype)
    return x


def _gram_segment(gram: jax.Array, schedule: list[Coefficients], matmul_dtype,
                  syrk: str | None) -> tuple[float, jax.Array]:
    """Q = alpha I + R with X_L = Q X_0 after the iterations of ``schedule`` from
    A_0 = ``gram``, as (alpha, R fp32). Z = a I + P with P = b A + c A^2
    (``_poly``). The identity parts (alpha = the product of the a's) stay out
    of the low-precision operands, as a X does in ``ns_step``: alpha is Q's
    eigenvalue on the directions of vanishing singular values (the slope at
    0, its largest), so rounding it in bf16 would add noise of that size to
    those directions (measured, deepseekv4 with bf16 at condition 1e6: 0.82
    relative error with Q whole, 0.026 split)."""
    alpha, rest = 1.0, None
    for i, (a, b, c) in enumerate(schedule):
        poly = _poly(gram, b, c, matmul_dtype, syrk)
        if rest is None:                  # Q = Z: no product
            rest = poly
        else:                             # Z Q = a alpha I + a R + alpha P + P R
            rest = a * rest + alpha * poly + _matmul(poly, rest, matmul_dtype)
        alpha *= a
        if i + 1 < len(schedule):         # the segment's last A is never used
            za = a * gram + _matmul(poly, gram, matmul_dtype)
            gram = a * za + _matmul(za, poly, matmul_dtype)     # Z A Z
    return alpha, rest


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
                  matmul_dtype=jnp.float32, syrk: bool | str = False,
                  method: NSMethod = "standard", restart: int = GRAM_RESTART) -> jax.Array:
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

    ``method="gram"`` runs the same iterations on the m x m Gram instead
    (``gram_iterate``), re-forming X every ``restart`` iterations: fewer FLOPs
    when the long side is over 1.5x the short one (see ``ns_flops``), the same
    result in exact arithmetic, and in fp32 to ~1e-5 (relative Frobenius).
    ``"auto"`` picks it exactly where it does fewer FLOPs (``resolve_method``).

    bf16 bound of "gram": each segment applies Q = Z_L ... Z_1 through one bf16
    product, so rounding of relative size u = 2^-8 is amplified by up to Q's
    largest eigenvalue, the product of the segment's a's; the error against
    standard fp32 is about ``u * max over segments of prod(a)`` (0.046 for
    "simple" at restart 2, 0.13 for polar_express's first segment) while that
    stays small, and diverges beyond (deepseekv4 at restart 4). Measured at
    restart 2 (benchmark, Gaussian and ill-conditioned inputs, 128 x 512 to
    256 x 8192): at most 0.063 on every named set, 1.5-3x standard bf16's own
    error, and max |s - 1| at most 0.05 above standard bf16's.

    Args:
      x: a matrix or a stack of matrices [..., m, n], any float dtype.
      steps: the number of iterations; None: the coefficient set's
        ``default_steps`` (5 for "quintic").
      coefficients: the per-iteration (a, b, c): a set's name, tuples or a
        ``CoefficientSet`` (see ``coefficient_set``).
      matmul_dtype: the dtype matmul operands are cast to (accumulation is
        fp32); X itself stays fp32.
      syrk: False: plain matmuls; True: the SYRK kernel where it saves FLOPs,
        on the "auto" backend; a backend name ("pallas", "interpret", "jnp")
        picks one.
      method: "standard", "gram" (iterate on the short side's Gram) or "auto"
        (gram exactly where it does fewer FLOPs).
      restart: for the Gram method, the iterations between re-forming X and
        its Gram (>= 1; default ``GRAM_RESTART``, 2).

    Returns:
      The orthogonalized x, fp32, of x's shape (zero where x is zero).

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
      Zhang, Amsel, Chen & Dao, "Gram Newton-Schulz: A Fast, Hardware-Aware
        Newton-Schulz Algorithm for Muon", 2026
        (dao-ailab.github.io/blog/2026/gram-newton-schulz).
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack [..., m, n], got {x.shape}")
    schedule, normalization = resolve_schedule(coefficients, steps)
    backend = syrk_backend(syrk)
    method = resolve_method(method, *x.shape[-2:], len(schedule), bool(backend), restart)
    tall = x.shape[-2] > x.shape[-1]
    x = jnp.swapaxes(x, -1, -2) if tall else x
    x = iterate(x, schedule, normalization, matmul_dtype, syrk=backend, method=method,
                restart=restart)
    return jnp.swapaxes(x, -1, -2) if tall else x


def resolve_method(method: NSMethod, m: int, n: int, steps: int, syrk: bool = False,
                   restart: int = GRAM_RESTART) -> str:
    """The variant ``method`` runs on an m x n matrix: "standard" or "gram" as
    given; "auto" is "gram" exactly where ``ns_flops`` counts fewer FLOPs for it
    (without SYRK: long side > 1.5 x short side and at least one restart segment
    of two or more steps), else "standard".

    Args:
      method: "standard", "gram" or "auto".
      m, n: the matrix shape (either orientation).
      steps: the number of Newton-Schulz iterations.
      syrk: whether the symmetric products run as SYRK (changes their FLOPs).
      restart: the Gram restart interval.
    """
    if method not in NS_METHODS:
        raise ValueError(f"unknown Newton-Schulz method {method!r}; choose one of {NS_METHODS}")
    if method != "auto":
        return method
    gram = ns_flops(m, n, steps, syrk, "gram", restart)
    return "gram" if gram < ns_flops(m, n, steps, syrk, "standard") else "standard"


def syrk_backend(syrk: bool | str | None) -> str | None:
    """The SYRK backend a ``syrk=`` option asks for (None: plain matmuls)."""
    if syrk is None or syrk is False:
        return None
    return resolve_backend("auto" if syrk is True else syrk)


def ns_flops(m: int, n: int, steps: int, syrk: bool = False, method: NSMethod = "standard",
             restart: int = GRAM_RESTART) -> int:
    """Matmul FLOPs of Newton-Schulz on one m x n matrix (p = min, q = max), as run.

    standard: steps * (4 p^2 q + 2 p^3): per iteration the Gram X X^T (2 p^2 q),
    A A (2 p^3) and B X (2 p^2 q).
    gram (``"auto"`` resolved by ``resolve_method``): the steps fall into
    segments of ``restart`` iterations (the last may be shorter); a segment of
    L iterations costs 4 p^2 q + (8 L - 6) p^3: one Gram of X and one Q X0
    (2 p^2 q each), per iteration A A (2 p^3), and per iteration but its
    first Z Q (2 p^3), but its last Z A Z (4 p^3). With k segments the total
    is 4 k p^2 q + (8 steps - 6 k) p^3, less than standard by
    (steps - k) p^2 (4 q - 6 p): gram saves iff q > 1.5 p and k < steps.

    With ``syrk``, each symmetric product (the Grams of X and A A) counts what
    runs: the SYRK kernel's tiles (``syrk_flops``) where they are fewer than
    the plain product's FLOPs, else the plain product. About steps * (3 p^2 q
    + p^3) for standard and large p (only the lower triangle, but whole
    diagonal tiles and padded rows); never more than without ``syrk``.

    Args:
      m: rows of the matrix (only min(m, n) and max(m, n) matter).
      n: columns of the matrix.
      steps: the number of Newton-Schulz iterations.
      syrk: whether the symmetric products run on the SYRK kernel.
      method: "standard", "gram" or "auto" (resolved by ``resolve_method``).
      restart: the Gram restart interval (``method`` "gram" only).

    Returns:
      The FLOPs (multiply and add counted apart), an int.
    """
    p, q = min(m, n), max(m, n)
    if resolve_method(method, m, n, steps, syrk, restart) == "gram":
        return sum(_gram_segment_flops(p, q, length, syrk)
                   for length in _segments(steps, restart))
    per_step = _product_flops(p, q, syrk) + _product_flops(p, p, syrk) + 2 * p * p * q
    return steps * per_step


def _segments(steps: int, restart: int) -> list[int]:
    """Iterations per Gram segment, as ``gram_iterate`` splits ``steps``."""
    if restart < 1:
        raise ValueError(f"Gram Newton-Schulz needs restart >= 1, got {restart}")
    return [min(restart, steps - start) for start in range(0, steps, restart)]


def _gram_segment_flops(p: int, q: int, length: int, syrk: bool) -> int:
    """FLOPs of one Gram segment: Gram of X, A A each iteration, Z Q and Z A Z
    between iterations, and the final Q X0."""
    plain_square = 2 * p ** 3
    return (_product_flops(p, q, syrk) + 2 * p * p * q + length * _product_flops(p, p, syrk)
            + (length - 1) * 3 * plain_square)
