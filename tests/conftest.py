"""Tests run on 8 virtual CPU devices; this must happen before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # see experiments/__init__.py
# Test programs are small: compiling dominates, and LLVM's optimization passes cost
# more than they save (test_layouts: 93 s instead of about 170 s on 2 cores). It sets
# LLVM's level only: every HLO, collective and memory check passes unchanged.
# A collective waits for every device thread of its program. With two test processes
# on 2 cores (pytest.ini_options: -n 2) a thread can lag past XLA:CPU's 40 s before it
# calls the collective, which aborts the process: the tests wait 5 min instead (a
# deadlock, collectives started in different orders, still ends the process).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_backend_optimization_level=0",
                                    "--xla_cpu_collective_call_terminate_timeout_seconds=300",
                                    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
                                    ]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


import ast  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402


def _without_collections(parse):
    """``ast.parse`` that holds garbage collection off while it runs (see below)."""
    @functools.wraps(parse)
    def wrapped(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return parse(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return wrapped


# CPython before 3.11.8 keeps the AST constructor's recursion depth in state that all
# threads share (gh-106905). A collection inside ast.parse runs Python code (jax's gc
# callback at every collection, finalizers), where the GIL can pass to another thread;
# if that thread parses too (formatting a traceback does, and so do inspect.getsource
# and inspect.signature), the first parse fails: "SystemError: AST constructor
# recursion depth mismatch". tyro parses the config classes' module at every command
# line it reads (inspect.getsource), and the tests leave orbax and TensorStore threads
# behind: with a thread formatting tracebacks alongside, 7 of 100 parses of the
# trainer's flags failed so. With no collection inside a parse no other thread runs there.
if sys.version_info < (3, 11, 8):
    ast.parse = _without_collections(ast.parse)


import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """One small run trained by the CLI (6 steps, checkpoints at 2, 4 and 6), shared by
    the modules that damage, continue or guard copies of it."""
    from cli_runs import RUN, main
    base = tmp_path_factory.mktemp("trained")
    assert main(*RUN, "--out-dir", str(base), "--name", "run") is None
    return base / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run folder, in ``tmp_path/runs/run``."""
    copy = tmp_path / "runs" / "run"
    shutil.copytree(trained, copy)
    return copy
