"""What checkpoint integrity costs: checksums next to orbax's own save and restore.

    python -m experiments.bench_checkpoint [--small] [--mb 512] [--out PATH]

A train-state-like tree of fp32 arrays (``--mb`` in all, sharded over 8 virtual
CPU devices) is written to and read from a temporary folder, synchronously:

- ``checksum``: the checksums of every leaf (``jmegatron.train.checksum``), as a
  save computes them before writing and a restore after reading;
- ``orbax save`` / ``orbax restore``: orbax alone, without checksums;
- ``save`` / ``restore``: ``Checkpointer`` (checksums included), and ``save + read
  back``: a save with its verification (``--checkpoint.verify``, the default: the
  checkpoint is read again and its checksums compared).

Each row reports the best of three in milliseconds, MB/s of the state, and the
ratio to orbax's save. Absolute speeds depend on the disk and on 2 shared cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from experiments.bench_common import argv, print_table, write_results  # noqa: E402
from jmegatron.train.checkpoint import (CheckpointConfig, Checkpointer, LeafCodec,  # noqa: E402
                                        abstract_of)
from jmegatron.train.checksum import checksums_by_leaf  # noqa: E402


def make_state(megabytes: int) -> dict:
    """Eight [rows, 1024] fp32 matrices, split over all devices by rows (8 virtual CPU
    devices, or the accelerators present)."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = max(megabytes * 2 ** 20 // (8 * 4 * 1024) // n * n, n)
    sharding = jax.NamedSharding(mesh, jax.P("d"))
    make = jax.jit(lambda key: jax.random.normal(key, (rows, 1024)), out_shardings=sharding)
    return {f"w{i}": make(jax.random.key(i)) for i in range(8)}


def timed(fn, repeats: int = 3) -> float:
    """Best seconds of ``fn()`` (which must block until it is done); no warm-up run
    is needed beyond the first, which compiles."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(state: dict, folder: str) -> dict[str, float]:
    codecs = {k: LeafCodec() for k in state}
    abstract = abstract_of(state)
    out = {"checksum": timed(lambda: checksums_by_leaf(state))}

    plain = ocp.CheckpointManager(os.path.join(folder, "plain"), item_names=("state",),
                                  options=ocp.CheckpointManagerOptions(
                                      enable_async_checkpointing=False))
    steps = iter(range(1, 100))

    def plain_save():
        step = next(steps)
        plain.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        plain.delete(step)

    plain.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    out["orbax save"] = timed(plain_save)
    out["orbax restore"] = timed(lambda: jax.block_until_ready(plain.restore(
        0, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]))

    for verify in (False, True):
        ours = Checkpointer(os.path.join(folder, f"verify_{verify}"),
                            CheckpointConfig(async_save=False, keep=1, verify=verify))

        def save():
            ours.save(next(steps), state, codecs, {})
            ours.finish()   # with verify: the read-back of what was just written

        out["save + read back" if verify else "save"] = timed(save)
    out["restore"] = timed(lambda: jax.block_until_ready(
        ours.restore(ours.latest_step(), abstract, codecs)[0]))
    return out


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--small", action="store_true", help="64 MB (about a minute)")
    parser.add_argument("--out", default=None)
    return parser


def main() -> None:
    args = parser().parse_args()
    megabytes = 64 if args.small else args.mb
    state = make_state(megabytes)
    size = sum(x.nbytes for x in state.values()) / 2 ** 20
    folder = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        seconds = measure(state, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = seconds["orbax save"]
    rows = [{"variant": name, "state_mb": size, "ms": s * 1e3, "mb_per_s": size / s,
             "ratio_vs_orbax_save": s / base} for name, s in seconds.items()]
    print(f"state: {size:.0f} MB in {len(state)} fp32 leaves over {jax.device_count()} devices")
    print_table(rows, [("variant", "variant", "s"), ("ms", "ms", ",.0f"),
                       ("mb_per_s", "MB/s", ",.0f"),
                       ("ratio_vs_orbax_save", "x orbax save", ".2f")])
    write_results("bench_checkpoint", rows, args.out, argv())


if __name__ == "__main__":
    main()
