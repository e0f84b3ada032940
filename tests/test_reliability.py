"""Nothing lost, nothing silent: damaged checkpoints, reused run folders, the resume
contract, bad numbers, long runs of skipped steps, failures at the end, full disks.

One small run (6 steps, checkpoints at 2, 4 and 6; conftest's ``trained``) is trained
once; each test damages or continues its own copy of it (``run``)."""

import contextlib
import gc
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cli_runs import RUN, SMALL, cli, main
from experiments import train as train_cli
from jmegatron.analysis import hlo_collectives
from jmegatron.train import TrainConfig, Trainer, run_folder
from jmegatron.train import programs
from jmegatron.train.checkpoint import (CheckpointConfig, CheckpointDamaged, Checkpointer,
                                        LeafCodec, abstract_of)
from jmegatron.train.checksum import checksums_by_leaf, tree_checksums
from jmegatron.train.loop import perplexity


@pytest.fixture(scope="module")
def reader(trained, tmp_path_factory):
    """A trainer of the same model, for restoring checkpoints of the run by hand."""
    cfg = train_cli.parse(RUN + ["--out-dir", str(tmp_path_factory.mktemp("reader"))])
    trainer = Trainer(cfg, log=lambda *a: None)
    target = abstract_of(trainer.state)
    yield lambda folder, step: Checkpointer(folder).restore(step, target, trainer.codecs)
    trainer.close()


