"""One writer per run folder, nothing deleted before it is safe, paths kept inside
--out-dir, failed starts leaving nothing behind, finished runs left alone.

The tests continue or guard copies of conftest's small trained run (``run``); every
refusal is checked to be one line and to leave each file's bytes as they were."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from cli_runs import RUN, SMALL, main
from jmegatron.train import TrainConfig, run_folder
from jmegatron.train.lock import LOCK_NAME, RunFolderError, RunLock
from jmegatron.train import programs


def files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (but the lock), by relative path: its bytes' hash."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def one_line(error) -> str:
    assert isinstance(error, str) and error.startswith("error: ") and "\n" not in error, error
    return error


def continuing(run: Path, *flags) -> list[str]:
    return [*SMALL, "--out-dir", str(run.parent), "--name", run.name, *flags]


# --- one writer ---------------------------------------------------------------------------

def test_a_second_trainer_is_refused_while_the_first_trains_on_undisturbed(run):
    first = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *continuing(
            run, "--steps", "40", "--allow-change", "steps", "--checkpoint.every", "2",
            "--resume")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(r.get("step", 0) > 7 for r in records(run)):   # it is training
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.5)
        holder = json.loads((run / LOCK_NAME).read_text())
        assert holder["pid"] == first.pid
        for flags in (["--resume"], ["--overwrite"]):
            error = one_line(main(*continuing(run, "--steps", "40", *flags)))
            assert error == (f"error: run folder {run} is in use by another trainer (pid "
                             f"{first.pid} on {holder['host']}, since {holder['since']}); wait "
                             "for it to finish or stop it, or use another --name")
        out, _ = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0 and "done: 40 steps" in out, out
    steps = [r["step"] for r in records(run) if "loss" in r]
    assert steps == list(range(1, 41))   # none lost, none written twice
    assert json.loads((run / "summary.json").read_text())["steps"] == 40
    assert not (run / LOCK_NAME).exists()   # released at the end


def test_a_lock_left_by_a_killed_process_blocks_nothing(run):
    holder = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys; from jmegatron.train.lock import RunLock; "
        "RunLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)"), str(run)])
    assert holder.returncode == -signal.SIGKILL and (run / LOCK_NAME).exists()
    lock = RunLock(run)   # the kernel let go of it with the process
    lock.acquire()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(RunFolderError, match="in use by another trainer"):
        RunLock(run).acquire()   # held now, even by a second lock of the same process
    lock.release()
    assert not (run / LOCK_NAME).exists()


def test_a_finished_run_resumed_says_so_and_changes_nothing(run, capsys):
    subprocess.run([sys.executable, "-c", (   # a stale lock too: it must not matter
        "import os, signal, sys; from jmegatron.train.lock import RunLock; "
        "RunLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)"), str(run)])
    before = files(run)
    assert main(*continuing(run, "--steps", "6", "--checkpoint.every", "2", "--resume")) is None
    out = capsys.readouterr().out
    assert (f"run {run} is finished: its checkpoint is at step 6 of --steps 6; nothing to do "
            "(train on with a larger --steps and --allow-change steps)") in out
    assert files(run) == before and not (run / LOCK_NAME).exists()


# --- nothing deleted before it is safe ----------------------------------------------------

def test_overwrite_with_resume_is_refused_and_deletes_nothing(run):
    before = files(run)
    error = one_line(main(*continuing(run, "--overwrite", "--resume")))
    assert error == ("error: --overwrite with --resume: one deletes the run the other "
                     "continues; give one of them")
    step_4 = run / "checkpoints" / "4"
    error = one_line(main(*continuing(run, "--overwrite", "--resume-from", str(step_4))))
    assert error == (f"error: --overwrite would delete --resume-from {step_4}, which is inside "
                     f"the run folder {run}: start the new run under another --name")
    assert files(run) == before


def test_overwrite_deletes_only_a_runs_own_files(run, tmp_path):
    (run / "notes.txt").write_text("mine")
    before = files(run)
    error = one_line(main(*continuing(run, "--overwrite")))
    assert error == (f"error: --overwrite deletes only a run's own files, and {run} also holds "
                     "'notes.txt': it is no run folder (choose another --name, or move those "
                     "away)")
    assert files(run) == before
    # The parent of run folders is no run folder: `--name ..` could once delete in it.
    (tmp_path / "other").mkdir()
    error = one_line(main(*SMALL, "--out-dir", str(tmp_path / "other"), "--name", "..",
                          "--overwrite"))
    assert error.startswith("error: --name '..': must be one folder name")


@pytest.mark.parametrize("name", ["..", ".", "a/b", "/tmp/elsewhere", ""])
def test_run_names_stay_inside_the_out_dir(name, tmp_path):
    error = one_line(main(*SMALL, "--out-dir", str(tmp_path / "runs"), "--name", name))
    assert error == (f"error: --name {name!r}: must be one folder name (no '/', '..' or "
                     "absolute path): run folders stay inside --out-dir")
    assert not (tmp_path / "runs").exists() and not Path("/tmp/elsewhere").exists()


# --- failed starts ------------------------------------------------------------------------

def test_a_refused_resume_from_leaves_no_stub(run, tmp_path):
    runs = tmp_path / "fresh"
    error = one_line(main(*SMALL, "--out-dir", str(runs), "--name", "new", "--resume-from",
                          str(run / "checkpoints" / "5")))
    assert error == (f"error: no checkpoint at {run / 'checkpoints' / '5'} (the steps in "
                     f"{run / 'checkpoints'}: 2, 4, 6)")
    assert not (runs / "new").exists()


@pytest.fixture
def interrupted_start(monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(programs, "make_optimizer", interrupt)


def test_ctrl_c_while_starting_is_one_line_and_leaves_no_stub(tmp_path, interrupted_start):
    error = one_line(main(*SMALL, "--out-dir", str(tmp_path), "--name", "new"))
    assert error == ("error: interrupted while starting, before any step was trained: run the "
                     "same command again to start")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def out_of_memory(monkeypatch):
    """The first train step fails as XLA does when an allocation is too large."""
    make = programs.make_train_step

    def exhausted(*args, **kwargs):
        make(*args, **kwargs)
        def step(state, tokens):
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory allocating 1843200000000 bytes.")
        return step

    monkeypatch.setattr(programs, "make_train_step", exhausted)


def test_out_of_memory_at_the_first_step_is_one_line_and_leaves_no_stub(tmp_path, capsys,
                                                                        out_of_memory):
    error = one_line(main(*SMALL, "--steps", "4", "--out-dir", str(tmp_path), "--name", "new"))
    assert error == ("error: out of memory at step 1 (RESOURCE_EXHAUSTED: Out of memory "
                     "allocating 1843200000000 bytes.): lower --batch-size 8 or --seq-len 32, "
                     "raise --microbatches 1, or set --model.remat full")
    assert list(tmp_path.iterdir()) == []
    # A warmup longer than the run is stated, not shortened silently.
    assert ("note: --schedule.warmup-steps 30 is longer than the run (--steps 4): the warmup "
            "is cut to 4 steps") in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, want", [
    ("--model.n-layers", "0", "n_layers=0 must be >= 1"),
    ("--model.vocab-multiple", "0", "vocab_multiple=0 must be >= 1"),
    ("--model.init-std", "nan", "init_std=nan must be a finite number > 0"),
    ("--model.norm-eps", "-1", "norm_eps=-1.0 must be a finite number > 0"),
    ("--model.n-heads", "3", "n_heads=3 is not divisible by n_kv_heads=2"),
])
def test_bad_model_numbers_are_one_line_before_anything_runs(flag, value, want, tmp_path):
    assert one_line(main(*SMALL, flag, value, "--out-dir", str(tmp_path))) == f"error: {want}"
    assert list(tmp_path.iterdir()) == []


# --- folders that cannot be used, files that do not read --------------------------------------

def test_a_run_name_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file")
    error = one_line(main(*SMALL, "--out-dir", str(tmp_path), "--name", "taken"))
    assert error == f"error: run folder {tmp_path / 'taken'} is a file: choose another --name"
    assert (tmp_path / "taken").read_text() == "a file"


def test_a_read_only_run_folder_is_one_line(tmp_path):
    from test_reliability import tmpfs
    with tmpfs(tmp_path / "runs" / "ro", 64, "ro") as read_only:
        error = one_line(main(*SMALL, "--out-dir", str(read_only.parent), "--name", "ro"))
        assert error == f"error: run folder {str(read_only)!r} is not writable: Read-only file system"


def test_a_config_json_that_is_not_json_is_named_on_resume(run):
    (run / "config.json").write_text("{not json")
    before = files(run)
    error = one_line(main(*RUN, "--out-dir", str(run.parent), "--name", "run", "--resume"))
    assert error.startswith(f"error: {run / 'config.json'} is not readable JSON (")
    assert error.endswith("): repair it, or move it away")
    assert files(run) == before


def test_the_resume_refusal_lists_only_what_changed():
    muon = run_folder.run_settings(TrainConfig(optim="muon"))
    soap = run_folder.run_settings(TrainConfig(optim="soap"))
    defaults = run_folder.run_settings(TrainConfig(optim="muon"))
    # soap.shampoo_beta is None in both runs' defaults: once listed as `None -> None`.
    assert run_folder.changed_settings(soap, muon, defaults) == {"optim": ("soap", "muon")}
    assert run_folder.describe_changes(run_folder.changed_settings(soap, muon, defaults)) == \
        "optim: 'soap' -> 'muon'"


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}")]
