"""Train a GPT: `python -m experiments.train [--preset NAME] [--field value ...]`.

With no arguments it trains the `tiny` preset on the Python standard library's
own sources, on 8 virtual CPU devices when no accelerator is present. With
`--dist.*` flags it is one of several processes (hosts) on one global mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import jax
import tyro

from experiments.presets import PRESETS
from jmegatron.train import TrainConfig
from jmegatron.train.config import ConfigError


def parse(argv: list[str]) -> TrainConfig:
    """``--preset`` picks the defaults; tyro parses every other field on top of them.
    A mesh given on the command line is taken as it is (no fitting to the devices)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    known, rest = pre.parse_known_args(argv)
    description = (f"{__doc__}\nPreset: {known.preset} (choose with --preset "
                   f"{{{','.join(PRESETS)}}}; the defaults below are the preset's).")
    cfg = tyro.cli(TrainConfig, default=PRESETS[known.preset](), args=rest,
                   description=description)
    if any(arg.startswith("--mesh.") for arg in rest):
        cfg = dataclasses.replace(cfg, fit_mesh=False)
    return cfg


# Flags the continuation command replaces (with a value, then without one).
_RUN_FLAGS = ("--name", "--out-dir", "--resume-from", "--stop-after")
_SWITCHES = ("--resume", "--no-resume", "--overwrite", "--no-overwrite")


def resume_command(argv: list[str], run_dir: Path) -> str:
    """The command that continues this run: the same flags, in its folder, with --resume."""
    kept, skip = [], False
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if skip or flag in _SWITCHES or flag in _RUN_FLAGS:
            skip = flag in _RUN_FLAGS and "=" not in arg and not skip
            continue
        kept.append(arg)
    return shlex.join(["python", "-m", "experiments.train", *kept, "--name", run_dir.name,
                       "--out-dir", str(run_dir.parent), "--resume"])


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse(argv)
    except ConfigError as err:   # a value no setting accepts: one line, before anything runs
        sys.exit(f"error: {err}")
    # Before any JAX operation starts a backend (importing jax does not).
    jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    try:
        return _run(cfg, argv)
    except KeyboardInterrupt:   # Ctrl-C before the loop's own handler is installed
        sys.exit("error: interrupted while starting, before any step was trained: run the "
                 "same command again to start")


def _run(cfg: TrainConfig, argv: list[str]) -> dict:
    from jmegatron.train import distributed, plan_run, train
    from jmegatron.train.checkpoint import CheckpointError
    from jmegatron.train.lock import RunFolderError
    from jmegatron.models.hf import HFError
    from jmegatron.train.loop import TrainingError
    try:
        distributed.initialize(cfg.dist)   # several processes: before anything touches a device
    except distributed.DistError as err:
        sys.exit(f"error: {err}")
    with distributed.fail_fast(cfg.dist.heartbeat_timeout):   # no-op for one process
        try:
            plan = plan_run(cfg)   # every check of mesh, corpus and model; nothing compiled yet
        except (ValueError, ConfigError) as err:
            sys.exit(f"error: {err}")
        try:
            summary = train(cfg, plan, resume_command(argv, plan.run_dir))
        except (CheckpointError, TrainingError, HFError, RunFolderError,
                ConfigError) as err:   # one line, no trace
            sys.exit(f"error: {err}")
        if "error" in summary:   # already reported; the checkpoint was saved before it
            sys.exit(1)
        return summary


if __name__ == "__main__":
    main()
