"""The SYRK kernel against jnp, side by side: X X^T and one Newton-Schulz step.

    python -m experiments.bench_syrk [--small] [--shapes 4096x16384,...] [--dtype D] [--out PATH]

For each n x k shape and random inputs in ``--dtype``, four variants:
``xxT jnp`` (one einsum, the full product), ``xxT syrk`` (the kernel: lower
tiles only), and one steady-state Newton-Schulz iteration (A = X X^T in the
matmul dtype, B = b A + c A A, X <- a X + B X: ``ns_step``, as ``iterate``
runs every iteration after the first) without and with the kernel, on inputs
scaled to unit Frobenius norm. With the kernel, each product runs on it only
where its tiles do fewer FLOPs than the plain product (as in Newton-Schulz).
Columns: median time over several input sets after a warm-up; time and FLOPs
relative to the jnp variant (FLOPs from the kernel's tile count, on the jnp
backend the full product's); the error against jnp on the same random inputs
(max |diff| / max |jnp|); and, for X X^T, whether the kernel is bitwise equal
to jnp on small-integer inputs (exact products).

The kernel is compiled on GPU. On CPU it runs in Pallas interpret mode, and
small shapes are the default: those times show that the script works, not
how fast the kernel is; interpret mode is many times slower than a compiled
kernel, and CPU XLA's own matmul is the baseline.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_common import argv, median_ms, print_table, write_results
from jmegatron.optim.coefficients import COEFFICIENT_SETS
from jmegatron.optim.kernels import DEFAULT_BLOCK, DEFAULT_BLOCK_K, resolve_backend, syrk, \
    syrk_flops
from jmegatron.optim.newton_schulz import ns_flops, ns_step

FULL = [(1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (4096, 16384)]
SMALL = [(128, 512), (256, 256), (256, 1024)]
STEP = COEFFICIENT_SETS["quintic"].steps[0]     # one iteration's (a, b, c)


def variants(backend: str, dtype, block: int, block_k: int) -> dict:
    """name -> (jitted fn, FLOPs(n, k), baseline name). The syrk rows count the
    kernel's tiles, except on the jnp backend (the full product)."""
    kernel = functools.partial(syrk, backend=backend, block=block, block_k=block_k,
                               out_dtype=jnp.float32)
    tiles = backend != "jnp"
    gram = lambda x: jnp.einsum("ik,jk->ij", x, x, preferred_element_type=jnp.float32)
    step = lambda x, s: ns_step(x.astype(jnp.float32), STEP, dtype, syrk=s)
    return {
        "xxT jnp": (jax.jit(gram), lambda n, k: 2 * n * n * k, "xxT jnp"),
        f"xxT syrk ({backend})": (jax.jit(kernel), lambda n, k: syrk_flops(
            n, k, 1, block, block_k) if tiles else 2 * n * n * k, "xxT jnp"),
        "NS step jnp": (jax.jit(lambda x: step(x, None)), lambda n, k: ns_flops(n, k, 1),
                        "NS step jnp"),
        f"NS step syrk ({backend})": (jax.jit(lambda x: step(x, backend)),
                                      lambda n, k: ns_flops(n, k, 1, syrk=tiles), "NS step jnp"),
    }


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def bench_shape(n: int, k: int, fns: dict, dtype, sets: int, repeats: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(n * 7919 + k), sets)
    unit = lambda x: x / jnp.linalg.norm(x)   # spectral norm <= 1, like NS iterates
    inputs = [unit(jax.random.normal(key, (n, k), jnp.float32)).astype(dtype) for key in keys]
    integers = jax.random.randint(keys[0], (n, k), -3, 4).astype(dtype)
    rows, results = [], {}
    for name, (fn, flops, base) in fns.items():
        ms = median_ms(fn, inputs, repeats)
        results[name] = (ms, flops(n, k), fn(inputs[0]))
        base_ms, base_flops, base_out = results[base]
        row = {"shape": f"{n}x{k}", "variant": name, "ms": ms, "time_vs_jnp": ms / base_ms,
               "gflop": flops(n, k) / 1e9, "flops_vs_jnp": flops(n, k) / base_flops,
               "err_vs_jnp": relative_error(results[name][2], base_out)}
        if name.startswith("xxT"):   # small integers: exact products, so bitwise equal
            row["exact_int"] = bool(np.array_equal(fn(integers), fns[base][0](integers)))
        rows.append(row)
    return rows


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes (default on CPU)")
    parser.add_argument("--shapes", default=None, help="n x k list, e.g. 4096x16384,2048x2048")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--backend", default="auto", help="auto: compiled on GPU, interpret "
                        "elsewhere; jnp: the plain product in the syrk rows")
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK,
                        help="tile rows of the xxT syrk row (NS steps use the default)")
    parser.add_argument("--block-k", type=int, default=DEFAULT_BLOCK_K)
    parser.add_argument("--sets", type=int, default=3, help="random input sets per shape")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per input set")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    backend = resolve_backend(args.backend)
    if args.backend == "auto" and backend == "jnp":     # the kernel, not jnp again
        backend = "interpret"
    shapes = (parse_shapes(args.shapes) if args.shapes
              else SMALL if args.small or backend == "interpret" else FULL)
    dtype = jnp.dtype(args.dtype)
    print(f"{jax.devices()[0].device_kind}: syrk backend {backend}, {args.dtype}, block "
          f"{args.block}x{args.block_k}, median of {args.sets} sets x {args.repeats} calls")
    fns = variants(backend, dtype, args.block, args.block_k)
    rows = [row for n, k in shapes
            for row in bench_shape(n, k, fns, dtype, args.sets, args.repeats)]
    print_table(rows, [("shape", "shape", ""), ("variant", "variant", ""), ("ms", "ms", ".3f"),
                       ("time_vs_jnp", "time/jnp", ".2f"), ("gflop", "GFLOP", ".3f"),
                       ("flops_vs_jnp", "FLOPs/jnp", ".3f"), ("err_vs_jnp", "err/jnp", ".1e"),
                       ("exact_int", "exact int", "")])
    write_results("bench_syrk", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