def meta(folder: Path, step: int) -> dict:
    return Checkpointer(folder).read_meta(step)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def largest_file(folder: Path) -> Path:
    return max((f for f in folder.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def flip(path: Path, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 - n // 2
    data[middle:middle + n] = bytes(b ^ 0xFF for b in data[middle:middle + n])
    path.write_bytes(bytes(data))


# --- checksums --------------------------------------------------------------------------

def test_checksums_do_not_depend_on_the_sharding_and_see_any_change():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.random.normal(jax.random.key(0), (8, 16, 6))
    tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "i32": jnp.arange(7, dtype=jnp.int32),
            "bool": x > 0}
    want = checksums_by_leaf(tree)
    for spec in (jax.P("a", "b"), jax.P(None, ("a", "b")), jax.P("b", None, "a")):
        placed = jax.device_put(x, jax.NamedSharding(mesh, spec))
        assert checksums_by_leaf({**tree, "f32": placed}) == want
    changed = [x.at[3, 4, 5].set(jnp.nextafter(x[3, 4, 5], jnp.inf)),   # one bit
               x.at[0, 0, :2].set(x[0, 0, 1::-1]),                       # two swapped
               x[::-1], jnp.zeros_like(x)]                                 # rows reordered
    for other in changed:
        assert checksums_by_leaf({"f32": other})["['f32']"] != want["['f32']"]
    # Each device hashes its own shards: the program gathers nothing, it only sums.
    placed = jax.device_put(x, jax.NamedSharding(mesh, jax.P("a", "b")))
    report = hlo_collectives(tree_checksums, placed)
    assert report.select("all-reduce") and {c.kind for c in report.collectives} == {"all-reduce"}
    assert all(c.buffer_bytes <= 8 for c in report.collectives)   # two uint32 lanes each


# --- damaged checkpoints ------------------------------------------------------------------

def swap_state(folder: Path, step: int, other: int) -> None:
    """The arrays of another step under this step's meta: every file reads fine."""
    shutil.rmtree(folder / str(step) / "state")
    shutil.copytree(folder / str(other) / "state", folder / str(step) / "state")


DAMAGE = {
    "4_KiB_flipped": lambda folder: flip(largest_file(folder / "6" / "state")),
    "files_of_another_step": lambda folder: swap_state(folder, 6, 4),
    "metadata_deleted": lambda folder: (folder / "6" / "state" / "_METADATA").unlink(),
    "truncated": lambda folder: largest_file(folder / "6" / "state").write_bytes(b""),
    "meta_deleted": lambda folder: shutil.rmtree(folder / "6" / "meta"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_with_one_line(damage, run, reader, caplog):
    folder = run / "checkpoints"
    DAMAGE[damage](folder)
    with pytest.raises(CheckpointDamaged) as err:
        reader(folder, 6)
    message = str(err.value)
    # orbax leaves the failed restore's other reads unawaited; collected, asyncio would
    # report each with its traceback from whatever allocation collects it (on Python
    # 3.11.7, inside ast.parse, that fails the parse: CPython gh-106905). They finish
    # in orbax's thread: give them half a second, then collect. Nothing is reported.
    del err
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(5):
            time.sleep(0.1)
            gc.collect()
    assert not caplog.records, caplog.records
    assert message.startswith(f"checkpoint {folder / '6'} is damaged: ") and "\n" not in message
    if damage == "files_of_another_step":
        assert "reads back with checksum" in message
    restored, _ = reader(folder, 4)   # the one before is untouched and verifies
    assert int(restored.step) == 4


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(run, trained, capfd):
    flip(largest_file(run / "checkpoints" / "6" / "state"))
    assert main(*RUN, "--out-dir", str(run.parent), "--name", "run", "--resume") is None
    out = "".join(capfd.readouterr())
    assert f"checkpoint {run / 'checkpoints' / '6'} is damaged" in out
    assert f"resumed from {run / 'checkpoints' / '4'}" in out
    assert "Traceback" not in out
    assert (run / "checkpoints.damaged" / "6").is_dir()   # set aside, not deleted
    # Steps 5 and 6 again, bitwise: the new checkpoint 6 equals the one that was damaged.
    new, old = (meta(folder / "checkpoints", 6)["checksums"] for folder in (run, trained))
    assert new == old
    steps = [r["step"] for r in records(run) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]   # the lost steps appear once
    want = {r["step"]: r["loss"] for r in records(trained) if "loss" in r}
    assert {r["step"]: r["loss"] for r in records(run) if "loss" in r} == want


# --- rotation -----------------------------------------------------------------------------

def small_saver(folder, **options):
    saver = Checkpointer(folder, CheckpointConfig(async_save=False, **options))
    tree = lambda v: {"w": jnp.full((4, 4), float(v))}
    save = lambda step: saver.save(step, tree(step), {"w": LeafCodec()}, {})
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=one_device)}
    restore = lambda step: saver.restore(step, target, {"w": LeafCodec()})[0]["w"]
    return saver, save, restore


def test_rotation_keeps_the_verified_checkpoint_when_a_newer_one_does_not_read_back(tmp_path):
    saver, save, restore = small_saver(tmp_path, keep=1)
    save(1)
    save(2)   # finishes 1: read back, verified, nothing to rotate yet
    assert saver.verified == {1}
    swap_state(tmp_path, 2, 1)   # 2 is damaged before it is read back
    with pytest.raises(CheckpointDamaged, match=f"checkpoint {tmp_path / '2'} is damaged"):
        saver.finish()
    assert saver.all_steps() == [1, 2]   # keep=1, but 1 is the newest that verified
    np.testing.assert_array_equal(restore(1), np.ones((4, 4)))
    save(3)
    saver.finish()   # 3 verifies: now 1 and 2 may go
    assert saver.all_steps() == [3] and float(restore(3)[0, 0]) == 3.0


def test_without_read_back_the_newest_verified_checkpoint_stays(tmp_path):
    saver, save, restore = small_saver(tmp_path, keep=1, verify=False)
    save(1)
    saver.finish()
    restore(1)   # verified by reading it
    for step in (2, 3):
        save(step)
        saver.finish()
    assert saver.all_steps() == [1, 3]


# --- run folders and the resume contract ----------------------------------------------------

def test_reusing_a_run_folder_is_refused(run):
    before = (run / "metrics.jsonl").read_bytes()
    error = main(*RUN, "--out-dir", str(run.parent), "--name", "run")
    assert error == (f"error: run folder {run} already holds a run (checkpoints 2, 4, 6): continue "
                     "it with --resume, start another with a new --name, or replace it with "
                     "--overwrite")
    assert (run / "metrics.jsonl").read_bytes() == before


def test_resume_with_other_settings_is_refused_naming_both_values(run):
    error = main(*SMALL, "--steps", "10", "--seed", "1", "--lr", "1e-3", "--out-dir",
                 str(run.parent), "--name", "run", "--resume")
    assert error.startswith(f"error: {run / 'checkpoints' / '6'} was written by a run with other "
                            "settings (lr: 0.003 -> 0.001, seed: 0 -> 1, steps: 6 -> 10)")
    assert error.endswith("--allow-change lr seed steps") and "\n" not in error


def test_a_setting_the_checkpoint_predates_ran_at_its_default():
    """A run saved before --weight-decay-method existed resumes as decoupled (the
    default then and now) and is refused only if the setting is changed."""
    now = run_folder.run_settings(TrainConfig())
    defaults = run_folder.run_settings(TrainConfig())
    saved = {k: v for k, v in now.items() if k != "weight_decay_method"}
    assert run_folder.changed_settings(saved, now, defaults) == {}
    palm = run_folder.run_settings(TrainConfig(weight_decay_method="palm"))
    assert run_folder.changed_settings(saved, palm, defaults) == {
        "weight_decay_method": ("decoupled", "palm")}


def test_an_allowed_change_is_recorded_and_metrics_do_not_repeat(run):
    # A crash after step 5 would leave records past the last checkpoint (4): fake one.
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 7, "loss": 9.0}) + "\n")
    shutil.rmtree(run / "checkpoints" / "6")
    assert main(*SMALL, "--steps", "8", "--allow-change", "steps", "--out-dir", str(run.parent),
                "--name", "run", "--resume") is None
    resumes = json.loads((run / "config.json").read_text())["resumes"]
    assert resumes == [{"step": 4, "from": str(run / "checkpoints" / "4"),
                        "changes": {"steps": [6, 8]}}]
    steps = [r["step"] for r in records(run) if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 8 and 7 in steps


def test_the_stop_message_gives_the_command_that_continues(tmp_path):
    argv = ["--steps", "50", "--name=first", "--stop-after", "20", "--resume-from", "x/10",
            "--lr", "1e-3", "--no-progress"]
    command = train_cli.resume_command(argv, tmp_path / "first")
    assert command == ("python -m experiments.train --steps 50 --lr 1e-3 --no-progress --name "
                       f"first --out-dir {tmp_path} --resume")
    again = train_cli.parse(shlex.split(command)[3:])
    assert again.resume and again.name == "first" and again.out_dir == str(tmp_path)
    assert (again.steps, again.lr, again.stop_after, again.resume_from) == (50, 1e-3, None, None)


# --- bad numbers, skipped steps, the end of a run -------------------------------------------

@pytest.mark.parametrize("flag, value, want", [
    ("--lr", "nan", "a finite number > 0"), ("--lr", "-1", "a finite number > 0"),
    ("--adamw.lr", "inf", "a finite number > 0"), ("--weight-decay", "-0.1", ">= 0"),
    ("--adamw.b2", "1", "in [0, 1)"), ("--muon.momentum", "nan", "in [0, 1)"),
    ("--adamw.eps", "nan", "a finite number >= 0"), ("--grad-clip", "inf", ">= 0"),
    ("--schedule.warmup-steps", "-1", ">= 0"), ("--checkpoint.keep", "0", ">= 1"),
    ("--top-k", "0", ">= 1"), ("--cpu-devices", "0", ">= 1"), ("--max-skipped", "0", ">= 1"),
])
def test_bad_numbers_are_refused_at_parse_time(flag, value, want):
    error = main(*SMALL, flag, value)
    assert error.startswith(f"error: {flag} ") and want in error and "\n" not in error


@pytest.fixture
def nan_loss(monkeypatch):
    """Every step's loss (and so its gradients) is NaN."""
    make = programs.make_loss_fn

    def poisoned(*args, **kwargs):
        loss_fn = make(*args, **kwargs)
        return lambda params, tokens: jax.tree.map(lambda x: x * jnp.nan, loss_fn(params, tokens))

    monkeypatch.setattr(programs, "make_loss_fn", poisoned)


def test_a_run_of_skipped_steps_stops_and_keeps_the_last_checkpoint(run, nan_loss):
    sums = meta(run / "checkpoints", 6)["checksums"]
    error = main(*SMALL, "--steps", "20", "--allow-change", "steps", "--max-skipped", "3",
                 "--checkpoint.every", "100", "--out-dir", str(run.parent), "--name", "run",
                 "--resume")
    assert error == ("error: 3 steps in a row were skipped up to step 9 (non-finite loss, "
                     "gradients, params or optimizer state; the state is that after step 6); the "
                     f"last checkpoint is {run / 'checkpoints' / '6'}. Try a lower --lr "
                     "(--max-skipped sets the patience)")
    assert Checkpointer(run / "checkpoints").all_steps() == [2, 4, 6]
    assert meta(run / "checkpoints", 6)["checksums"] == sums


def test_overwrite_and_a_failing_final_evaluation_keep_the_final_checkpoint(
        run, monkeypatch, capsys, reader):
    """--overwrite clears the old run first; an error in the final evaluation comes
    after the final checkpoint, which stays."""
    def broken(self):
        raise FloatingPointError("overflow in the evaluation")

    monkeypatch.setattr(Trainer, "evaluate", broken)
    error = main(*SMALL, "--steps", "2", "--eval-every", "100", "--out-dir", str(run.parent),
                 "--name", "run", "--overwrite")
    assert error == 1
    folder = run / "checkpoints"
    assert (f"error: the final evaluation failed (FloatingPointError: overflow in the "
            f"evaluation); the checkpoint {folder / '2'} is saved") in capsys.readouterr().out
    assert Checkpointer(folder).all_steps() == [2]
    assert [r["step"] for r in records(run) if "loss" in r] == [1, 2]
    assert int(reader(folder, 2)[0].step) == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_loss"] is None and "final evaluation failed" in summary["error"]


def test_the_perplexity_of_a_huge_loss_is_inf():
    assert perplexity(1e4) == float("inf") and perplexity(0.0) == 1.0
    assert np.isnan(perplexity(float("nan")))


# --- signals while starting -----------------------------------------------------------------

# The trainer's command, with the signal sent the moment its main thread waits in jaxlib for
# the first compile (the train state's initializer, once the run folder is taken): the
# signal ends the wait, and the compile goes on in XLA's threads.
SIGNAL_WHILE_COMPILING = textwrap.dedent("""
    import inspect, os, runpy, sys, threading, time
    from jax._src import compiler
    compiling = inspect.unwrap(compiler.backend_compile_and_load).__code__
    main = threading.main_thread().ident

    def send(signum):
        while sys._current_frames()[main].f_code is not compiling:
            time.sleep(0.001)
        os.kill(os.getpid(), signum)

    threading.Thread(target=send, args=(int(sys.argv.pop(1)),), daemon=True).start()
    runpy.run_module("experiments.train", run_name="__main__", alter_sys=True)
""")


# The run's own compile cache off (tests/conftest.py): read from it, the program would
# not compile, and the signal would never be sent.
COMPILING = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_compiling_ends_the_start_with_one_line_and_no_files(signum, tmp_path):
    """SIGTERM's default left the run's files (the same command then refused: 'already
    holds a run'); SIGINT's exit crashed (139) in Python's teardown under the compile."""
    proc = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_COMPILING, str(int(signum)),
                           *SMALL, "--steps", "2", "--out-dir", str(tmp_path), "--name", "run"],
                          timeout=300, capture_output=True, text=True, env=COMPILING)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert [line for line in out.splitlines() if "error" in line.lower()] == [
        train_cli.INTERRUPTED], out
    assert "Traceback" not in out and list(tmp_path.iterdir()) == []


