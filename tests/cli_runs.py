"""Running the trainer's CLI in tests: a small model's flags, in this process or a new one."""

import subprocess
import sys

from experiments import train as train_cli

SMALL = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "2",
         "--model.n-kv-heads", "2", "--model.d-ff", "64", "--batch-size", "8", "--seq-len", "32",
         "--eval-batches", "1", "--sample-tokens", "8", "--no-progress", "--log-every", "1",
         "--eval-every", "3"]
RUN = SMALL + ["--steps", "6", "--checkpoint.every", "2"]


def main(*args) -> str | None:
    """Runs the CLI in this process; returns the error line it exits with (None if none)."""
    try:
        train_cli.main(list(args))
    except SystemExit as stop:
        return stop.code
    return None


def cli(*args) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, stdout and stderr together."""
    return subprocess.run([sys.executable, "-m", "experiments.train", *args], timeout=600,
                          capture_output=True, text=True)
