"""Several processes (hosts) under ``jax.distributed``: start-up, agreement, failure.

Every process runs the same program on one global mesh. The runtime must be
started before anything touches a device; after that JAX's coordination
service sends heartbeats, and a process that stops answering for
``heartbeat_timeout`` seconds ends every other one (XLA's message: "Terminating
process because the JAX distributed service detected fatal errors"). A peer
whose connections close (killed, crashed) is noticed at once by the next
collective; that error, like any other in a run of several processes, ends
this process immediately instead of waiting in the shutdown barrier for peers
that may be gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import traceback

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.train.config import DistConfig

# JAX's own start-up limit sits this far behind ours, so that ours speaks first.
_JAX_GRACE_S = 30


class DistError(RuntimeError):
    """The distributed runtime could not start; the message says why and what to check."""


# The variables jax's SLURM detection reads (jax/_src/clusters/slurm_cluster.py): all
# must be set for jax.distributed.initialize to fill in the rest from them.
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")


def _count(value: str | None) -> int:
    return int(value) if value and value.strip().isdigit() else 0


def launched_as_several(environ=os.environ) -> str | None:
    """Why the environment says this process is one of several that a launcher started
    (the variable that says so), or None. Follows what jax.distributed.initialize reads:
    JAX_COORDINATOR_ADDRESS; an srun step of more than one task (jax's SLURM variables);
    an mpirun of more than one rank (OMPI_COMM_WORLD_SIZE; jax finds the coordinator
    through Open MPI's OMPI_MCA_orte_hnp_uri, which Open MPI 5 no longer sets, so there
    initialize fails with a message asking for JAX_COORDINATOR_ADDRESS: better than
    N independent runs writing into one folder). TPU pods and Kubernetes, which jax
    detects only by querying services, still need --dist.auto."""
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return f"JAX_COORDINATOR_ADDRESS={environ['JAX_COORDINATOR_ADDRESS']}"
    if all(v in environ for v in _SLURM_VARS) and _count(environ["SLURM_NTASKS"]) > 1:
        return f"SLURM_NTASKS={environ['SLURM_NTASKS']}"
    if _count(environ.get("OMPI_COMM_WORLD_SIZE")) > 1:
        return f"OMPI_COMM_WORLD_SIZE={environ['OMPI_COMM_WORLD_SIZE']}"
    return None


def _flags_given(dist: DistConfig) -> bool:
    return any(v is not None for v in (dist.coordinator, dist.num_processes, dist.process_id))


def detected(dist: DistConfig, environ=os.environ) -> str | None:
    """The environment variable that turns on --dist.auto by itself: only without any
    --dist flag (explicit flags and --dist.no-detect win)."""
    if dist.auto or _flags_given(dist) or not dist.detect:
        return None
    return launched_as_several(environ)


def enabled(dist: DistConfig, environ=os.environ) -> bool:
    return dist.auto or _flags_given(dist) or detected(dist, environ) is not None


def check(dist: DistConfig) -> None:
    """Refuses an incomplete set of flags (``--dist.auto`` fills in from the environment)."""
    given = {"--dist.coordinator": dist.coordinator, "--dist.num-processes": dist.num_processes,
             "--dist.process-id": dist.process_id}
    missing = [k for k, v in given.items() if v is None]
    if not dist.auto and missing and len(missing) < len(given):
        raise DistError(f"missing {', '.join(missing)}: give all three (or --dist.auto to take "
                        "the rest from the cluster environment, e.g. SLURM)")
    if dist.coordinator is not None and ":" not in dist.coordinator:
        raise DistError(f"--dist.coordinator {dist.coordinator!r} must be HOST:PORT")
    if min(dist.init_timeout, dist.heartbeat_timeout) < 1:
        raise DistError("--dist.init-timeout and --dist.heartbeat-timeout must be >= 1 second")


def initialize(dist: DistConfig) -> None:
    """Starts ``jax.distributed`` if any --dist flag, or the environment of a launcher
    of several processes (see ``launched_as_several``), asks for it (nothing otherwise).
    Must run before any JAX operation. Raises DistError for flags or an environment
    it cannot use; when the coordinator or a peer does not show up within
    ``dist.init_timeout`` seconds, prints why and ends the process (exit status 1)."""
    check(dist)
    if not enabled(dist):
        return
    reason = detected(dist)
    auto = dist.auto or reason is not None
    address = dist.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    watchdog = threading.Timer(dist.init_timeout, _init_timed_out, (dist, address))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            dist.coordinator, dist.num_processes, dist.process_id,
            # Explicit flags win over any cluster environment the process happens to see.
            cluster_detection_method=None if auto else "deactivate",
            initialization_timeout=dist.init_timeout + _JAX_GRACE_S,
            heartbeat_timeout_seconds=dist.heartbeat_timeout)
    except (ValueError, TypeError, RuntimeError) as err:   # e.g. auto-detection found nothing
        hint = ""
        if auto:
            source = (f"{reason} makes this one of several processes, but jax found no SLURM "
                      "or Open MPI environment" if reason else
                      "--dist.auto found no SLURM, Open MPI or TPU environment")
            hint = (f" ({source} to fill in the rest; give --dist.coordinator, "
                    "--dist.num-processes and --dist.process-id, or set JAX_COORDINATOR_ADDRESS"
                    + ("; --dist.no-detect runs a single process)" if reason else ")"))
        raise DistError(f"cannot start jax.distributed: {err}{hint}") from None
    finally:
        watchdog.cancel()


def _init_timed_out(dist: DistConfig, address: str | None) -> None:
    """Runs in a thread when start-up takes too long: says why, then ends the process."""
    who = f"process {dist.process_id}" if dist.process_id is not None else "this process"
    reason = "not all processes joined"
    if address and dist.process_id != 0:
        host, port = address.rsplit(":", 1)
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
            reason = f"the coordinator {address} answers, but not all processes joined"
        except OSError as err:
            reason = f"the coordinator {address} is unreachable ({err})"
    fail_now(f"error: jax.distributed did not start within {dist.init_timeout} s "
             f"(--dist.init-timeout) on {who}: {reason}. Check that every process was "
             f"started with the same --dist.coordinator and --dist.num-processes "
             f"({dist.num_processes}) and a distinct --dist.process-id, and that the port is "
             "open between the hosts.")


def fail_now(message: str, code: int = 1) -> None:
    """Prints ``message`` and ends the process at once: no atexit shutdown barrier,
    which would wait (and then abort) for peers that may be dead."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


@contextlib.contextmanager
def fail_fast(heartbeat_timeout: int):
    """In a run of several processes, any error ends this process at once with a
    clear message (its peers then fail within ``heartbeat_timeout`` seconds, or at
    their next collective). A single process is left alone."""
    if jax.process_count() == 1:
        yield
        return
    try:
        yield
    except SystemExit as err:
        if isinstance(err.code, str):
            fail_now(err.code)
        if err.code not in (None, 0):
            fail_now(f"error: exit status {err.code}", err.code)
        raise
    except BaseException as err:   # noqa: BLE001 -- every error must end the process now
        if not isinstance(err, jax.errors.JaxRuntimeError):   # a failed collective needs none
            traceback.print_exc()
        first = str(err).strip().splitlines()[0][:400] if str(err).strip() else ""
        fail_now(f"error: process {jax.process_index()} of {jax.process_count()} failed: "
                 f"{type(err).__name__}: {first}\nIn a run of several processes this is "
                 "usually another process that died (see its log). Exiting now; the "
                 f"others stop within about {heartbeat_timeout} s (--dist.heartbeat-timeout).")


def is_main() -> bool:
    """Process 0 writes the logs, metrics, samples, plots and progress bar."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (nothing with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def same_on_all(value: int) -> int:
    """Process 0's ``value`` (an integer, |value| < 2**62), on every process."""
    if jax.process_count() == 1:
        return value
    # Two int32 halves: JAX without jax_enable_x64 turns an int64 into int32, which would
    # truncate any value >= 2**31 (time.time() in seconds from 2038 on).
    high, low = divmod(int(value), 2 ** 31)
    if not -2 ** 31 <= high < 2 ** 31:
        raise ValueError(f"same_on_all: {value} does not fit in 63 bits")
    pair = multihost_utils.broadcast_one_to_all(np.array([high, low], np.int32))
    return int(pair[0]) * 2 ** 31 + int(pair[1])


class AnyProcess:
    """Whether a flag is set on any process, agreed by all at the same step.

    ``poll(flag)`` starts the reduction of this step's flags and returns the
    previous step's answer, so the loop never waits for it (one step late).
    With one process it is the flag itself, at once.
    """

    def __init__(self):
        self.single = jax.process_count() == 1
        self.pending = None
        if not self.single:
            mesh = jax.make_mesh((jax.device_count(),), ("all",),
                                 axis_types=(jax.sharding.AxisType.Auto,))
            self.sharding = NamedSharding(mesh, P("all"))
            self.reduce = jax.jit(lambda x: x.max(), out_shardings=NamedSharding(mesh, P()))

    def poll(self, flag: bool) -> bool:
        if self.single:
            return flag
        local = np.full((jax.local_device_count(),), int(flag), np.int32)
        now = self.reduce(jax.make_array_from_process_local_data(
            self.sharding, local, (jax.device_count(),)))
        before, self.pending = self.pending, now
        return before is not None and bool(before)
