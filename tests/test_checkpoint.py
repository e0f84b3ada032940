"""Checkpoints: canonical format restored across meshes and layouts, exact
resume, preemption, killed saves and bad checkpoints."""

import dataclasses
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import helpers
from jmegatron.models import GPTConfig
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.train import PipelineConfig, ScheduleConfig, TrainConfig, Trainer
from jmegatron.train.config import MuonBPConfig
from jmegatron.train.checkpoint import Checkpointer, CheckpointDamaged, CheckpointError, LeafCodec

MODEL = GPTConfig(vocab_size=300, d_model=32, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=64,
                  vocab_multiple=64)
TRAIN = TrainConfig(steps=10)


@functools.cache   # a setup is the source of some cases and the target of others
def setup(mesh_config, layout, devices=8, repeats=1, model=MODEL, optim="muon"):
    """``repeats`` > 1: a circular pipeline's interleaved stacks [S, V c, ...]."""
    mesh = make_mesh(mesh_config, jax.devices()[:devices])
    model = model.pad_vocab(mesh.shape["tensor"])   # 384 at tensor 2, 512 at tensor 4
    pipeline = PipelineConfig("circular", repeats) if repeats > 1 else PipelineConfig()
    lay, optimizer, _, state = helpers.build(mesh, layout, model, dataclasses.replace(
        TRAIN, optim=optim, pipeline=pipeline))
    cfg, codecs = helpers.codecs_for(model, lay, optimizer, state)
    return cfg, state, codecs


def canonical(cfg, state, codecs):
    # Under one jit, as Checkpointer.save encodes: op by op, the eager programs of a
    # layerwise unpad on 8 virtual devices twice aborted XLA:CPU on 2 cores (2026-12-04).
    return helpers.canonical(state, codecs)


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


D8, D4 = MeshConfig(data=2, fsdp=2, tensor=2), MeshConfig(fsdp=2, tensor=2)
T4 = MeshConfig(fsdp=2, tensor=4)
L8 = MeshConfig(data=2, fsdp=4)
F8 = MeshConfig(fsdp=8)     # owner: 4 layers in one group of 8, half of it padding
S2, S4 = MeshConfig(stage=2, data=2, fsdp=2), MeshConfig(stage=4, fsdp=2)
CASES = {   # name: (source mesh, layout, devices[, repeats]), (target ...)[, optimizer]
    "8_to_4_devices": ((D8, "fsdp", 8), (D4, "fsdp", 4)),
    "4_to_8_devices": ((D4, "fsdp", 4), (D8, "fsdp", 8)),
    "tensor_2_to_4": ((D8, "fsdp", 8), (T4, "fsdp", 8)),
    "tensor_4_to_2": ((T4, "fsdp", 8), (D8, "fsdp", 8)),
    "layerwise_to_owner": ((L8, "layerwise", 8), (L8, "owner", 8)),
    "owner_to_layerwise": ((L8, "owner", 8), (L8, "layerwise", 8)),
    "replicated_to_fsdp": ((D8, "replicated", 8), (D8, "fsdp", 8)),
    "fsdp_to_replicated": ((D8, "fsdp", 8), (D8, "replicated", 8)),
    # SOAP's per-matrix factors: padded under layerwise, grouped (and padded) under owner.
    "soap_layerwise_to_owner": ((L8, "layerwise", 8), (L8, "owner", 8), "soap"),
    "soap_padded_owner_to_fsdp_tensor_2": ((F8, "owner", 8), (D8, "fsdp", 8), "soap"),
    # Pipeline stages: block weights and their state [S, L/S, ...] split over `stage`.
    "stage_2_to_1": ((S2, "fsdp", 8), (D8, "fsdp", 8)),
    "stage_1_to_4": ((D8, "fsdp", 8), (S4, "replicated", 8)),
    "soap_stage_4_to_owner": ((S4, "fsdp", 8), (L8, "owner", 8), "soap"),
    "soap_layerwise_to_stage_2": ((L8, "layerwise", 8), (S2, "fsdp", 8), "soap"),
    "soap_owner_stage_2_to_owner_stage_4": ((S2, "owner", 8), (S4, "owner", 8), "soap"),
    # Circular stages [S, V c, ...]: chunk j on stage j % S.
    "circular_stage_2_to_stage_4": ((S2, "layerwise", 8, 2), (S4, "fsdp", 8)),
    "stage_1_to_circular_stage_2": ((D8, "fsdp", 8), (S2, "fsdp", 8, 2)),
    "circular_owner_to_owner_stage_4": ((S2, "owner", 8, 2), (S4, "owner", 8)),
    # The communication-reduced optimizers: Muon's state, Dion2's error-feedback momentum.
    "muon_bp_fsdp_to_owner": ((D8, "fsdp", 8), (L8, "owner", 8), "muon_bp"),
    "dion2_layerwise_to_fsdp": ((L8, "layerwise", 8), (D8, "fsdp", 8), "dion2"),
}


