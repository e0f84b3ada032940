"""The training loop: set up, train, evaluate, sample, record, summarize."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm import tqdm

from jmegatron.data import eval_batch, make_batch, unigram_entropy
from jmegatron.models import hf
from jmegatron.sharding import logical_to_spec
from jmegatron.sharding.schedules import SCHEDULES, make_schedule
from jmegatron.sharding import rules as ax
from jmegatron.train import run_folder
from jmegatron.train.checkpoint import (Checkpointer, CheckpointDamaged, CheckpointError, FORMAT,
                                        SaveError, abstract_of, error_line, leaf_codecs)
from jmegatron.train.config import TrainConfig
from jmegatron.train.distributed import AnyProcess, barrier, is_main
from jmegatron.train.metrics import MetricsWriter, jsonable, measure_matmul_rate
from jmegatron.train.planning import Plan, plan_run, resolve_model
from jmegatron.train.plots import plot_runs
from jmegatron.train.programs import (RunPrograms, differences, programs_key,
                                      shared_programs)
from jmegatron.train.sample import sample_texts


class TrainingError(RuntimeError):
    """A run that cannot go on (its message is one line); the last checkpoint stays."""


class Trainer:
    """Everything a run needs, built once; ``run()`` trains."""

    def __init__(self, cfg: TrainConfig, plan: Plan | None = None, log=print,
                 resume_command: str | None = None, programs: RunPrograms | None = None):
        """``programs``: another Trainer's (``Trainer.programs``), to run without compiling
        again; its settings may differ only in ``UNCOMPILED`` ones (a run stopped and
        resumed in one process). Raises ValueError, naming the settings, otherwise."""
        cfg = resolve_model(cfg)
        plan = plan or plan_run(cfg)
        self.cfg, self.log = cfg, log if is_main() else (lambda *args, **kwargs: None)
        self.run_dir = plan.run_dir
        self.claim = run_folder.Claim(plan.run_dir, cfg)   # one trainer per run folder
        try:
            self._build(plan, resume_command, programs)
        except BaseException:   # a failed start leaves nothing that blocks a retry
            self.claim.release(started=False)
            raise

    def _build(self, plan: Plan, resume_command: str | None,
               programs: RunPrograms | None) -> None:
        cfg = self.cfg
        self.resume_command = resume_command or (
            f"the same settings with --resume --name {plan.run_dir.name} "
            f"--out-dir {plan.run_dir.parent}")
        self.mesh_cfg, self.model_cfg, self.corpus, self.layout = (
            plan.mesh, plan.model, plan.corpus, plan.layout)
        self.layout_choice = plan.choice
        self.rules = plan.rules
        key = programs_key(cfg, plan)
        if programs is None:
            programs = shared_programs(cfg, plan)
        elif programs.key != key:
            raise ValueError("the programs given were built for other settings: " +
                             ", ".join(differences(programs.key, key)))
        self.programs, built = programs, programs.programs
        self.mesh, self.optimizer, self.graphdef = built.mesh, built.optimizer, built.graphdef
        self.train_step, self.eval_step, self.sampler = (built.train_step, built.eval_step,
                                                         programs.sampler)
        # Each window of T+1 tokens whole on its batch ranks: the loss deals its T inputs
        # and targets over a context axis (models.context.sequence_order).
        self.batch_sharding = NamedSharding(self.mesh,
                                            logical_to_spec((ax.BATCH, None), self.rules))
        self.state = built.init()
        if cfg.init_from and not (cfg.resume or cfg.resume_from):
            self.state = self.state._replace(params=self._initial_params())
        self.codecs = leaf_codecs(self.state, self.optimizer.plan)
        if cfg.overwrite:   # every check has passed: only now does the old run go
            if is_main():
                run_folder.clear_run_folder(self.run_dir)
            barrier("jmegatron overwrite")
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint)
        self.resumed: dict = {}   # where this run continues from, and what it changed
        self.start_step = self._resume() if cfg.resume or cfg.resume_from else 0

    def _initial_params(self) -> nnx.State:
        """--init-from's weights, read shard by shard, where the plan keeps params."""
        loaded = nnx.state(hf.load(self.cfg.init_from[3:], self.mesh, self.rules,
                                   cfg=self.model_cfg))
        self.log(f"initialized from {self.cfg.init_from}")
        return jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), loaded,
                            self.state.params)

    def _resume(self) -> int:
        """Restores the checkpoint ``--resume``/``--resume-from`` names; returns its step.
        Without an explicit step, a damaged checkpoint is reported and the next older one
        tried; damaged ones of this run's own folder are set aside (kept, not deleted)."""
        source, step = self.checkpointer, None
        if self.cfg.resume_from:
            path = Path(self.cfg.resume_from)
            if path.name.isdigit():
                path, step = path.parent, int(path.name)
            if not path.is_dir():
                raise CheckpointError(f"no checkpoint folder at {path}")
            source = Checkpointer(path, dataclasses.replace(self.cfg.checkpoint,
                                                            async_save=False))
        steps = source.all_steps()
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint at {path / str(step)} (the steps in {path}: "
                                  f"{', '.join(map(str, steps)) or 'none'})")
        candidates = [step] if step is not None else steps[::-1]
        if not candidates:
            raise CheckpointError(f"no complete checkpoint in {source.directory}")
        damaged = []
        for candidate in candidates:
            try:
                meta = self._restore(source, candidate)
                break
            except CheckpointDamaged as err:
                if step is not None:
                    raise
                self.log(f"warning: {err}; trying the one before")
                damaged.append(candidate)
        else:
            raise CheckpointError(f"no checkpoint in {source.directory} verifies "
                                  f"(steps {', '.join(map(str, damaged))} are damaged)")
        where = source.directory / str(candidate)
        self.log(f"resumed from {where} (written with layout {meta.get('layout')}, mesh "
                 f"{meta.get('mesh')}; checksums verified)")
        if source is self.checkpointer:
            for bad in damaged:
                self.log(f"set the damaged checkpoint {bad} aside: {source.set_aside(bad)}")
            if is_main():
                run_folder.trim_records(self.run_dir, int(meta["step"]))
        return int(meta["step"])

    def _restore(self, source: Checkpointer, step: int) -> dict:
        """Restores ``step`` into ``self.state`` after checking the resume contract."""
        meta = source.read_meta(step)
        where = source.directory / str(step)
        changes = {}
        if meta.get("format") == FORMAT:   # older formats are refused by restore itself
            defaults = run_folder.run_settings(TrainConfig(optim=self.cfg.optim))
            changes = run_folder.changed_settings(meta["run"], run_folder.run_settings(self.cfg),
                                                  defaults)
            refused = run_folder.refused_changes(changes, self.cfg.allow_change)
            if refused:
                raise CheckpointError(
                    f"{where} was written by a run with other settings "
                    f"({run_folder.describe_changes(refused)}): resume with the run's own "
                    f"settings, or accept the change with --allow-change {' '.join(refused)}")
        self.state, meta = source.restore(step, abstract_of(self.state), self.codecs)
        self.resumed = {"step": int(meta["step"]), "from": str(where),
                        "changes": {k: list(v) for k, v in changes.items()}}
        return meta

    def save(self, step: int) -> None:
        """Writes a checkpoint of the current state (in the background if configured)."""
        meta = {"seed": self.cfg.seed, "optim": self.cfg.optim, "layout": self.layout.name,
                "mesh": self.mesh_cfg.sizes(), "model": dataclasses.asdict(self.model_cfg),
                "run": run_folder.run_settings(self.cfg)}
        self.checkpointer.save(step, self.state, self.codecs, meta)

    def batch(self, step: int) -> jax.Array:
        c = self.cfg
        return make_batch(self.corpus.train, c.batch_size, c.seq_len, c.seed, step,
                          self.batch_sharding)

    def evaluate(self) -> float:
        """Mean validation loss over the fixed eval batches."""
        c = self.cfg
        losses = [self.eval_step(self.state.params, eval_batch(
            self.corpus.val, c.batch_size, c.seq_len, c.seed, i, self.batch_sharding))
            for i in range(c.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

    def samples(self, step: int) -> tuple[str, str]:
        c = self.cfg
        return sample_texts(self.sampler, self.state.params, c.sample_prompt, c.sample_tokens,
                            c.seq_len, self.mesh, self.rules, c.seed + step,
                            self.corpus.tokenizer)

    def run(self, interrupted: Callable[[], bool] = lambda: False) -> dict:
        """Trains up to ``cfg.steps`` steps and returns the summary. ``interrupted``:
        whether a signal came while starting that could not stop the start (the CLI's
        ``StartSignals``); asked once the loop's own handler has taken over."""
        if self.start_step >= self.cfg.steps:
            return self._finished()
        run = None
        try:
            run = Run(self)
            with stop_on_signals() as stop:
                if interrupted():   # a signal the start could not raise
                    raise KeyboardInterrupt
                summary = run.loop(stop)
        except BaseException as err:
            if run is not None:
                with contextlib.suppress(OSError):   # a full disk fails its last flush too
                    run.close()
            # With several processes an error here is usually a dead peer: waiting for an
            # async save (and its cross-process barrier) would hold this process until the
            # heartbeat ends it. Leave the save unfinished (the last complete checkpoint
            # stays) so that fail_fast can exit at once. One process waits and closes; a
            # failed save reports itself once, as the error being raised.
            failed_save = None
            if jax.process_count() == 1:
                try:
                    self.checkpointer.wait()   # a failed background save: its SaveError
                except SaveError as save_err:
                    failed_save = save_err
                with contextlib.suppress(Exception):
                    self.checkpointer.close()
            self.claim.release(started=run is not None and run.started)
            if _out_of_memory(err):
                raise TrainingError(self._out_of_memory_line(err, run)) from None
            if isinstance(err, OSError) and failed_save is not None:
                raise failed_save from None   # a background save filled the disk: the cause
            raise
        run.close()
        self.checkpointer.close()
        self.claim.release(started=True)
        return summary

    def close(self) -> None:
        """Lets go of the run folder without training (a Trainer that is never run)."""
        self.checkpointer.close()
        self.claim.release(started=False)

    def _finished(self) -> dict:
        """--resume of a run that has trained its --steps: says so and changes nothing
        (``close`` removes only a folder this start created, for --resume-from)."""
        self.close()
        summary = {"steps": self.start_step, "run_dir": str(self.run_dir)}
        with contextlib.suppress(ValueError):   # its numbers, if it wrote them
            summary = run_folder.read_json(self.run_dir / "summary.json")
        self.log(f"run {self.run_dir} is finished: its checkpoint is at step {self.start_step} "
                 f"of --steps {self.cfg.steps}; nothing to do (train on with a larger --steps "
                 "and --allow-change steps)")
        return {**summary, "finished": True}

    def _out_of_memory_line(self, err: BaseException, run: "Run | None") -> str:
        c = self.cfg
        when = ("after the first step" if run is not None and run.started
                else f"at step {self.start_step + 1}")
        return (f"out of memory {when} ({str(err).splitlines()[0][:160]}): lower "
                f"--batch-size {c.batch_size} or --seq-len {c.seq_len}, raise --microbatches "
                f"{c.microbatches}, or set --model.remat full")


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err)


class Run:
    """The outputs of one run: run folder, metrics, samples, plot and summary."""

    def __init__(self, trainer: Trainer):
        self.t, cfg = trainer, trainer.cfg
        self.dir = trainer.run_dir
        self.main = is_main()   # process 0 writes every output; the others only compute
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
        resumed_here = cfg.resume and trainer.start_step > 0   # metrics were trimmed to it
        self.metrics = MetricsWriter(self.dir, append=resumed_here) if self.main else Discard()
        if self.main and not resumed_here:
            (self.dir / "samples.txt").write_text("")
        self.skips_in_a_row = 0   # consecutive skipped steps (--max-skipped)
        self.started = False   # a first step has finished: the run is no failed start
        self.entropy = unigram_entropy(trainer.corpus.val)
        self.flops_per_token = trainer.model_cfg.flops_per_token(cfg.seq_len)
        self.optimizer_flops = trainer.optimizer.flops_per_step
        self.peak = measure_matmul_rate(trainer.mesh, trainer.model_cfg.dtype)
        if self.main:
            self._write_config()
        self._announce()

    def _write_config(self) -> None:
        t = self.t
        record = {"config": dataclasses.asdict(t.cfg), "mesh": t.mesh_cfg.sizes(),
                  "padded_vocab": t.model_cfg.vocab, "params": t.model_cfg.param_count(),
                  "optimizer_flops_per_step": t.optimizer.flops_per_step,
                  "corpus": t.corpus.source, "devices": [str(d) for d in jax.devices()],
                  "processes": jax.process_count(), "resumes": self._resumes()}
        (self.dir / "config.json").write_text(json.dumps(record, indent=2))
        (self.dir / "routing.txt").write_text(t.optimizer.routing_table + "\n")

    def _resumes(self) -> list[dict]:
        """Every resume of this run folder (step, source, accepted setting changes)."""
        t, path = self.t, self.dir / "config.json"
        earlier = (run_folder.read_json(path).get("resumes", [])
                   if t.cfg.resume and path.exists() else [])
        return earlier + ([t.resumed] if t.resumed else [])

    def _announce(self) -> None:
        t = self.t
        t.log(f"jmegatron | {jax.device_count()} x {jax.devices()[0].device_kind} | "
              f"mesh {t.mesh_cfg} | {t.model_cfg.param_count() / 1e6:.2f}M params | "
              f"corpus {t.corpus.source}: {len(t.corpus.train):,} train / "
              f"{len(t.corpus.val):,} val tokens | val unigram entropy {self.entropy:.3f} | "
              f"run dir {self.dir}")
        if t.layout_choice:
            t.log(t.layout_choice)
        groups = t.optimizer.leaf_groups
        prefetch = "+prefetch" if t.model_cfg.prefetch else ""
        t.log(f"optimizer {t.cfg.optim}, layout {t.layout.label}{prefetch}: " + ", ".join(
            f"{groups.count(g)} leaves {g}" for g in sorted(set(groups))) +
            f" | {t.cfg.optim} matmuls {self.optimizer_flops / 1e9:.2f} GFLOP/step "
            f"(routing and ownership: {self.dir / 'routing.txt'})")
        if t.layout.stages > 1:
            stages, micro, cfg = t.layout.stages, t.cfg.microbatches, t.model_cfg
            stacks = [(n, kind) for n, kind in ((cfg.dense_layers, "dense"),
                                                (cfg.n_layers - cfg.dense_layers, "MoE")) if n]
            v, name = t.cfg.pipeline.repeats, t.cfg.pipeline.schedule
            table = make_schedule(name, stages, micro, v, len(stacks))
            per_stage = (f"{-(-cfg.n_layers // stages)} layers" if len(stacks) == 1 else
                         " + ".join(f"{-(-n // stages)} {kind}" for n, kind in stacks)
                         + " layers (one pipeline)")
            schedule = f"{name} in {v} chunks a stage" if v > 1 else name
            bubble = (SCHEDULES[name].formula if table.repeats == v else
                      f"counted on its {table.repeats} chunks a stage")
            t.log(f"pipeline: {stages} stages of {per_stage}, {schedule} over {micro} "
                  f"microbatches: {table.ticks} ticks, bubble "
                  f"{bubble} = {table.bubble:.1%}")
        warmup = t.cfg.schedule.warmup_steps
        if warmup > t.cfg.steps:
            t.log(f"note: --schedule.warmup-steps {warmup} is longer than the run (--steps "
                  f"{t.cfg.steps}): the warmup is cut to {t.cfg.steps} steps, so the learning "
                  "rate reaches its peak at the last step and does not decay")

    def loop(self, stop: "StopFlag") -> dict:
        t, cfg = self.t, self.t.cfg
        tokens_per_step = cfg.batch_size * cfg.seq_len
        bar = tqdm(total=cfg.steps, initial=t.start_step,
                   disable=not (cfg.progress and self.main), dynamic_ncols=True, desc="train")
        anyone = AnyProcess()   # all processes stop at the same step when one is signalled
        start = time.perf_counter()
        mark, mark_step, last, eval_loss = start, t.start_step, {}, float("nan")
        previous = None   # (step, skipped flag) of the step before: read without waiting
        for step in range(t.start_step, cfg.steps):
            t.state, metrics = t.train_step(t.state, t.batch(step))
            done = step + 1
            if previous is not None:
                self._count_skip(*previous)
            previous = (done, metrics["skipped"])
            t.checkpointer.check()   # a background save that failed stops the run here
            first = done == t.start_step + 1
            if first or done % cfg.log_every == 0 or done == cfg.steps:
                metrics = jax.device_get(metrics)
                now = time.perf_counter()
                # Throughput over the interval; the first step (compile) is not timed.
                dt = (now - mark) / max(done - mark_step, 1)
                last = self._log_step(done, metrics, float("nan") if first else dt)
                self.started = True   # the first step ran (its metrics were read)
                mark, mark_step = now, done
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                                max_logit=f"{last['max_attention_logit']:.1f}")
            if done % cfg.eval_every == 0 and done != cfg.steps:
                eval_loss = self._evaluate(done)
                # Evaluation time is not training time.
                mark, mark_step = time.perf_counter(), done
            bar.update(1)
            signalled = anyone.poll(stop.signal is not None)
            if signalled or done == cfg.stop_after:
                bar.close()
                return self._stopped(done, stop.signal or ("a signal to another process"
                                                           if signalled else "--stop-after"))
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != cfg.steps:
                t.save(done)
        bar.close()
        if previous is not None:
            self._count_skip(*previous)
        seconds = time.perf_counter() - start
        t.save(cfg.steps)
        t.checkpointer.finish()   # written (and read back) before anything else can fail
        return self._summarize(seconds, last, *self._final_evaluation())

    def _final_evaluation(self) -> tuple[float, str | None]:
        """(val loss, None), or (NaN, the error) if it fails: the checkpoint is safe."""
        try:
            return self._evaluate(self.t.cfg.steps), None
        except Exception as err:
            where = self.t.checkpointer.directory / str(self.t.cfg.steps)
            error = (f"the final evaluation failed ({error_line(err)}); the checkpoint "
                     f"{where} is saved")
            self.t.log(f"error: {error}")
            return float("nan"), error

    def _count_skip(self, step: int, skipped: jax.Array) -> None:
        """Counts consecutive skipped steps; raises TrainingError at --max-skipped."""
        self.skips_in_a_row = self.skips_in_a_row + 1 if bool(skipped) else 0
        n = self.skips_in_a_row
        if n >= self.t.cfg.max_skipped:
            latest = self.t.checkpointer.latest_step()
            last = ("none" if latest is None else self.t.checkpointer.directory / str(latest))
            raise TrainingError(
                f"{n} steps in a row were skipped up to step {step} (non-finite loss, gradients, "
                f"params or optimizer state; the state is that after step {step - n}); the last "
                f"checkpoint is {last}. Try a lower --lr (--max-skipped sets the patience)")

    def _stopped(self, step: int, signal_name: str) -> dict:
        t = self.t
        t.save(step)
        t.checkpointer.finish()
        where = t.checkpointer.directory / str(step)
        t.log(f"stopped by {signal_name} at step {step}; checkpoint saved in {where}\n"
              f"continue with: {t.resume_command}")
        return {"stopped": signal_name, "steps": step, "checkpoint": str(where),
                "run_dir": str(t.run_dir)}

    def _log_step(self, step: int, metrics: dict, step_time: float) -> dict:
        t, cfg = self.t, self.t.cfg
        tokens_per_s = cfg.batch_size * cfg.seq_len / step_time
        flops = self.flops_per_token * tokens_per_s
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "skipped"},
                  "tokens_per_s": tokens_per_s, "step_time_s": step_time,
                  "model_flops_per_s": flops, "optimizer_flops_per_s":
                  self.optimizer_flops / step_time, "mfu": flops / self.peak,
                  "matmul_flops_per_s": self.peak, "skipped_steps": int(t.state.skipped)}
        self.metrics.write(record)
        return record

    def _evaluate(self, step: int) -> float:
        loss = self.t.evaluate()
        record = {"step": step, "eval_loss": loss, "eval_ppl": perplexity(loss)}
        # --sample-tokens 0: no samples, and no sampler compiled.
        samples = self.t.samples(step) if self.t.cfg.sample_tokens else None
        if samples is not None:
            record.update(sample_greedy=samples[0], sample_top_k=samples[1])
        self.metrics.write(record)
        if not self.main:
            return loss
        line = f"step {step}: val loss {loss:.3f} (ppl {perplexity(loss):.2f})"
        if samples is not None:
            greedy, top_k = samples
            with (self.dir / "samples.txt").open("a") as f:
                f.write(f"=== step {step} | val loss {loss:.3f}\n--- greedy\n{greedy}\n"
                        f"--- top-{self.t.cfg.top_k}\n{top_k}\n\n")
            line += f"\n  greedy: {greedy[:120]!r}\n  top-k:  {top_k[:120]!r}"
        tqdm.write(line)
        return loss

    def _summarize(self, seconds: float, last: dict, eval_loss: float,
                   error: str | None = None) -> dict:
        t = self.t
        summary = jsonable({
            "steps": t.cfg.steps, "seconds": seconds, "train_loss": last.get("loss"),
            "val_loss": eval_loss, "val_ppl": perplexity(eval_loss),
            "val_unigram_entropy": self.entropy, "val_loss_over_entropy": eval_loss / self.entropy,
            "tokens_per_s": last.get("tokens_per_s"), "mfu": last.get("mfu"),
            "model_flops_per_s": last.get("model_flops_per_s"),
            "optimizer_flops_per_s": last.get("optimizer_flops_per_s"),
            "skipped_steps": int(t.state.skipped), "run_dir": str(self.dir),
            **({"error": error} if error else {})})
        if self.main:
            (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
            plot_runs([self.dir], self.dir / "loss.png")
        f = lambda key, spec, scale=1.0: ("-" if summary[key] is None
                                          else format(summary[key] * scale, spec))
        t.log(f"done: {t.cfg.steps} steps in {seconds:.0f}s | train loss {f('train_loss', '.3f')} "
              f"| val loss {f('val_loss', '.3f')} (ppl {f('val_ppl', '.2f')}) vs unigram "
              f"entropy {self.entropy:.3f} (ratio {f('val_loss_over_entropy', '.2f')}) | "
              f"{f('tokens_per_s', ',.0f')} tok/s | MFU {f('mfu', '.1f', 100)}% (model "
              f"{f('model_flops_per_s', ',.1f', 1e-9)} + optimizer "
              f"{f('optimizer_flops_per_s', ',.1f', 1e-9)} GFLOP/s of {self.peak / 1e9:,.0f} "
              f"measured) | skipped {summary['skipped_steps']} | {self.dir}")
        return summary

    def close(self) -> None:
        self.metrics.close()


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (a diverged run), NaN for NaN."""
    return math.inf if loss > 709 else math.exp(loss)


class Discard:
    """The metrics writer of processes other than 0."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class StopFlag:
    """Set by SIGTERM or SIGINT; the loop finishes the step, saves and leaves."""

    signal: str | None = None


@contextlib.contextmanager
def stop_on_signals():
    """Turns SIGTERM and SIGINT into a StopFlag for the duration (main thread only)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    def handler(signum, frame):
        flag.signal = signal.Signals(signum).name
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def train(cfg: TrainConfig, plan: Plan | None = None, resume_command: str | None = None,
          interrupted: Callable[[], bool] = lambda: False) -> dict:
    """Runs one training and returns its summary (``resume_command``: what the stop
    message tells the user to run to continue; ``interrupted``: ``Trainer.run``'s)."""
    return Trainer(cfg, plan, resume_command=resume_command).run(interrupted)