@pytest.fixture
def ctrl_c_in_a_gc_callback(monkeypatch):
    """Ctrl-C while a collection runs its callbacks (jax's runs at every one), as the
    trainer starts: Python drops the exception the handler raises there."""
    make = programs.make_optimizer

    def interrupted(*args, **kwargs):
        callback = lambda phase, info: signal.raise_signal(signal.SIGINT)
        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
        return make(*args, **kwargs)

    monkeypatch.setattr(programs, "make_optimizer", interrupted)


def test_ctrl_c_that_python_could_not_raise_still_ends_the_start(tmp_path, capfd,
                                                                ctrl_c_in_a_gc_callback):
    handler = signal.getsignal(signal.SIGINT)
    error = main(*SMALL, "--steps", "2", "--out-dir", str(tmp_path), "--name", "run")
    out = "".join(capfd.readouterr())
    assert error == train_cli.INTERRUPTED, out   # not trained to its end
    assert "Exception ignored" not in out and "Traceback" not in out, out
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is handler   # main() restores the handlers


# --- disks --------------------------------------------------------------------------------

@contextlib.contextmanager
def tmpfs(where: Path, size_kib: int, *options):
    where.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size_kib}k",
                                                                     *options]),
                            "tmpfs", str(where)], capture_output=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)])


