"""The GPU scripts (experiments/gpu_kernels.sh, gpu_train.sh) run on the CPU with
SMALL=1, every step of them: on a lent GPU they get one try in a short budget, so a
script that drifted from the code (a flag renamed, a default changed) must fail here,
not there. Each benchmark row that fails makes the script's output say "failed"."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = {
    "gpu_kernels.sh": ["bench_newton_schulz_gpu.json", "bench_ns_kernels.json",
                       "bench_syrk_interpret.json"],
    "gpu_train.sh": ["bench_attention_gpu.json", "bench_checkpoint_gpu.json",
                     "bench_train_speed_dense-1b.json", "bench_train_speed_gpt2-small.json",
                     "bench_train_speed_qwen3-moe-small.json"],
}


@pytest.mark.parametrize("script", RESULTS)
def test_a_gpu_script_runs_every_step_on_the_cpu_with_small(script, tmp_path):
    env = {**os.environ, "SMALL": "1", "RESULTS": str(tmp_path), "PY": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "experiments" / script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "failed" not in done.stdout, done.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == RESULTS[script]
