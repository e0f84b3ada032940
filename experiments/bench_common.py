"""Shared pieces of the benchmark scripts: timing, tables, JSON results."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp


def best_time(fn: Callable[[], object], repeats: int = 3) -> float:
    """Best wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def median_ms(fn, inputs: list, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn(x)`` over every input and repeat, after ``warmup`` calls
    per input (compilation, caches)."""
    for x in inputs * warmup:
        jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        for x in inputs:
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bf16_matmul_rate(n: int, repeats: int = 10) -> float:
    """FLOP/s of one n x n x n bf16 product with fp32 accumulation on random inputs:
    the device's own ceiling for bf16 work (median of ``repeats``)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a: jnp.matmul(a, a, preferred_element_type=jnp.float32))
    return 2 * n ** 3 / (median_ms(mm, [a], repeats, warmup=2) / 1e3)


def add_tables_option(parser: argparse.ArgumentParser, tables: Sequence[str]) -> None:
    """``--only``: a comma list of the benchmark's ``tables`` (default all)."""
    parser.add_argument("--only", default=",".join(tables),
                        help=f"comma list of tables, of {tuple(tables)} (default all)")


def chosen_tables(cli: argparse.ArgumentParser, only: str, tables: Sequence[str]) -> list[str]:
    """``--only``'s tables in the benchmark's order; an unknown one is a usage error."""
    wanted = only.split(",")
    if unknown := set(wanted) - set(tables):
        cli.error(f"unknown tables {sorted(unknown)}; choose from {tuple(tables)}")
    return [name for name in tables if name in wanted]


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> None:
    """Prints ``rows`` with (key, header, format) columns."""
    cells = [[format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns]
             for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def write_results(name: str, rows: list[dict], out: str | None, argv: Sequence[str]) -> Path:
    """bench_results/<name>.json (or ``out``): command, JAX version, devices, rows."""
    path = Path(out or f"bench_results/{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([f"python -m experiments.{name}", *argv]),
              "jax": jax.__version__, "device_kind": jax.devices()[0].device_kind,
              "device_count": jax.device_count(), "rows": rows}
    path.write_text(json.dumps(record, indent=2, default=float))
    print(f"wrote {path}")
    return path


def argv() -> list[str]:
    return sys.argv[1:]
