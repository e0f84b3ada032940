"""LAPACK on 8 virtual CPU devices, with OpenBLAS's default threads and with one.

    python -m experiments.bench_lapack_threads [--small] [--out PATH]

Each device QR-decomposes 12 matrices of 384 x 384 (as SOAP's refresh does,
one at a time), next to 3 matmuls per matrix as a yardstick, in a fresh
process per setting: OPENBLAS_NUM_THREADS is read when OpenBLAS loads.
Why ``experiments`` and the tests set it to 1 (see experiments/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments.bench_common import argv, print_table, write_results

# The child does not import ``experiments``: its __init__ sets the variable.
CHILD = """
import json, time, jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import PartitionSpec as P
mesh = jax.make_mesh((8,), ("d",))
xs = jax.device_put(jax.random.normal(jax.random.key(1), (8 * {count}, {n}, {n})),
                    jax.NamedSharding(mesh, P("d")))
out = dict()
for name, one in (("qr_ms", lambda m: jnp.linalg.qr(m)[0]), ("matmul_ms", lambda m: m @ m @ m @ m)):
    f = jax.jit(jax.shard_map(lambda a: jax.lax.map(one, a), mesh=mesh, in_specs=P("d"),
                              out_specs=P("d")))
    f(xs).block_until_ready()
    start = time.perf_counter()
    for _ in range(3):
        f(xs).block_until_ready()
    out[name] = (time.perf_counter() - start) / 3 * 1e3
print(json.dumps(out))
"""


def measure(threads: str | None, count: int, n: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = threads
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run([sys.executable, "-c", CHILD.format(count=count, n=n)], env=env,
                          capture_output=True, text=True, check=True)
    return {"variant": f"OPENBLAS_NUM_THREADS={threads or 'unset'}",
            **json.loads(done.stdout.strip().splitlines()[-1])}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true",
                        help="2 matrices of 128 x 128 a device (shows the script runs)")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    count, n = (2, 128) if args.small else (12, 384)
    rows = [measure(None, count, n), measure("1", count, n)]
    for row in rows:
        row["qr_vs_unset"] = row["qr_ms"] / rows[0]["qr_ms"]
    print_table(rows, [("variant", "OpenBLAS threads", ""),
                       ("qr_ms", f"8 x {count} QRs ms", ".0f"),
                       ("qr_vs_unset", "vs unset", ".3f"),
                       ("matmul_ms", f"8 x {count} x 3 matmuls ms", ".0f")])
    write_results("bench_lapack_threads", rows, args.out,
                  argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
