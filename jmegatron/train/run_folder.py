"""The run folder's rules: one run per folder and one trainer at a time (``Claim``),
a checked out-dir, what --overwrite may delete, and the settings a resume must keep
(the resume contract)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from jmegatron.jsonfile import json_object
from jmegatron.train.config import TrainConfig
from jmegatron.train.distributed import is_main, same_on_all
from jmegatron.train.lock import LOCK_NAME, RunFolderError, RunLock

# Outputs a run writes; a folder holding any of them holds a run.
RUN_FILES = ("checkpoints", "config.json", "metrics.jsonl", "samples.txt", "summary.json")
# Everything a run folder may hold: what --overwrite deletes (and nothing else).
OWN_FILES = RUN_FILES + ("checkpoints.damaged", "routing.txt", "loss.png", "metrics.jsonl.tmp",
                         "samples.txt.tmp", LOCK_NAME)
# Settings that change neither the math nor the data of a step, so a resume may change them.
FREE_MODEL_FIELDS = ("remat", "attention", "context_attention", "context_order",
                     "vocab_multiple", "padded_vocab_size", "layer_group", "stages", "repeats",
                     "prefetch", "keep_gathered")


def check_out_dir(out_dir: str | Path, what: str = "--out-dir") -> None:
    """Raises ValueError (one line) unless files can be created under ``out_dir``."""
    out = Path(out_dir)
    probe = out / f".jmegatron-write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{what} {str(out)!r} is not writable: {err.strerror or err}"
                         ) from None


def held_files(run_dir: Path) -> list[str]:
    """The run outputs ``run_dir`` holds (none: it holds no run)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def check_run_folder(run_dir: Path, cfg: TrainConfig) -> None:
    """Raises ValueError (one line) unless this run may write into ``run_dir``: a
    writable folder (or none yet) that holds no run, or one that --resume continues
    or --overwrite replaces (then holding only a run's own files)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run folder {run_dir} is a file: choose another --name")
    if run_dir.is_dir():
        check_out_dir(run_dir, what="run folder")
    held = held_files(run_dir)
    if cfg.overwrite:
        _check_overwrite(run_dir, cfg)
    elif held and not cfg.resume:
        steps = sorted(int(p.name) for p in (run_dir / "checkpoints").glob("*")
                       if p.name.isdigit())
        what = f"checkpoints {', '.join(map(str, steps))}" if steps else ", ".join(held)
        raise ValueError(f"run folder {run_dir} already holds a run ({what}): continue it "
                         "with --resume, start another with a new --name, or replace it with "
                         "--overwrite")
    if cfg.resume and (run_dir / "config.json").exists():
        read_json(run_dir / "config.json")


def _check_overwrite(run_dir: Path, cfg: TrainConfig) -> None:
    """--overwrite deletes a run's own files only, and never the checkpoint it starts from."""
    if cfg.resume_from and _inside(Path(cfg.resume_from), run_dir):
        raise ValueError(f"--overwrite would delete --resume-from {cfg.resume_from}, which is "
                         f"inside the run folder {run_dir}: start the new run under another "
                         "--name")
    if run_dir.is_dir():
        foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in OWN_FILES)
        if foreign:
            raise ValueError(f"--overwrite deletes only a run's own files, and {run_dir} also "
                             f"holds {', '.join(map(repr, foreign[:3]))}"
                             f"{' ...' if len(foreign) > 3 else ''}: it is no run folder "
                             "(choose another --name, or move those away)")


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ValueError (one line) naming the file if it is not one."""
    return json_object(path, hint=": repair it, or move it away")


def clear_run_folder(run_dir: Path) -> None:
    """--overwrite: the checkpoints go first, so a half-cleared folder never resumes.
    Only a run's own files go (``check_run_folder`` refused any other); the lock stays."""
    for name in OWN_FILES:
        path = run_dir / name
        if name == LOCK_NAME:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


