"""Several processes under jax.distributed, on one machine (127.0.0.1): two processes
x 4 virtual CPU devices train like one process with 8, write a checkpoint that one
process restores, and end with an error within the stated bound when a peer dies.

Every process runs under a deadline and is ended by its PID in a ``finally``.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import types
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import train as train_cli
from jmegatron.train import Trainer
from jmegatron.train.checkpoint import Checkpointer
from jmegatron.train.config import DistConfig
from jmegatron.train import distributed, loop
from jmegatron.train.distributed import DistError, check, detected, launched_as_several

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT = 10              # --dist.heartbeat-timeout of the runs here
BOUND = HEARTBEAT + 10      # README: a dead peer ends the others within the heartbeat + 10 s
KILL_AFTER = 5              # steps logged by process 0 before process 1 is killed
# The tiny preset on a small batch; data across the two processes, fsdp and tensor
# within each; evaluation and samples at step 2 and 4, checkpoints every 2 steps.
# --steps stays far ahead so that the schedule is the same in every run; every checkpoint
# is kept (step 2 must outlive the steps process 0 takes before it notices the kill).
RUN = ["--mesh.data", "2", "--mesh.fsdp", "2", "--mesh.tensor", "2", "--batch-size", "8",
       "--seq-len", "32", "--steps", "1000", "--log-every", "1", "--eval-every", "2",
       "--eval-batches", "1", "--sample-tokens", "4", "--checkpoint.every", "2",
       "--checkpoint.keep", "1000", "--no-progress"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with log.open("w") as out:   # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **(env or {})})


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records; a last line process 0 is still writing is left out."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    return out


def losses(run_dir: Path, key: str = "loss") -> dict:
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


def launch_pair(out: Path, name: str) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a run on 127.0.0.1, 4 CPU devices each; logs in out/."""
    dist = ["--dist.coordinator", f"127.0.0.1:{free_port()}", "--dist.num-processes", "2",
            "--dist.heartbeat-timeout", str(HEARTBEAT), "--cpu-devices", "4"]
    cli = [sys.executable, "-m", "experiments.train", *RUN, "--out-dir", str(out), "--name", name]
    return [launch(cli + dist + ["--dist.process-id", str(i)], out / f"process{i}.log")
            for i in range(2)]


