#!/usr/bin/env bash
# Training throughput on one GPU, every table of one run (budget: 8 minutes on an H200):
#   1. bench_train_speed: dense-1b in bf16 (fp32 masters), batch 8 x 2048 tokens, with
#      AdamW, Muon (standard, Gram, SYRK Newton-Schulz) and SOAP (its regular step and its
#      refresh step); gpt2-small and qwen3-moe-small with AdamW and Muon: step time,
#      tokens/s, model and optimizer TFLOP/s, MFU and total MFU against the measured bf16
#      matmul rate, peak memory; and the ops with the most device time in the 1B Muon step
#      (a jax.profiler trace, read back without TensorBoard);
#   2. bench_attention --gpu: the einsum path, the flash path (cuDNN + a blockwise pass for
#      the largest logit) and cuDNN alone at T = 2048 and 4096, bf16;
#   3. bench_checkpoint: checkpoint checksums' speed on the GPU beside orbax's save.
# On a CPU, SMALL=1 runs both at tiny shapes: it shows the script works, nothing more.
# Results: $RESULTS/*.json (default bench_results/) beside the printed tables.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
export RESULTS=${RESULTS:-bench_results}   # where the JSON results go
# A rerun on the same machine reuses the compiled programs.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jmegatron-jax-cache}
if [ "${SMALL:-0}" = 1 ]; then
    export JAX_PLATFORMS=cpu
    TRAIN=(--small --steps 3) ATTENTION=(--repeats 2) CHECKPOINT=(--small)
else
    TRAIN=() ATTENTION=(--gpu --dtype bfloat16) CHECKPOINT=(--mb 2048)
fi
echo "== jax $("$PY" -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)')"

# Every optimizer row on the 1B model (the goals are read there); AdamW and Muon on the
# others. One step failing (out of memory, a compile error) leaves the next to run.
train() {
    timeout "$1" "$PY" -m experiments.bench_train_speed "${TRAIN[@]}" --models "$2" \
        --rows "$3" "${@:4}" --out "$RESULTS/bench_train_speed_$2.json" \
        || echo "== $2: failed ($?)"
}
echo "== 1. bench_train_speed"
train 240 dense-1b adamw,muon,muon-gram,muon-syrk,soap,soap-refresh --profile "$RESULTS/profile"
train 75 gpt2-small adamw,muon
train 75 qwen3-moe-small adamw,muon

echo "== 2. bench_attention"
timeout 60 "$PY" -m experiments.bench_attention "${ATTENTION[@]}" \
    --out "$RESULTS"/bench_attention_gpu.json || echo "== bench_attention: failed ($?)"

echo "== 3. bench_checkpoint: checksums (GB/s on the GPU) beside orbax's save and restore"
timeout 90 "$PY" -m experiments.bench_checkpoint "${CHECKPOINT[@]}" \
    --out "$RESULTS"/bench_checkpoint_gpu.json || echo "== bench_checkpoint: failed ($?)"
