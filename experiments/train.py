"""Train a GPT: `python -m experiments.train [--preset NAME] [--field value ...]`.

With no arguments it trains the `tiny` preset on the Python standard library's
own sources, on 8 virtual CPU devices when no accelerator is present. With
`--dist.*` flags it is one of several processes (hosts) on one global mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import tyro

from experiments.presets import PRESETS
from jmegatron.train import TrainConfig


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


def main(argv: list[str] | None = None) -> dict:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    # Before any JAX operation starts a backend (importing jax does not).
    jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    from jmegatron.train import distributed, plan_run, train
    from jmegatron.train.checkpoint import CheckpointError
    try:
        distributed.initialize(cfg.dist)   # several processes: before anything touches a device
    except distributed.DistError as err:
        sys.exit(f"error: {err}")
    with distributed.fail_fast(cfg.dist.heartbeat_timeout):   # no-op for one process
        try:
            plan = plan_run(cfg)   # every check of mesh, corpus and model; nothing compiled yet
        except ValueError as err:
            sys.exit(f"error: {err}")
        try:
            return train(cfg, plan)
        except CheckpointError as err:   # a checkpoint that does not fit: one line, no trace
            sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
