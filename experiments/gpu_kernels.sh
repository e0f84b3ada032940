#!/usr/bin/env bash
# Newton-Schulz kernels on one GPU, every table of one run (budget: 8 minutes on an H200):
#   1-2. experiments/gpu_check.sh: tests/test_syrk.py on the compiled SYRK kernel, then
#        bench_syrk (syrk against x @ x.T and one Newton-Schulz step, 1024^2 .. 4096x16384);
#   3.   bench_ns_kernels: Newton-Schulz throughput per method and dtype against the
#        measured bf16 matmul rate and optax; stacked calls against loops;
#   4.   bench_newton_schulz's methods and restarts tables: Gram Newton-Schulz's bf16
#        accuracy on the GPU (its restart interval was chosen on CPU).
# On a CPU, SMALL=1 runs every step at small shapes with the kernel in interpret mode:
# it shows the script works, not how fast anything is.
# Results: $RESULTS/*.json (default bench_results/) beside the printed tables.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
export RESULTS=${RESULTS:-bench_results}   # where the JSON results go
SMALL_FLAG=()
if [ "${SMALL:-0}" = 1 ]; then
    export SYRK_BACKEND=interpret JAX_PLATFORMS=cpu
    SMALL_FLAG=(--small)
fi
echo "== jax $("$PY" -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)')"
PY="$PY" bash experiments/gpu_check.sh "${SMALL_FLAG[@]}"

echo "== 3. bench_ns_kernels"
timeout 240 "$PY" -m experiments.bench_ns_kernels "${SMALL_FLAG[@]}" \
    --syrk "${SYRK_BACKEND:-auto}" --out "$RESULTS"/bench_ns_kernels.json

echo "== 4. bench_newton_schulz: Gram accuracy in bf16"
timeout 120 "$PY" -m experiments.bench_newton_schulz --only methods,restarts "${SMALL_FLAG[@]}" \
    --out "$RESULTS"/bench_newton_schulz_gpu.json