@pytest.mark.parametrize("case", CASES)
def test_restore_onto_another_mesh_or_layout(case, tmp_path):
    source, target, *optim = CASES[case]
    restores_exactly(source, target, optim[0] if optim else "muon", MODEL, tmp_path)


def test_a_bf16_layerwise_checkpoint_with_masters_on_owners_restores_under_owner(tmp_path):
    """A bf16 model under layerwise, 4 owners dividing its 4 layers: its matrix stacks'
    fp32 params live on their owners (split like their state); the checkpoint holds
    them whole, and owner (8 ranks, grouped) reads back the same values."""
    bf16 = dataclasses.replace(MODEL, dtype="bfloat16")
    _, state, _ = setup(D8, "layerwise", model=bf16)
    qkv = state.params["blocks"]["attn"]["qkv"][...]
    assert "data" in str(qkv.sharding.spec[0]), qkv.sharding   # on its owners
    restores_exactly((D8, "layerwise", 8), (L8, "owner", 8), "muon", bf16, tmp_path)


def restores_exactly(source, target, optim, model, tmp_path):
    """Saved from ``source`` (mesh, layout, devices[, repeats]), restored onto
    ``target``: the same canonical values, in the target's shapes and shardings."""
    cfg, state, codecs = setup(*source, model=model, optim=optim)
    state = helpers.randomized(state)
    saver = Checkpointer(tmp_path)
    saver.save(7, state, codecs, {"layout": source[1]})
    saver.close()
    target_cfg, target, target_codecs = setup(*target, model=model, optim=optim)
    restored, meta = Checkpointer(tmp_path).restore(7, abstract(target), target_codecs)
    assert meta["step"] == 7
    want = canonical(cfg, state, codecs)
    got = canonical(target_cfg, restored, target_codecs)
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    for live, like in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert live.shape == like.shape and live.sharding == like.sharding


# --- bad checkpoints ------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    cfg, state, codecs = setup(D8, "fsdp", optim="adamw")
    saver = Checkpointer(folder)
    saver.save(3, state, codecs, {"optim": "adamw"})
    saver.close()
    return folder


def test_another_shape_names_the_leaf(saved):
    cfg, state, codecs = setup(D8, "fsdp", model=dataclasses.replace(MODEL, d_model=64),
                               optim="adamw")
    with pytest.raises(CheckpointError, match=r"leaf \.params\['blocks'\]\['attn'\]\['out'\]"
                                              r"\.value has shape \(4, 4, 8, 32\), but this "
                                              r"model needs \(4, 4, 16, 64\)"):
        Checkpointer(saved).restore(3, abstract(state), codecs)


def test_a_missing_leaf_is_named(saved):
    cfg, state, codecs = setup(D8, "fsdp", optim="muon")
    with pytest.raises(CheckpointError, match=r"has no leaf .opt_state.* \(written by optimizer "
                                              r"'adamw'"):
        Checkpointer(saved).restore(3, abstract(state), codecs)


def test_a_corrupted_file_is_named(saved, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    for f in (broken / "3" / "state").rglob("*"):
        if f.is_file() and f.name not in ("_METADATA", "_CHECKPOINT_METADATA"):
            f.write_bytes(b"\0garbage" * 8)
    cfg, state, codecs = setup(D8, "fsdp", optim="adamw")
    with pytest.raises(CheckpointDamaged, match=f"checkpoint {broken / '3'} is damaged: cannot "
                                                "read its arrays"):
        Checkpointer(broken).restore(3, abstract(state), codecs)


# --- exact resume and preemption through the trainer -------------------------

SMALL = dict(model=GPTConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64),
             batch_size=8, seq_len=32, eval_every=100, eval_batches=1, sample_tokens=4,
             log_every=1, progress=False, steps=20, schedule=ScheduleConfig(warmup_steps=5))