def test_an_unwritable_out_dir_is_refused_before_compiling(tmp_path):
    (tmp_path / "file").write_text("")
    error = main(*SMALL, "--out-dir", str(tmp_path / "file" / "runs"))
    where = str(tmp_path / "file" / "runs")
    assert error == f"error: --out-dir {where!r} is not writable: Not a directory"
    with tmpfs(tmp_path / "ro", 64, "ro") as read_only:
        error = main(*SMALL, "--out-dir", str(read_only / "runs"))
        assert error.endswith("is not writable: Read-only file system")


def test_prefetch_with_tensor_parallelism_is_refused_before_compiling(tmp_path):
    error = main(*SMALL, "--layout", "owner", "--mesh.fsdp", "4", "--mesh.data", "1",
                 "--model.prefetch", "--out-dir", str(tmp_path))
    assert error == ("error: --model.prefetch gathers each owner group from a map manual "
                     "over the batch axes, so every other mesh axis must be 1: set "
                     "--mesh.tensor 1 (got tensor=2), or drop --model.prefetch")
    # A layout's options under another layout are refused, not ignored; so is fsdp's
    # keep-gathered where it would keep nothing (no pipeline stages).
    error = main(*SMALL, "--layout", "layerwise", "--model.keep-gathered", "--out-dir",
                 str(tmp_path))
    assert error == ("error: --model.keep-gathered applies to --layout fsdp or owner (or "
                     "auto), not layerwise")
    error = main(*SMALL, "--layout", "fsdp", "--model.keep-gathered", "--out-dir", str(tmp_path))
    assert error == ("error: --model.keep-gathered under fsdp keeps each pipeline stage's "
                     "weights gathered for the step: it needs --mesh.stage > 1, no live mesh "
                     "axis but the stage and batch axes, and experts not split (--mesh.expert "
                     "1)")


