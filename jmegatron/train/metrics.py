"""Run outputs: metrics.jsonl, throughput and MFU against a measured matmul rate."""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def jsonable(record: dict) -> dict:
    """Plain floats for numpy/JAX scalars, (nested) lists for arrays (an MoE load
    per layer and expert); null for NaN and inf (JSON has neither)."""
    def clean(v):
        if isinstance(v, (np.ndarray, jax.Array)) and np.ndim(v):
            return [clean(x) for x in np.asarray(v)]
        if isinstance(v, (np.floating, np.integer, np.ndarray, jax.Array)):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v
    return {k: clean(v) for k, v in record.items()}


class MetricsWriter:
    """Writes one JSON object per line to ``metrics.jsonl`` (a new run starts it
    afresh; a run resumed in its own folder appends)."""

    def __init__(self, run_dir: Path, append: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = self.path.open("a" if append else "w")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(jsonable(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def measure_matmul_rate(mesh: jax.sharding.Mesh, dtype: str = "float32", n: int | None = None,
                        repeats: int = 5) -> float:
    """FLOP/s of one large matmul per device, all devices at once: the local ceiling
    against which MFU is quoted (not a vendor peak). Measured once per process for
    each set of devices and dtype (runs in one process share it)."""
    if n is None:
        n = 512 if mesh.devices.flat[0].platform == "cpu" else 8192
    return _matmul_rate(tuple(mesh.devices.flat), dtype, n, repeats)


@functools.lru_cache
def _matmul_rate(devices: tuple, dtype: str, n: int, repeats: int) -> float:
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    sharding = NamedSharding(mesh, P("devices"))
    # Born sharded (and b replicated) on every device: built on one device first, a
    # would be mesh.size * n * n elements there (8192^2 x 4 bytes x devices of all hosts).
    ones = lambda shape, where: jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=where)()
    a = ones((mesh.size * n, n), sharding)
    b = ones((n, n), NamedSharding(mesh, P()))
    matmul = jax.jit(lambda a, b: a @ b, out_shardings=sharding)
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * mesh.size * n ** 3 / best