def losses(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# MuonBP's period 3 puts the stop inside a period: the restored count must pick the
# next full step; Dion2's error feedback must come back whole.
OPTIONS = {"muon": {}, "muon_bp": dict(muon_bp=MuonBPConfig(period=3)), "dion2": {}}


@pytest.mark.parametrize("optim", OPTIONS)
def test_resume_is_exact(optim, tmp_path):
    small = dict(SMALL, optim=optim, **OPTIONS[optim])
    straight = Trainer(TrainConfig(**small, out_dir=str(tmp_path), name="straight"))
    straight.run()
    # The same programs: a stop and a resume compile nothing again.
    first = Trainer(TrainConfig(**small, out_dir=str(tmp_path), name="halves", stop_after=10),
                    programs=straight.programs)
    first.run()
    second = Trainer(TrainConfig(**small, out_dir=str(tmp_path), name="halves", resume=True),
                     programs=straight.programs)
    assert second.start_step == 10
    second.run()
    for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(second.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert losses(tmp_path / "straight") == losses(tmp_path / "halves")


def test_a_muon_checkpoint_resumes_as_muon_bp_with_its_state(tmp_path):
    """optimizers.md: MuonBP's state is Muon's, so --allow-change optim carries it over
    (each state is keyed by its optimizer's name); SOAP's differs and is refused."""
    small = dict(SMALL, sample_tokens=0)
    muon = Trainer(TrainConfig(**dict(small, steps=2), out_dir=str(tmp_path), name="muon"))
    muon.run()
    resume = dict(small, steps=3, resume_from=str(tmp_path / "muon" / "checkpoints" / "2"),
                  allow_change=("optim", "steps"), out_dir=str(tmp_path))
    bp = Trainer(TrainConfig(**resume, optim="muon_bp", name="bp"))
    assert bp.start_step == 2
    for a, b in zip(jax.tree.leaves(muon.state.opt_state), jax.tree.leaves(bp.state.opt_state),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert bp.run()["steps"] == 3
    with pytest.raises(CheckpointError, match=r"has no leaf \.opt_state.*\['soap'\].*\(written "
                                              r"by optimizer 'muon'"):
        Trainer(TrainConfig(**resume, optim="soap", name="soap"))


CLI = [sys.executable, "-m", "experiments.train", "--model.d-model", "32", "--model.n-layers",
       "2", "--model.n-heads", "2", "--model.n-kv-heads", "2", "--model.d-ff", "64",
       "--batch-size", "8", "--seq-len", "32", "--eval-every", "1000", "--log-every", "1",
       "--no-progress", "--steps", "100000"]


def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path):
    proc = subprocess.Popen(CLI + ["--out-dir", str(tmp_path), "--name", "run"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and
                                               len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    step = max(losses(tmp_path / "run"))
    assert f"stopped by SIGTERM at step {step}; checkpoint saved in" in out
    continue_with = shlex.join(["python", "-m", "experiments.train", *CLI[3:], "--name", "run",
                                "--out-dir", str(tmp_path), "--resume"])
    assert f"continue with: {continue_with}\n" in out
    assert Checkpointer(tmp_path / "run" / "checkpoints").latest_step() == step


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import jax, jax.numpy as jnp
    from jmegatron.train.checkpoint import Checkpointer, LeafCodec
    folder = sys.argv[1]
    saver = Checkpointer(folder)
    small = {"w": jnp.ones((4, 4))}
    saver.save(1, small, {"w": LeafCodec()}, {})
    saver.wait()
    big = {"w": jnp.ones((4, 4)), "big": jnp.ones((64, 1024, 1024))}   # 256 MB
    saver.save(2, big, {"w": LeafCodec(), "big": LeafCodec()}, {})
    # Once orbax's writer has begun step 2 (on busy cores its thread can start late):
    deadline = time.time() + 60
    while time.time() < deadline and not any(".orbax-checkpoint-tmp" in p.name
                                             for p in Path(folder).iterdir()):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)   # while step 2 is being written
""")


def test_a_save_killed_half_way_never_restores_as_whole(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir()), \
        "the kill should have caught step 2 half-written"
    saver = Checkpointer(tmp_path)
    assert saver.latest_step() == 1
    restored, meta = saver.restore(1, {"w": jax.ShapeDtypeStruct(
        (4, 4), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))},
        {"w": LeafCodec()})
    assert meta["step"] == 1 and float(restored["w"].sum()) == 16.0


def test_cli_resume_from_a_bad_path_is_one_clear_line(tmp_path):
    proc = subprocess.run(CLI[:-2] + ["--steps", "2", "--resume-from", str(tmp_path / "nothing"),
                                      "--out-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"error: no checkpoint folder at {tmp_path / 'nothing'}" in proc.stderr
