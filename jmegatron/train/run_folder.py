"""The run folder's rules: one run per folder, a checked out-dir, and the settings
a resume must keep (the resume contract)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from jmegatron.train.config import TrainConfig

# Outputs a run writes; a folder holding any of them holds a run.
RUN_FILES = ("checkpoints", "config.json", "metrics.jsonl", "samples.txt", "summary.json")
# Settings that change neither the math nor the data of a step, so a resume may change them.
FREE_MODEL_FIELDS = ("remat", "vocab_multiple", "padded_vocab_size", "layer_group")


def check_out_dir(out_dir: str | Path) -> None:
    """Raises ValueError (one line) unless files can be created under ``out_dir``."""
    out = Path(out_dir)
    probe = out / f".jmegatron-write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"--out-dir {str(out)!r} is not writable: {err.strerror or err}"
                         ) from None


def check_run_folder(run_dir: Path, cfg: TrainConfig) -> None:
    """A new run (no --resume) needs a folder that holds no run yet, or --overwrite."""
    held = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not held or cfg.resume or cfg.overwrite:
        return
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit())
    what = f"checkpoints {', '.join(map(str, steps))}" if steps else ", ".join(held)
    raise ValueError(f"run folder {run_dir} already holds a run ({what}): continue it with "
                     "--resume, start another with a new --name, or replace it with --overwrite")


def clear_run_folder(run_dir: Path) -> None:
    """--overwrite: the checkpoints go first, so a half-cleared folder never resumes."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


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
    """{name: (saved value, value now)} for every setting that differs. A setting the
    saved run predates (absent from ``saved``) ran at its value in ``defaults``."""
    saved = {**(defaults or {}), **saved}
    missing = object()
    return {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
            if saved.get(k, missing) != now.get(k, missing)}


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