def end(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()


def wait_until(condition, deadline_s: float, procs) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two processes train until process 0 has logged KILL_AFTER steps, then process 1
    is killed and process 0 timed until it exits. Alongside, one process with 8
    devices runs the same command (no --dist) up to that step."""
    out = tmp_path_factory.mktemp("multihost")
    one = launch([sys.executable, "-m", "experiments.train", *RUN, "--out-dir", str(out),
                  "--name", "one", "--stop-after", str(KILL_AFTER)], out / "one.log")
    procs = launch_pair(out, "two")
    survivor = {"returncode": None, "seconds": float("inf")}
    try:
        wait_until(lambda: len(losses(out / "two")) >= KILL_AFTER, 300, procs)
        running = [p.poll() is None for p in procs]
        if all(running):
            os.kill(procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            try:
                survivor["returncode"] = procs[0].wait(timeout=BOUND + 30)
                survivor["seconds"] = time.monotonic() - killed
            except subprocess.TimeoutExpired:
                pass
        one.wait(timeout=300)
    finally:
        end(procs + [one])
    logs = [(out / f"process{i}.log").read_text() for i in range(2)]
    assert all(running), f"a process ended before step {KILL_AFTER}:\n" + "\n".join(
        log[-3000:] for log in logs)
    assert one.returncode == 0, (out / "one.log").read_text()[-3000:]
    return {"out": out, "logs": logs, "survivor": survivor}


def test_two_processes_train_like_one_process_with_8_devices(runs):
    two, one = runs["out"] / "two", runs["out"] / "one"
    steps = sorted(losses(one))
    assert steps == list(range(1, KILL_AFTER + 1)) and set(steps) <= set(losses(two))
    np.testing.assert_allclose([losses(two)[s] for s in steps],
                               [losses(one)[s] for s in steps], rtol=1e-5)
    assert losses(two, "eval_loss").keys() == losses(one, "eval_loss").keys() == {2, 4}
    np.testing.assert_allclose(list(losses(two, "eval_loss").values()),
                               list(losses(one, "eval_loss").values()), rtol=1e-5)
    for sample in ("sample_greedy", "sample_top_k"):
        assert losses(two, sample) == losses(one, sample)
    config = json.loads((two / "config.json").read_text())
    assert config["processes"] == 2 and len(config["devices"]) == 8
    # Process 0 alone writes the log and the metrics (one record per step, not two).
    assert len([r for r in records(two) if "loss" in r]) == len(losses(two))
    assert "jmegatron | 8 x cpu" in runs["logs"][0]
    assert "jmegatron |" not in runs["logs"][1] and "val loss" not in runs["logs"][1]


def test_a_checkpoint_of_two_processes_restores_in_one(runs):
    out = runs["out"]
    # Step 2 is complete (orbax lists only finalized steps): process 0 logged step 5, so
    # save(4) had begun, and a save waits for the one before it to finish.
    written = Checkpointer(out / "two" / "checkpoints")
    steps = written.manager.all_steps()
    written.close()
    assert 2 in steps, steps
    cfg = train_cli.parse(RUN + ["--out-dir", str(out), "--name", "restored",
                                 "--resume-from", str(out / "two" / "checkpoints" / "2")])
    trainer = Trainer(cfg, log=lambda *_: None)   # this process, 8 devices
    try:
        assert trainer.start_step == 2
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), trainer.state)
        reference = Checkpointer(out / "one" / "checkpoints")
        want, _ = reference.restore(2, target, trainer.codecs)
        reference.close()
    finally:
        trainer.checkpointer.close()
    got = jax.tree.leaves_with_path(trainer.state)
    assert len(got) == len(jax.tree.leaves(want)) > 10
    for (path, a), b in zip(got, jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_killing_a_process_ends_the_other_with_an_error_in_bound(runs):
    survivor, log = runs["survivor"], runs["logs"][0]
    print(f"process 0 exited {survivor['seconds']:.2f} s after process 1 was killed")
    assert survivor["seconds"] < BOUND, f"process 0 still ran {BOUND} s after its peer died"
    assert survivor["returncode"] != 0
    assert ("error: process 0 of 2 failed" in log and "another process that died" in log) or (
        "Terminating process because the JAX distributed service detected fatal errors" in log
    ), log[-3000:]


@pytest.mark.slow   # a second pair of training processes: about 45 s of CPU
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    procs = launch_pair(tmp_path, "run")
    try:
        wait_until(lambda: len(losses(tmp_path / "run")) >= 3, 300, procs)
        assert all(p.poll() is None for p in procs), (tmp_path / "process0.log").read_text()
        os.kill(procs[1].pid, signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        end(procs)
    log = (tmp_path / "process0.log").read_text()
    assert codes == [0, 0], log[-3000:]
    step = max(losses(tmp_path / "run"))
    assert f"stopped by a signal to another process at step {step}; checkpoint saved" in log
    assert Checkpointer(tmp_path / "run" / "checkpoints").latest_step() == step


def test_an_unreachable_coordinator_is_one_clear_error_in_bound(tmp_path):
    address = f"127.0.0.1:{free_port()}"   # nobody listens there
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "--dist.coordinator",
                           address, "--dist.num-processes", "2", "--dist.process-id", "1",
                           "--dist.init-timeout", "3", "--out-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 3 + 30    # interpreter and imports, then 3 s
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert (f"error: jax.distributed did not start within 3 s (--dist.init-timeout) on process 1: "
            f"the coordinator {address} is unreachable") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_incomplete_flags_are_refused():
    with pytest.raises(DistError, match="missing --dist.process-id: give all three"):
        check(DistConfig(coordinator="10.0.0.1:1234", num_processes=2))
    with pytest.raises(DistError, match="must be HOST:PORT"):
        check(DistConfig(coordinator="10.0.0.1", num_processes=2, process_id=0))
    check(DistConfig(num_processes=2, auto=True))   # the environment fills in the rest
    check(DistConfig())                             # one process


SRUN_2 = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
          "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("env, why", [
    ({}, None),
    (SRUN_2, "SLURM_NTASKS=2"),
    ({**SRUN_2, "SLURM_NTASKS": "1"}, None),                 # srun -n 1: one process
    ({k: v for k, v in SRUN_2.items() if k != "SLURM_STEP_NODELIST"}, None),  # not in a step
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4"),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_COORDINATOR_ADDRESS=h:1"),
])
def test_a_launcher_of_several_processes_is_detected(env, why):
    assert launched_as_several(env) == why
    assert detected(DistConfig(), env) == why
    assert distributed.enabled(DistConfig(), env) == (why is not None)
    # --dist.no-detect and explicit flags win over the environment.
    assert detected(DistConfig(detect=False), env) is None
    assert not distributed.enabled(DistConfig(detect=False), env)
    flags = DistConfig(coordinator="h:1", num_processes=2, process_id=0)
    assert detected(flags, env) is None and distributed.enabled(flags, env)


def test_srun_alone_starts_jax_distributed_with_auto_detection(monkeypatch):
    """No --dist flag under srun of 2 tasks: jax.distributed starts with its cluster
    detection on (as --dist.auto); with --dist.no-detect it does not start."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    for key in ("JAX_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SRUN_2.items():
        monkeypatch.setenv(key, value)
    distributed.initialize(DistConfig(detect=False))
    assert calls == []
    distributed.initialize(DistConfig())
    assert calls == [((None, None, None), {"cluster_detection_method": None,
                                           "initialization_timeout": 300 + 30,
                                           "heartbeat_timeout_seconds": 60})]
    def refuse(*args, **kwargs):
        raise ValueError("coordinator_address should be defined.")
    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    with pytest.raises(DistError, match="SLURM_NTASKS=2 makes this one of several processes.*"
                                        "--dist.no-detect runs a single process"):
        distributed.initialize(DistConfig())


@pytest.mark.parametrize("processes", [1, 2])
def test_a_failed_run_waits_for_its_checkpoint_only_in_one_process(processes, monkeypatch):
    """With several processes, an error in the loop (a dead peer) must not wait for an
    async save and its barrier; one process still waits and closes."""
    closed = []

    class FailingRun:
        started = True

        def __init__(self, trainer):
            pass

        def loop(self, stop):
            raise RuntimeError("a collective failed")

        def close(self):
            closed.append("run")

    class Checkpointer:
        def wait(self):   # the background save finished
            pass

        def close(self):
            closed.append("checkpointer")

    monkeypatch.setattr(loop, "Run", FailingRun)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    trainer = loop.Trainer.__new__(loop.Trainer)
    trainer.checkpointer = Checkpointer()
    trainer.cfg, trainer.start_step = loop.TrainConfig(), 0
    trainer.claim = types.SimpleNamespace(release=lambda started: None)   # no run folder
    with pytest.raises(RuntimeError, match="a collective failed"):
        trainer.run()
    assert closed == (["run", "checkpointer"] if processes == 1 else ["run"])


# A process that joins through SLURM's variables alone (no --dist flag, as under srun);
# process 0's 2**40 + 3 reaches both; process 1 raises a stop flag at step 3 (as
# SIGTERM would), then both all-reduce in a loop.
PEER = textwrap.dedent("""
    import sys, time
    import jax, numpy as np
    from jmegatron.train.config import DistConfig
    from jmegatron.train.distributed import AnyProcess, fail_fast, initialize, same_on_all
    jax.config.update("jax_num_cpu_devices", 4)
    initialize(DistConfig(heartbeat_timeout=int(sys.argv[1])))
    print("joined", jax.process_index(), jax.process_count(), jax.device_count(), flush=True)
    print("same", same_on_all(2 ** 40 + 3 + 7 * jax.process_index()), flush=True)
    anyone = AnyProcess()
    agreed = [step for step in range(8)
              if anyone.poll(jax.process_index() == 1 and step >= 3)]
    print("stops at", agreed[0], flush=True)
    mesh = jax.make_mesh((8,), ("all",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.NamedSharding(mesh, jax.P("all"))
    total = jax.jit(lambda x: x.sum(), out_shardings=jax.NamedSharding(mesh, jax.P()))
    with fail_fast(int(sys.argv[1])):
        while True:
            x = jax.make_array_from_process_local_data(sharding, np.ones(4, np.float32), (8,))
            assert float(total(x)) == 8.0
            time.sleep(0.05)
""")


def slurm_env(process: int, port: int) -> dict:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(process), "SLURM_LOCALID": str(process),
            "JAX_COORDINATOR_PORT": str(port)}