def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(
        trained, tmp_path, reader):
    # The trained run goes on from its checkpoint 2 on a disk with room for half a
    # checkpoint more: checkpoint 4 cannot fit. (Room sized from another run's checkpoint
    # failed once under two test processes: orbax writes a checkpoint in 16 to 24 files,
    # 432 to 508 KiB on disk, as its writes happen to batch, and 4 could fit.)
    with tmpfs(tmp_path / "disk", 8192) as disk:
        shutil.copytree(trained, disk / "run")
        folder = disk / "run" / "checkpoints"
        for step in ("4", "6"):
            shutil.rmtree(folder / step)
        half = sum(f.stat().st_blocks * 512 for f in (folder / "2").rglob("*")) // 2
        stat = os.statvfs(disk)
        used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
        subprocess.run(["mount", "-o", f"remount,size={(used + half) // 1024}k", str(disk)],
                       check=True)
        proc = cli(*SMALL, "--steps", "20", "--allow-change", "steps", "--checkpoint.every", "2",
                   "--eval-every", "100", "--out-dir", str(disk), "--name", "run", "--resume")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out
        errors = [line for line in out.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and "Traceback" not in out and "done:" not in out, out
        # The file is named where the failing write says which: TensorStore's errors
        # do; a Python-level write (orbax's metadata) may raise ENOSPC without one.
        assert re.fullmatch(rf"error: saving checkpoint {re.escape(str(folder / '4'))} failed: "
                            r"No space left on device( \((writing )?/.+\))?", errors[0]), out
        last = max(r["step"] for r in records(disk / "run"))
        assert last <= 8, "a failed background save stops the run at the next step or so"
        assert Checkpointer(folder).all_steps() == [2]
        assert int(reader(folder, 2)[0].step) == 2
