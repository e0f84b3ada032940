"""Newton-Schulz on an accelerator: throughput per method and dtype against the
device's own matmul rate and optax, and stacked calls against loops.

    python -m experiments.bench_ns_kernels [--small] [--only TABLES] [--syrk BACKEND] [--out PATH]

TABLES is a comma list of (default all):

  throughput  per shape and matmul dtype (bf16, fp32): standard Newton-Schulz,
              standard with the SYRK kernel, Gram Newton-Schulz (where it does
              fewer FLOPs: the long side over 1.5x the short one), and
              optax.contrib.muon's Newton-Schulz on the same input in the same
              dtype; five quintic iterations each. Columns: median time; the
              useful TFLOP/s (standard Newton-Schulz's matmul FLOPs, ``ns_flops``,
              over the time, whatever the method ran); that as a share of the
              bf16 matmul rate measured on the same device (one N^3 product,
              N = 8192; 1024 with --small); time against standard.
  stacked     many equal matrices (64 of 1024^2, an MoE-like 128 of 768 x 2048):
              one stacked call against a loop of single-matrix calls (one jit,
              called per matrix, as a per-expert loop would) and against one
              matrix of about the same total FLOPs and the same aspect.

Timing: a warm-up call per input, then the median over ``--repeats`` (10) timed
calls on each of three inputs, each ended by ``block_until_ready``. On CPU the
SYRK kernel runs in interpret mode (use --small): such times show the script
works, not how fast anything is. ``experiments/gpu_kernels.sh`` runs this on a
GPU together with the SYRK tests, bench_syrk and the Gram accuracy tables.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import optax

from experiments.bench_common import (add_tables_option, argv, bf16_matmul_rate,
                                      chosen_tables, median_ms, print_table, write_results)
from jmegatron.optim import newton_schulz, ns_flops
from jmegatron.optim.coefficients import coefficient_set
from jmegatron.optim.newton_schulz import resolve_method

STEPS = 5
SHAPES = {False: [(4096, 4096), (8192, 8192), (4096, 16384)],
          True: [(256, 256), (128, 512)]}
STACKS = {False: [(64, 1024, 1024), (128, 768, 2048)], True: [(8, 128, 128), (8, 96, 256)]}
MATMUL_N = {False: 8192, True: 1024}
TABLES = ("throughput", "stacked")
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def timed(what: str, fn, xs: list, repeats: int) -> float | None:
    """``median_ms``, or None after one line if the variant fails (a kernel that does
    not compile leaves the other rows of a GPU run)."""
    try:
        return median_ms(fn, xs, repeats)
    except Exception as err:
        print(f"{what}: failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        return None


def inputs(shape: tuple[int, ...], dtype=jnp.float32, count: int = 3) -> list[jax.Array]:
    return [jax.random.normal(jax.random.key(seed), shape, dtype) for seed in range(count)]


def methods(dtype, syrk: str) -> dict:
    """name -> jitted Newton-Schulz of one matrix or stack, in the matmul dtype."""
    ours = lambda **kw: jax.jit(functools.partial(newton_schulz, steps=STEPS,
                                                  coefficients="quintic", matmul_dtype=dtype, **kw))
    # optax orthogonalizes one matrix in the dtype of its input, with a constant
    # coefficient triple: quintic's, as ours runs with one set for every step.
    abc = jnp.asarray(coefficient_set("quintic").steps[0])
    optax_ns = jax.jit(lambda x: optax.contrib._muon.orthogonalize_via_newton_schulz(
        x.astype(dtype), abc, STEPS))
    return {"standard": ours(), "syrk": ours(syrk=syrk), "gram": ours(method="gram"),
            "optax": optax_ns}


def throughput_table(small: bool, syrk: str, repeats: int) -> list[dict]:
    rate = bf16_matmul_rate(MATMUL_N[small], repeats)
    print(f"bf16 matmul rate ({MATMUL_N[small]}^3): {rate / 1e12:.1f} TFLOP/s "
          f"({jax.devices()[0].device_kind})")
    rows = []
    for m, n in SHAPES[small]:
        useful = ns_flops(m, n, STEPS)
        xs = inputs((m, n))
        for dtype_name, dtype in DTYPES.items():
            base = None
            for name, fn in methods(dtype, syrk).items():
                if name == "gram" and resolve_method("auto", m, n, STEPS) != "gram":
                    continue   # no FLOPs saved on this shape: the standard row is the one
                ms = timed(f"{m}x{n} {dtype_name} {name}", fn, xs, repeats)
                if ms is None:
                    continue
                base = base or ms
                rows.append({"table": "throughput", "shape": f"{m}x{n}", "dtype": dtype_name,
                             "variant": name, "ms": ms, "useful_tflops": useful / ms / 1e9,
                             "of_matmul_rate": useful / (ms / 1e3) / rate,
                             "time_vs_standard": ms / base, "matmul_tflops": rate / 1e12})
    print_table(rows, [("shape", "shape", ""), ("dtype", "dtype", ""),
                       ("variant", "variant", ""), ("ms", "ms", ".2f"),
                       ("useful_tflops", "useful TFLOP/s", ".1f"),
                       ("of_matmul_rate", "of matmul", ".0%"),
                       ("time_vs_standard", "time vs std", ".2f")])
    return rows


def same_flops_matrix(batch: int, m: int, n: int) -> tuple[int, int]:
    """One matrix of m x n's aspect whose Newton-Schulz FLOPs are about ``batch``
    times one m x n's (FLOPs grow as the cube of the scale), sides multiples of 64."""
    scale = batch ** (1 / 3)
    side = lambda s: max(64, round(s * scale / 64) * 64)
    return side(m), side(n)


