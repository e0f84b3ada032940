"""Newton-Schulz under tensor parallelism: every mode, side by side.

    python -m experiments.bench_tp_modes [--small] [--out PATH]

For square, 1:4 and 4:1 matrices split over the tensor axis along their
columns (the second dim), at tensor 2, 4 and 8 on 8 devices: time, bytes
each device sends (read from the compiled HLO) and FLOPs per device (XLA's
cost analysis of the partitioned program), with the cost model's formulas
beside them:

  duplicated   bytes (t-1)/t m n 4;            FLOPs steps (4 p^2 q + 2 p^3)
  distributed  bytes steps 2 (t-1)/t r^2 4;    FLOPs steps (4 r^2 c/t + 2 r^3)
               (r = unsplit side, c = split side; plus a scalar pmax)
  gathered     bytes steps (t-1)/t (c r + c^2) 4; FLOPs steps (4 r c^2 + 2 c^3) / t
               (the Gram of the split side c, its row blocks and X gathered)
  blockwise    bytes 0;                         FLOPs of one m x n/t block
  compiler     plain jnp Newton-Schulz on the sharded array, partitioned by XLA
"""

from __future__ import annotations

import argparse
import functools

import jax

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.analysis import hlo_collectives
from jmegatron.optim import TensorParallel, TPCostModel, newton_schulz, tp_newton_schulz
from jmegatron.sharding import MeshConfig, make_mesh

STEPS = 5
FULL = {"square": (1024, 1024), "1:4": (512, 2048), "4:1": (2048, 512)}
SMALL = {"square": (256, 256), "1:4": (128, 512), "4:1": (512, 128)}


def xla_flops(jitted, x) -> float:
    cost = jitted.lower(x).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def measure(t: int, m: int, n: int, mode: str) -> dict:
    mesh = make_mesh(MeshConfig(data=8 // t, fsdp=1, tensor=t))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (1, m, n)),
                       jax.NamedSharding(mesh, jax.P(None, None, "tensor")))
    if mode == "compiler":
        fn = jax.jit(functools.partial(newton_schulz, steps=STEPS))
    else:
        tp = TensorParallel(mesh)
        fn = jax.jit(lambda a: tp_newton_schulz(a, "out", mode, tp, steps=STEPS))
    report = hlo_collectives(fn, x)
    row = {"variant": mode, "tensor": t, "shape": f"{m}x{n}", "ms": 1e3 * best_time(lambda: fn(x)),
           "collectives": report.count(), "bytes_per_device": report.bytes_per_device(),
           "flops_per_device": xla_flops(fn, x)}
    if mode != "compiler":
        _, nbytes, flops = TPCostModel().terms(mode, t, m, n, "out", STEPS)
        row.update(model_bytes=nbytes, model_flops=flops)
    return row


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="smaller shapes (about a minute)")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    jax.config.update("jax_num_cpu_devices", 8)
    rows = []
    for name, (m, n) in (SMALL if args.small else FULL).items():
        for t in (2, 4, 8):
            group = [measure(t, m, n, mode) for mode in
                     ("duplicated", "distributed", "gathered", "blockwise", "compiler")]
            for row in group:
                row["case"] = name
                row["ratio_vs_duplicated"] = row["ms"] / group[0]["ms"]
            rows += group
    print_table(rows, [("case", "case", ""), ("shape", "shape", ""), ("tensor", "t", "d"),
                       ("variant", "mode", ""), ("ms", "ms", ".1f"),
                       ("ratio_vs_duplicated", "vs dup", ".2f"),
                       ("collectives", "colls", "d"), ("bytes_per_device", "bytes/dev", ",.0f"),
                       ("model_bytes", "model bytes", ",.0f"),
                       ("flops_per_device", "FLOPs/dev", ".3g"), ("model_flops", "model FLOPs", ".3g")])
    write_results("bench_tp_modes", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