class Claim:
    """A run's hold on its folder, from before anything is written until the run ends.

    Process 0 takes the folder's lock (``jmegatron.train.lock``) and checks the folder
    again under it; every process learns whether it got it. ``release(started)``
    unlocks; a start that failed before its first step (an invalid setting found late,
    a refused checkpoint, out of memory, Ctrl-C) in a folder that held no run removes
    what it created, so that the same command can simply be run again.
    """

    def __init__(self, run_dir: Path, cfg: TrainConfig):
        self.run_dir, self.lock = run_dir, RunLock(run_dir)
        self.created = not run_dir.exists()
        self.before: set[str] | None = None   # the folder's entries once locked
        error = None
        if is_main():
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                self.lock.acquire()
                # What a failed start may remove, read once no one else writes here.
                self.before = set(os.listdir(run_dir))
                check_run_folder(run_dir, cfg)   # as planned, now under the lock
            except (OSError, ValueError, RunFolderError) as err:
                self.release(started=False)
                error = RunFolderError(str(err))
        agreed = same_on_all(int(error is None))   # before raising: the others wait for it
        if error is not None:
            raise error
        if not agreed:
            raise RunFolderError(f"process 0 could not take the run folder {run_dir} (see "
                                 "its log)")

    def release(self, started: bool) -> None:
        """Unlocks; without a first step, removes what a failed start created."""
        if self.lock.fd is None:   # not taken (or not process 0): nothing of ours to undo
            return
        if not started and self.before is not None and not self.before & set(RUN_FILES):
            if self.created:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            else:
                for name in set(os.listdir(self.run_dir)) - self.before - {LOCK_NAME}:
                    path = self.run_dir / name
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.lock.release()


def run_settings(cfg: TrainConfig) -> dict[str, object]:
    """The settings that define a run, by dotted flag name (``model.d_model``, ``lr``,
    ``schedule.kind`` ...): what a resume must keep unless --allow-change names it."""
    groups = {"model": cfg.model, "data": cfg.data, "schedule": cfg.schedule,
              "adamw": cfg.adamw, **{name: getattr(cfg, name) for name in cfg.optimizer_groups}}
    flat = {k: getattr(cfg, k) for k in ("optim", "lr", "weight_decay", "weight_decay_method",
                                         "grad_clip", "z_loss", "qk_clip", "qk_clip_alpha", "init_from", "seed", "batch_size", "seq_len",
                                         "steps")}
    for group, value in groups.items():
        for key, item in _flatten(dataclasses.asdict(value), group).items():
            if not (group == "model" and key.split(".")[1] in FREE_MODEL_FIELDS):
                flat[key] = item
    return json.loads(json.dumps(flat))   # as a checkpoint's JSON gives it back


def _flatten(tree: dict, prefix: str) -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        out.update(_flatten(value, name) if isinstance(value, dict) else {name: value})
    return out


def changed_settings(saved: dict, now: dict, defaults: dict | None = None) -> dict[str, tuple]:
    """{name: (saved value, value now)} for every setting of this run that differs. A
    setting the saved run predates (absent from ``saved``) ran at its value in
    ``defaults``; one that only the saved run has (another optimizer's group) is
    covered by the change of ``optim`` itself."""
    saved = {**(defaults or {}), **saved}
    missing = object()
    return {k: (saved.get(k), now[k]) for k in sorted(now) if saved.get(k, missing) != now[k]}


def refused_changes(changes: dict[str, tuple], allowed: tuple[str, ...]) -> dict[str, tuple]:
    """The changes ``allowed`` (names or groups, dashes or underscores) does not cover."""
    allow = {a.replace("-", "_") for a in allowed}
    covered = lambda name: any(name == a or name.startswith(a + ".") for a in allow)
    return {k: v for k, v in changes.items() if not covered(k)}


def describe_changes(changes: dict[str, tuple]) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


def trim_records(run_dir: Path, step: int) -> None:
    """On resume: drop the metrics and samples of steps after ``step`` (the steps a crash
    lost are trained again, and must not appear twice)."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        lines = [line for line in metrics.read_text().splitlines() if line.strip()
                 and json.loads(line).get("step", 0) <= step]
        _replace(metrics, "".join(line + "\n" for line in lines))
    samples = run_dir / "samples.txt"
    if samples.exists():
        blocks = samples.read_text().split("=== step ")
        kept = [b for b in blocks[1:] if int(b.split(" ", 1)[0]) <= step]
        _replace(samples, blocks[0] + "".join("=== step " + b for b in kept))


def _replace(path: Path, text: str) -> None:
    """Writes ``text`` to a temporary file and renames it over ``path`` (never half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
