"""The figures of the `cpu` cost-model preset, measured: matmul FLOP/s per virtual
device with all devices busy, and the per-device bandwidth and fixed cost of
all-gathers and reduce-scatters over all of them.

    python -m experiments.bench_cpu_links [--devices 8] [--small] [--out PATH]

A ring collective over n devices sends (n - 1) / n of the whole per device
(``jmegatron.analysis.cost_model``), so bandwidth = that / time; the fixed cost is
the time of a 4 KB collective. Prints a table and writes JSON to
bench_results/bench_cpu_links.json.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.bench_common import argv, best_time, print_table, write_results

COLUMNS = (("collective", "collective", "s"), ("MB", "MB", ".3f"), ("ms", "ms", ".3f"),
           ("gb_s", "GB/s per device", ".2f"), ("gflop_s", "GFLOP/s per device", ".1f"))


def collective_rows(mesh, sizes_mb) -> list[dict]:
    n = mesh.size
    split = NamedSharding(mesh, P("all"))
    whole = NamedSharding(mesh, P())
    gather = jax.jit(lambda x: x, out_shardings=whole)       # all-gather
    scatter = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=split)  # reduce-scatter
    rows = []
    for mb in sizes_mb:
        elements = int(mb * 1e6 / 4)
        x = jax.device_put(jnp.ones((elements // n * n,), jnp.float32), split)
        stacked = jax.device_put(jnp.ones((n, elements // n * n), jnp.float32),
                                 NamedSharding(mesh, P("all", None)))
        sent = (n - 1) / n * elements * 4
        for kind, fn, arg in (("all-gather", gather, x), ("reduce-scatter", scatter, stacked)):
            seconds = best_time(lambda: fn(arg), repeats=5)
            rows.append({"collective": kind, "MB": mb, "ms": 1e3 * seconds,
                         "gb_s": sent / seconds / 1e9})
    return rows


def matmul_rate(mesh, n: int) -> float:
    sharding = NamedSharding(mesh, P("all"))
    a = jax.device_put(jnp.ones((mesh.size * n, n), jnp.float32), sharding)
    b = jax.device_put(jnp.ones((n, n), jnp.float32), NamedSharding(mesh, P()))
    matmul = jax.jit(lambda a, b: a @ b, out_shardings=sharding)
    seconds = best_time(lambda: matmul(a, b), repeats=5)
    return 2 * n ** 3 / seconds


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--devices", type=int, default=8)
    cli.add_argument("--small", action="store_true",
                     help="collectives of 4 KB and 4 MB, matmuls of 128^3 (shows the script runs)")
    cli.add_argument("--out", default=None)
    return cli


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    jax.config.update("jax_num_cpu_devices", args.devices)
    mesh = jax.make_mesh((args.devices,), ("all",))
    rows = collective_rows(mesh, (0.004, 4) if args.small else (0.004, 4, 64))
    n = 128 if args.small else 512
    rows.append({"collective": f"matmul {n}^3, all devices at once",
                 "gflop_s": matmul_rate(mesh, n) / 1e9})
    print_table(rows, COLUMNS)
    write_results("bench_cpu_links", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
