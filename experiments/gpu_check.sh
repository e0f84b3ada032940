#!/usr/bin/env bash
# The SYRK kernel on one GPU (budget: under 8 minutes on an H200):
#   1. tests/test_syrk.py on the compiled kernel (JMEGATRON_SYRK_BACKEND=pallas), with
#      fp32 matmuls at full precision, since Triton and XLA would otherwise both use
#      TF32, each rounding differently, and the fp32 tests compare to 1e-5;
#   2. experiments/bench_syrk at 1024^2, 2048^2, 4096^2, 8192^2 and 4096x16384 bf16:
#      correctness against jnp, then median times of syrk vs x @ x.T and of one
#      Newton-Schulz step with and without SYRK, as a table (and $RESULTS/*.json).
# Exercise it on a CPU with SYRK_BACKEND=interpret (small shapes, interpret mode).
# Extra arguments go to the benchmark, e.g. --block 64 --block-k 32.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
BACKEND=${SYRK_BACKEND:-pallas}
export RESULTS=${RESULTS:-bench_results}   # where the JSON results go
# tests/conftest.py puts JAX on the CPU unless JAX_PLATFORMS says otherwise: the compiled
# kernel needs the GPU named.
if [ "$BACKEND" = interpret ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}; fi

echo "== 1. tests/test_syrk.py, backend $BACKEND"
JMEGATRON_SYRK_BACKEND=$BACKEND JAX_DEFAULT_MATMUL_PRECISION=highest \
    timeout 240 "$PY" -m pytest tests/test_syrk.py -q -p no:cacheprovider

echo "== 2. benchmark, backend $BACKEND"
timeout 240 "$PY" -m experiments.bench_syrk --backend "$BACKEND" \
    --out "$RESULTS/bench_syrk_$BACKEND.json" "$@"