def stacked_table(small: bool, repeats: int) -> list[dict]:
    ns = jax.jit(functools.partial(newton_schulz, steps=STEPS, coefficients="quintic",
                                   matmul_dtype=jnp.bfloat16))
    rows = []
    for batch, m, n in STACKS[small]:
        stacks = inputs((batch, m, n))
        flops = batch * ns_flops(m, n, STEPS)
        big_m, big_n = same_flops_matrix(batch, m, n)
        variants = {
            "stacked": (lambda x: ns(x), stacks, flops),
            "loop": (lambda x: [ns(x[i]) for i in range(batch)], stacks, flops),
            f"one {big_m}x{big_n}": (ns, inputs((big_m, big_n)), ns_flops(big_m, big_n, STEPS)),
        }
        base = None
        for name, (fn, xs, work) in variants.items():
            ms = timed(f"{batch} x {m}x{n} {name}", fn, xs, repeats)
            if ms is None:
                continue
            base = base or ms
            rows.append({"table": "stacked", "batch": f"{batch} x {m}x{n}", "variant": name,
                         "ms": ms, "tflops": work / ms / 1e9, "time_vs_stacked": ms / base})
    print("bf16 matmuls, quintic, 5 iterations")
    print_table(rows, [("batch", "matrices", ""), ("variant", "variant", ""),
                       ("ms", "ms", ".2f"), ("tflops", "TFLOP/s", ".2f"),
                       ("time_vs_stacked", "time vs stacked", ".2f")])
    return rows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes (CPU, about a minute)")
    add_tables_option(parser, TABLES)
    parser.add_argument("--syrk", default="auto",
                        help="SYRK backend: auto (the compiled kernel on GPU), pallas, "
                             "interpret or jnp")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per input")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    cli = parser()
    args = cli.parse_args(args_list)
    tables = chosen_tables(cli, args.only, TABLES)
    if args.repeats < 1:
        cli.error(f"--repeats {args.repeats}: must be >= 1")
    builders = {"throughput": lambda: throughput_table(args.small, args.syrk, args.repeats),
                "stacked": lambda: stacked_table(args.small, args.repeats)}
    rows = [row for name in tables for row in builders[name]()]
    write_results("bench_ns_kernels", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
