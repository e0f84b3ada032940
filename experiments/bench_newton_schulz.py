"""Newton-Schulz speed: ours, optax's orthogonalization and a naive loop, side by side.

    python -m experiments.bench_newton_schulz [--small] [--out PATH]

For each shape, times five iterations with the same coefficients in every
variant and reports GFLOP/s of the useful work (ns_flops: 4 p^2 q + 2 p^3 per
iteration) next to the GFLOP/s of one large jnp matmul on the same device,
the local ceiling. The naive variant is the textbook loop run op by op
without jit (B = A X; X = a X + b B + c A B).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import optax

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.optim import newton_schulz, ns_flops

SIMPLE = (3.4445, -4.7750, 2.0315)
STEPS = 5
FULL = [(1, 512, 512), (1, 1024, 4096), (1, 4096, 4096), (8, 1024, 4096)]
SMALL = [(1, 256, 256), (1, 512, 1024), (1, 1024, 1024), (4, 512, 1024)]


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


def main(args_list: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="smaller shapes (about a minute)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(args_list)
    shapes = SMALL if args.small else FULL
    ceiling = matmul_ceiling(1024 if args.small else 4096)
    print(f"matmul ceiling: {ceiling / 1e9:.1f} GFLOP/s ({jax.devices()[0].device_kind})")
    rows = []
    for batch, m, n in shapes:
        x = jax.random.normal(jax.random.key(1), (batch, m, n))
        flops = batch * ns_flops(m, n, STEPS)
        base = None
        for name, fn in variants().items():
            seconds = best_time(lambda: fn(x), repeats=3 if args.small else 2)
            base = base or seconds
            rows.append({"variant": name, "shape": f"{batch}x{m}x{n}", "ms": 1e3 * seconds,
                         "gflops_per_s": flops / seconds / 1e9,
                         "fraction_of_ceiling": flops / seconds / ceiling,
                         "ratio_vs_ours": seconds / base})
    print_table(rows, [("shape", "shape", ""), ("variant", "variant", ""), ("ms", "ms", ".1f"),
                       ("gflops_per_s", "GFLOP/s", ".1f"),
                       ("fraction_of_ceiling", "of ceiling", ".0%"),
                       ("ratio_vs_ours", "time vs ours", ".2f")])
    for row in rows:
        row["ceiling_gflops_per_s"] = ceiling / 1e9
    write_results("bench_newton_schulz", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