def test_slurm_auto_and_a_silent_peer_end_within_the_heartbeat(tmp_path):
    """SLURM's variables alone start the run; a stop asked of one process is agreed by
    both at the same step; a peer that stops answering without closing its
    connections (a frozen or unplugged host: SIGSTOP here) ends the other process
    through the heartbeat, within the bound."""
    heartbeat, port = 4, free_port()
    logs = [tmp_path / f"peer{i}.log" for i in range(2)]
    procs = [launch([sys.executable, "-c", PEER, str(heartbeat)], logs[i], slurm_env(i, port))
             for i in range(2)]
    try:
        wait_until(lambda: all("stops at" in log.read_text() for log in logs), 120, procs)
        assert all(p.poll() is None for p in procs), logs[0].read_text()[-2000:]
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        returncode = procs[0].wait(timeout=heartbeat + 40)
        seconds = time.monotonic() - stopped
    finally:
        end(procs)
    for i, log in enumerate(logs):
        assert f"joined {i} 2 8" in log.read_text()
        assert f"same {2 ** 40 + 3}\n" in log.read_text()
        assert "stops at 4" in log.read_text()   # one step late, on both
    assert returncode != 0 and seconds < heartbeat + 10, (returncode, seconds)
    assert "detected fatal errors" in logs[0].read_text()
