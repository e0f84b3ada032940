"""Train a GPT: `python -m experiments.train [--preset NAME] [--field value ...]`.

With no arguments it trains the `tiny` preset on the Python standard library's
own sources, on 8 virtual CPU devices when no accelerator is present. With
`--dist.*` flags it is one of several processes (hosts) on one global mesh.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import shlex
import signal
import sys
import threading
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT)
INTERRUPTED = ("error: interrupted while starting, before any step was trained: run the same "
               "command again to start")


class StartInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT (Ctrl-C) while the trainer starts (``StartSignals``)."""


class StartSignals:
    """SIGTERM and SIGINT until the training loop takes them over (its handler finishes
    the step and saves): each raises StartInterrupted, so that either ends a start with
    one line and removes what it created (``Claim.release``). SIGTERM's default ended
    the process on the spot and left the run's files: the same command was refused.

    Python cannot raise where it runs code on behalf of C: an exception raised in a gc
    callback (jax's ``_xla_gc_callback`` runs at every collection, and importing and
    tracing collect often), a ``__del__`` or a weakref callback is reported through
    ``sys.unraisablehook`` and dropped, and a Ctrl-C landing there was lost (the run
    trained to its end). ``arrived`` keeps the signal: ``check`` raises it where it
    propagates, and the loop asks for it once its own handler is in place."""

    def __init__(self):
        self.arrived: str | None = None

    def record(self, signum, frame) -> None:
        self.arrived = signal.Signals(signum).name

    def __call__(self, signum, frame) -> None:
        self.record(signum, frame)
        raise StartInterrupted(self.arrived)

    def check(self) -> None:
        if self.arrived:
            raise StartInterrupted(self.arrived)

    @contextlib.contextmanager
    def installed(self):
        """Handles SIGTERM and SIGINT for the duration (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        _drop_lost_interrupts()
        previous = {s: signal.signal(s, self) for s in SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.arrived = None


@functools.cache
def _drop_lost_interrupts() -> None:
    """A StartInterrupted that Python could not raise is reported once, as the start's
    line, and not also as 'Exception ignored in ...' with a traceback."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, StartInterrupted):
            previous(unraisable)

    sys.unraisablehook = hook


START = StartSignals()
if __name__ == "__main__":
    # The imports below take seconds: a signal is recorded until main() ends the start
    # for it (an exception out of an import would print a traceback).
    for signum in SIGNALS:
        signal.signal(signum, START.record)

import jax  # noqa: E402
import tyro  # noqa: E402

from experiments.presets import PRESETS  # noqa: E402
from jmegatron.train import TrainConfig  # noqa: E402
from jmegatron.train.config import ConfigError  # noqa: E402


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
    with START.installed():
        try:
            START.check()   # a signal during the imports
            return _start(argv)
        except KeyboardInterrupt:   # SIGTERM or Ctrl-C before the loop's own handler
            sys.exit(INTERRUPTED)


def _start(argv: list[str]) -> dict:
    try:
        cfg = parse(argv)
    except ConfigError as err:   # a value no setting accepts: one line, before anything runs
        sys.exit(f"error: {err}")
    # Before any JAX operation starts a backend (importing jax does not).
    jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    return _run(cfg, argv)


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
            summary = train(cfg, plan, resume_command(argv, plan.run_dir),
                            interrupted=lambda: START.arrived is not None)
        except (CheckpointError, TrainingError, HFError, RunFolderError,
                ConfigError) as err:   # one line, no trace
            sys.exit(f"error: {err}")
        if "error" in summary:   # already reported; the checkpoint was saved before it
            sys.exit(1)
        return summary


def _exit_interrupted() -> None:
    """Ends an interrupted start without Python's teardown. A signal ends jaxlib's wait
    for an XLA compile, not the compile, which goes on in XLA's thread pool; the
    teardown then collects JAX's client and destroys it under that compile, which
    crashed in C++ after the line (exit 139). The start has removed its files by now:
    its line is all that is left to do."""
    from jmegatron.train.distributed import fail_now
    fail_now(INTERRUPTED)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:
        if stop.code == INTERRUPTED:
            _exit_interrupted()
        raise
