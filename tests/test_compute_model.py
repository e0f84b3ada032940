"""jmegatron.analysis.compute_model: the matmuls it lists are the model's FLOPs, waves
by hand, the calibration, and the Megatron check's arithmetic (pure Python: nothing
compiles)."""

import dataclasses

import pytest

from experiments import project_scale as ps
from jmegatron.analysis import compute_model as cmp
from jmegatron.analysis import cost_model as cm
from jmegatron.models import GPTConfig

CFG = GPTConfig(vocab_size=512, d_model=256, n_layers=3, n_heads=8, n_kv_heads=4, d_ff=704)
B, T = 4, 128


def test_wave_efficiency_by_hand():
    # 32 x 9 = 288 tiles of 256 x 128 on 80 SMs: 4 waves, the last one 60% full.
    assert cmp.wave_efficiency(8192, 1152, 80) == pytest.approx(288 / 320)
    # A partly filled tile idles too: [300, 100] takes 2 x 1 tiles of 256 x 128.
    assert cmp.wave_efficiency(300, 100, 80) == pytest.approx(300 * 100 / (80 * 256 * 128))
    # A batched matmul's tiles share the waves: 128 heads x 32 tiles = 52 waves of 80.
    assert cmp.wave_efficiency(1024, 1024, 80, batch=128) == pytest.approx(4096 / (52 * 80))


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_the_listed_matmuls_are_the_models_flops(tensor):
    """Without remat the step's GEMMs add up to ``flops_per_token`` (counted separately,
    for MFU) split over the tensor ranks; full remat adds one forward of the layers."""
    tokens = B * T
    plain = cmp.dense_step_work(CFG, B, T, tensor)
    assert plain.flops * tensor == pytest.approx(CFG.flops_per_token(T) * tokens, rel=1e-12)
    remat = cmp.dense_step_work(dataclasses.replace(CFG, remat="full"), B, T, tensor)
    head = 6 * CFG.d_model * CFG.vocab * tokens
    assert (remat.flops - plain.flops) * tensor == pytest.approx(
        (CFG.flops_per_token(T) * tokens - head) / 3, rel=1e-12)
    # The norms and residuals are not split: more element-wise bytes per FLOP per rank.
    one = cmp.dense_step_work(CFG, B, T)
    assert (plain.memory_bytes / plain.flops > one.memory_bytes / one.flops) == (tensor > 1)


def test_calibration_reproduces_the_measured_step():
    hw = cm.hardware("v100-dgx2h")
    work = cmp.dense_step_work(CFG, B, T)
    rate = cmp.calibrate(work, 0.5, hw)
    assert cmp.seconds(work, rate, hw) == pytest.approx(0.5, rel=1e-12)
    with pytest.raises(ValueError, match="element-wise") as err:
        cmp.calibrate(work, cmp.memory_seconds(work, hw.hbm_gb_s * 1e9) / 2, hw)
    assert "\n" not in str(err.value)
    moe = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, n_experts=4, top_k=2))
    with pytest.raises(ValueError, match="dense layers only"):
        cmp.dense_step_work(moe, B, T)


def _row(name: str, collectives: list[dict]) -> dict:
    """A measured row as ``compile_layout`` writes it, for the fields the Megatron
    check reads."""
    s = ps.setting(name)
    cfg = ps.model_config(s.model, s.mesh["tensor"])
    return {"setting": name, "devices": s.devices, "params_b": 0.0,
            "mesh_shape": {"fsdp": 1, "tensor": s.mesh["tensor"]},
            "model_flops_per_device": cfg.flops_per_token(s.seq) * s.batch * s.seq / s.devices,
            "train_collectives": len(collectives), "train_bytes_per_device": 0.0,
            "train_collective_list": collectives, "state_bytes_per_device": 0.0,
            "train_temp_bytes_per_device": 0.0}


def test_megatron_check_is_relative_to_the_one_gpu_run():
    """The one-GPU 1.2B row is 100% by both projections (it sets the rate); a tp2 row's
    calibrated efficiency is its FLOPs over matmul + element-wise + collective time,
    relative to the one-GPU FLOP rate."""
    reduce = {"kind": "all-reduce", "name": "ar", "computation": "main", "shape": "bf16[]",
              "axes": ["tensor"], "group_size": 2, "executions": 100, "buffers": 1,
              "buffer_bytes": 50_000_000, "widened": 0}
    base, tp2 = ps.megatron_rows([_row("megatron-1.2b/tp1", []),
                                  _row("megatron-2.5b/tp2", [reduce])])
    assert base["projected"] == pytest.approx(1.0) == base["flops_only"]
    hw = cm.hardware("v100-dgx2h")
    # 100 x (8.4 us + 2 steps x 3.4 us + 50 MB / (150 GB/s x 370 / 450)).
    comm = 100 * (15.2e-6 + 50e6 / (150e9 * 370 / 450))
    assert tp2["comm_ms"] == pytest.approx(1e3 * comm)
    s = ps.setting("megatron-2.5b/tp2")
    flops = ps.model_config(s.model, 2).flops_per_token(s.seq) * s.batch * s.seq / 2
    seconds = 1e-3 * (tp2["matmul_ms"] + tp2["memory_ms"]) + comm
    assert tp2["projected"] == pytest.approx(flops / seconds / hw.flops_per_s)
    assert tp2["flops_only"] == pytest.approx(flops / (flops + comm * hw.flops_per_s))
