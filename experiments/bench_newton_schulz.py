"""Newton-Schulz speed and accuracy: ours against optax's orthogonalization and a
naive loop; standard against Gram Newton-Schulz; the Gram restart interval.

    python -m experiments.bench_newton_schulz [--small] [--only TABLES] [--out PATH]

TABLES is a comma list of (default all):

  variants  for each shape, times five iterations with the same coefficients in
            every variant and reports GFLOP/s of the useful work (ns_flops:
            4 p^2 q + 2 p^3 per iteration) next to the GFLOP/s of one large
            jnp matmul on the same device, the local ceiling. The naive variant
            is the textbook loop run op by op without jit (B = A X;
            X = a X + b B + c A B).
  methods   square and long shapes, standard and Gram Newton-Schulz (quintic,
            5 steps, fp32 matmuls for the timing): GFLOP/s of the FLOPs each
            runs (ns_flops), FLOPs and time relative to standard, and on a
            Gaussian input max |s - 1| with fp32 and with bf16 matmuls, and the
            bf16 result's distance to standard fp32 (relative Frobenius).
  restarts  per coefficient set and Gram restart interval (1 = the standard
            iteration's arithmetic), with bf16 matmuls: distance to standard
            fp32 and max |s - 1| on a Gaussian and an ill-conditioned
            (condition 1e6) input, next to standard bf16 ("std"), and the FLOPs
            at 256 x 8192 relative to standard: the measurement behind
            GRAM_RESTART.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.bench_common import (add_tables_option, argv, best_time, chosen_tables,
                                      print_table, write_results)
from jmegatron.optim import newton_schulz, ns_flops
from jmegatron.optim.coefficients import coefficient_set

SIMPLE = (3.4445, -4.7750, 2.0315)
STEPS = 5
FULL = [(1, 512, 512), (1, 1024, 4096), (1, 4096, 4096), (8, 1024, 4096)]
SMALL = [(1, 256, 256), (1, 512, 1024), (1, 1024, 1024), (4, 512, 1024)]
METHOD_SHAPES = [(1024, 1024), (512, 4096), (256, 8192)]
METHOD_SHAPES_SMALL = [(512, 512), (256, 2048), (128, 4096)]
RESTART_SETS = ("simple", "quintic", "polar_express", "aol", "deepseekv4")
RESTARTS = (1, 2, 3, 4)
TABLES = ("variants", "methods", "restarts")
NS = jax.jit(newton_schulz, static_argnames=("steps", "coefficients", "matmul_dtype", "method",
                                             "restart"))


def naive(x):
    """The textbook iteration, op by op (no jit), as a reference for the overhead."""
    x = x / jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)
    a, b, c = SIMPLE
    for _ in range(STEPS):
        gram = x @ jnp.swapaxes(x, -1, -2)
        bx = gram @ x
        x = a * x + b * bx + c * gram @ bx
    return x


def variants():
    ours = jax.jit(functools.partial(newton_schulz, steps=STEPS, coefficients=SIMPLE))
    optax_ns = jax.jit(jax.vmap(lambda x: optax.contrib._muon.orthogonalize_via_newton_schulz(
        x, jnp.asarray(SIMPLE), STEPS)))
    return {"ours": ours, "optax": optax_ns, "naive (eager)": naive}


def matmul_ceiling(n: int) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n))
    mm = jax.jit(lambda a: a @ a)
    return 2 * n ** 3 / best_time(lambda: mm(a))


def variants_table(small: bool) -> list[dict]:
    shapes = SMALL if small else FULL
    ceiling = matmul_ceiling(1024 if small else 4096)
    print(f"matmul ceiling: {ceiling / 1e9:.1f} GFLOP/s ({jax.devices()[0].device_kind})")
    rows = []
    for batch, m, n in shapes:
        x = jax.random.normal(jax.random.key(1), (batch, m, n))
        flops = batch * ns_flops(m, n, STEPS)
        base = None
        for name, fn in variants().items():
            seconds = best_time(lambda: fn(x), repeats=3 if small else 2)
            base = base or seconds
            rows.append({"table": "variants", "variant": name, "shape": f"{batch}x{m}x{n}",
                         "ms": 1e3 * seconds, "gflops_per_s": flops / seconds / 1e9,
                         "fraction_of_ceiling": flops / seconds / ceiling,
                         "ratio_vs_ours": seconds / base, "ceiling_gflops_per_s": ceiling / 1e9})
    print_table(rows, [("shape", "shape", ""), ("variant", "variant", ""), ("ms", "ms", ".1f"),
                       ("gflops_per_s", "GFLOP/s", ".1f"),
                       ("fraction_of_ceiling", "of ceiling", ".0%"),
                       ("ratio_vs_ours", "time vs ours", ".2f")])
    return rows


def max_sv_error(x) -> float:
    """max |s - 1| over the singular values of x (float64 SVD)."""
    s = np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)
    return float(np.max(np.abs(s - 1.0)))


def relative_error(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


def methods_table(small: bool) -> list[dict]:
    rows = []
    for m, n in METHOD_SHAPES_SMALL if small else METHOD_SHAPES:
        x = jax.random.normal(jax.random.key(1), (m, n))
        exact = np.asarray(NS(x))
        base = None
        for method in ("standard", "gram"):
            run = functools.partial(NS, method=method)
            seconds = best_time(lambda: run(x), repeats=3 if small else 2)
            base = base or seconds
            flops = ns_flops(m, n, 5, method=method)
            bf16 = run(x, matmul_dtype=jnp.bfloat16)
            rows.append({"table": "methods", "shape": f"{m}x{n}", "method": method,
                         "ms": 1e3 * seconds, "gflops_per_s": flops / seconds / 1e9,
                         "flops_vs_standard": flops / ns_flops(m, n, 5),
                         "time_vs_standard": seconds / base, "sv_error_fp32": max_sv_error(run(x)),
                         "sv_error_bf16": max_sv_error(bf16),
                         "bf16_vs_fp32_standard": relative_error(bf16, exact)})
    print_table(rows, [("shape", "shape", ""), ("method", "method", ""), ("ms", "ms", ".1f"),
                       ("gflops_per_s", "GFLOP/s", ".1f"),
                       ("flops_vs_standard", "FLOPs vs std", ".2f"),
                       ("time_vs_standard", "time vs std", ".2f"),
                       ("sv_error_fp32", "|s-1| fp32", ".3f"),
                       ("sv_error_bf16", "|s-1| bf16", ".3f"),
                       ("bf16_vs_fp32_standard", "bf16 err", ".4f")])
    return rows


def ill_conditioned(m: int, n: int, condition: float, seed: int = 0) -> jax.Array:
    """U diag(s) V^T with s log-spaced from 1 down to 1/condition."""
    rng = np.random.default_rng(seed)
    u = np.linalg.qr(rng.normal(size=(m, m)))[0]
    v = np.linalg.qr(rng.normal(size=(n, m)))[0]
    return jnp.asarray((u * np.logspace(0, -np.log10(condition), m)) @ v.T, jnp.float32)


def restarts_table(small: bool) -> list[dict]:
    m, n = (128, 512) if small else (256, 1024)
    inputs = {"gauss": jax.random.normal(jax.random.key(1), (m, n)),
              "ill": ill_conditioned(m, n, 1e6)}
    rows = []
    for name in RESTART_SETS:
        steps = coefficient_set(name).default_steps
        exact = {key: np.asarray(NS(x, coefficients=name)) for key, x in inputs.items()}
        for restart in ("std", *RESTARTS):
            ns = dict(coefficients=name, matmul_dtype=jnp.bfloat16)
            ns.update({} if restart == "std" else dict(method="gram", restart=restart))
            row = {"table": "restarts", "set": name, "steps": steps, "restart": str(restart),
                   "flops_vs_standard": 1.0 if restart == "std" else
                   ns_flops(256, 8192, steps, method="gram", restart=restart)
                   / ns_flops(256, 8192, steps)}
            for key, x in inputs.items():
                out = NS(x, **ns)
                row[f"{key}_error"] = relative_error(out, exact[key])
                row[f"{key}_sv_error"] = max_sv_error(out)
            rows.append(row)
    print(f"bf16 matmuls, {m}x{n}; err: relative Frobenius distance to standard fp32")
    print_table(rows, [("set", "set", ""), ("steps", "steps", "d"), ("restart", "restart", ""),
                       ("flops_vs_standard", "FLOPs@256x8192", ".2f"),
                       ("gauss_error", "gauss err", ".4f"),
                       ("gauss_sv_error", "gauss |s-1|", ".3f"),
                       ("ill_error", "ill err", ".4f"), ("ill_sv_error", "ill |s-1|", ".3f")])
    return rows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="smaller shapes (a few minutes)")
    add_tables_option(parser, TABLES)
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    cli = parser()
    args = cli.parse_args(args_list)
    tables = chosen_tables(cli, args.only, TABLES)
    builders = {"variants": variants_table, "methods": methods_table, "restarts": restarts_table}
    rows = [row for name in tables for row in builders[name](args.small)]
    write_results("bench_newton_schulz", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
