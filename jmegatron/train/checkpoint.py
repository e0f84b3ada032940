"""Checkpoints with orbax, in a layout-independent (canonical) form.

What is written does not depend on the mesh or the optimizer layout: block
weights as [L, ...] (not grouped [L/g, g, ...]), the vocabulary unpadded,
matrix-optimizer state in its parameter's shape or [*stack, k, k] per matrix
(not padded and reordered for layerwise owners). The sharding plan gives
every leaf of params and optimizer state its codec (``leaf_codecs``), so a
checkpoint restores onto any mesh and layout with the same model and
optimizer. Each device writes its own shards (orbax); nothing is gathered to
one host. Saving is asynchronous by default; orbax writes into a temporary
folder and renames it when complete, so a save killed half-way leaves
nothing that restores as whole. The meta item holds a checksum of every
canonical leaf, computed on the devices from the arrays being written and
compared whenever the checkpoint is read (restore, and the read-back after a
save): a damaged file is found, and named, before its numbers reach training.
A run whose optimizer changed (``--allow-change optim``) restores the saved
optimizer state where only its label differs (``carried_over``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path

import jax
import optax
import orbax.checkpoint as ocp

from jmegatron.optim.codec import LeafCodec, canonical_sharding
from jmegatron.optim.plan import ShardingPlan
from jmegatron.train.checksum import checksums_by_leaf
from jmegatron.train.config import CheckpointConfig
from jmegatron.train.distributed import barrier
from jmegatron.train.state import TrainState

FORMAT = 3   # 2: a checksum per leaf in the meta item; 3: optimizer state mirrors the params


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored here; the message names the leaf or file."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files do not hold what was written (unreadable, or a checksum
    differs): an older checkpoint may still be good."""


class SaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, permissions); the previous one stays."""


def leaf_codecs(state: TrainState, plan: ShardingPlan) -> TrainState:
    """A LeafCodec for every leaf of the train state, read from the plan: params by
    what their variables declare, optimizer state by tree structure
    (``ShardingPlan.state_codecs``), counts as they are."""
    return TrainState(LeafCodec(), plan.param_codecs(state.params),
                      plan.state_codecs(state.opt_state),
                      LeafCodec())


class Checkpointer:
    """Saves and restores one run's train state in canonical form, with a checksum of
    every leaf (``checksum.py``), checked whenever a checkpoint is read.

    Rotation is done here, not by orbax: after each save has finished (and, with
    ``verify``, read back equal to what was written), the newest ``keep`` checkpoints
    and every multiple of ``keep_period`` stay, and the newest *verified* one stays
    too while any newer one is unverified."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig = CheckpointConfig()):
        self.directory = Path(directory).absolute()
        self.cfg = cfg
        self.verified: set[int] = set()   # steps whose files were read back and matched
        self._unfinished = None           # (step, abstract canonical tree, checksums)
        self._encode = (None, None)       # (codecs, jitted encoder): compiled once per run
        _quiet_orbax_failures()
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=cfg.async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def save(self, step: int, state: TrainState, codecs: TrainState, meta: dict) -> None:
        """Writes the canonical form of ``state`` (asynchronously if configured), after
        finishing the previous save. Raises SaveError naming the folder and the OS error."""
        self.finish()
        if self._encode[0] is not codecs:
            self._encode = (codecs, jax.jit(lambda s: jax.tree.map(
                lambda c, x: c.encode(x), codecs, s,
                is_leaf=lambda c: isinstance(c, LeafCodec))))
        canonical = self._encode[1](state)
        sums = checksums_by_leaf(canonical)
        leaves = {jax.tree_util.keystr(p): list(x.shape)
                  for p, x in jax.tree.leaves_with_path(canonical)}
        record = {"format": FORMAT, "step": step, "leaves": leaves, "checksums": sums, **meta}
        with self._writing(step):
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(canonical), meta=ocp.args.JsonSave(record)))
        self._unfinished = (step, abstract_of(canonical), sums)

    def finish(self) -> None:
        """Waits for the last save, reads it back (``verify``) and rotates old checkpoints."""
        if self._unfinished is None:
            return
        self.wait()
        step, abstract, sums = self._unfinished
        self._unfinished = None
        if self.cfg.verify:
            self._compare(step, self._load(step, abstract), sums, "was written as")
            self.verified.add(step)
        self._rotate()

    def check(self) -> None:
        """Raises SaveError if a background save has failed (cheap: call every step)."""
        with self._writing(self._unfinished[0] if self._unfinished else None):
            self.manager.check_for_errors()

    def wait(self) -> None:
        with self._writing(self._unfinished[0] if self._unfinished else None):
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """Any failure of orbax's writers as one SaveError: the folder and the OS error."""
        try:
            yield
        except Exception as err:
            self._unfinished = None   # the previous checkpoint stays; this one never rotates
            # orbax's other failed writers are tasks nobody awaits: when collected, each
            # logs "Task exception was never retrieved" with its traceback (seen on a full
            # disk under load). This error is the one line the run ends with.
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            where = self.directory / str(step) if step is not None else self.directory
            raise SaveError(f"saving checkpoint {where} failed: {_os_error(err)}") from None

    def _rotate(self) -> None:
        steps = self.all_steps()
        keep = set(steps[-self.cfg.keep:])
        if self.cfg.keep_period:
            keep |= {s for s in steps if s % self.cfg.keep_period == 0}
        newest_verified = max(self.verified & set(steps), default=None)
        if newest_verified is not None and any(s > newest_verified and s not in self.verified
                                               for s in steps):
            keep.add(newest_verified)
        for step in sorted(set(steps) - keep):
            self.manager.delete(step)

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def read_meta(self, step: int) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:
            raise CheckpointDamaged(f"checkpoint {self.directory / str(step)} is damaged: "
                                    f"cannot read its meta ({error_line(err)})") from None

    def restore(self, step: int, target: TrainState,
                codecs: TrainState) -> tuple[TrainState, dict]:
        """The checkpoint at ``step`` in the shape and shardings of ``target``
        (abstract arrays with shardings): another mesh or layout is fine. Raises
        CheckpointDamaged if a file cannot be read or a leaf's checksum differs."""
        meta = self.read_meta(step)
        is_codec = lambda c: isinstance(c, LeafCodec)
        canonical = jax.eval_shape(
            lambda s: jax.tree.map(lambda c, x: c.encode(x), codecs, s,
                                   is_leaf=is_codec), target)
        labels = carried_over(canonical, meta)
        self._check_leaves(step, meta, relabelled(canonical, labels))
        shardings = jax.tree.map(lambda c, t, x: canonical_sharding(t.sharding, c, x.shape),
                                 codecs, target, canonical, is_leaf=is_codec)
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                canonical, shardings)
        loaded = self._load(step, relabelled(abstract, labels))
        self._compare(step, loaded, meta["checksums"], "was saved as")
        loaded = relabelled(loaded, {saved: now for now, saved in labels.items()})
        self.verified.add(step)
        decode = lambda s: jax.tree.map(
            lambda c, t, x: c.decode(x).astype(t.dtype), codecs, target, s,
            is_leaf=is_codec)
        out_shardings = jax.tree.map(lambda t: t.sharding, target)
        return jax.jit(decode, out_shardings=out_shardings)(loaded), meta

    def _load(self, step: int, abstract):
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as err:
            raise CheckpointDamaged(f"checkpoint {self.directory / str(step)} is damaged: "
                                    f"cannot read its arrays ({error_line(err)})") from None

    def _compare(self, step: int, loaded, sums: dict[str, str], verb: str) -> None:
        """Raises CheckpointDamaged naming the first leaf whose checksum differs."""
        got = checksums_by_leaf(loaded)
        bad = [leaf for leaf in got if got[leaf] != sums.get(leaf)]
        if bad:
            raise CheckpointDamaged(
                f"checkpoint {self.directory / str(step)} is damaged: leaf {bad[0]} reads back "
                f"with checksum {got[bad[0]]} but {verb} {sums.get(bad[0])} "
                f"({len(bad)} of {len(got)} leaves differ)")

    def set_aside(self, step: int) -> Path:
        """Moves a damaged checkpoint out of the way (to ``<dir>.damaged/STEP``, or
        ``STEP.1`` ... if that exists), so the step can be saved again; nothing is
        deleted. Returns where it went."""
        aside = self.directory.with_name(self.directory.name + ".damaged")
        names = itertools.chain([str(step)], (f"{step}.{i}" for i in itertools.count(1)))
        where = next(aside / name for name in names if not (aside / name).exists())
        if jax.process_index() == 0:
            aside.mkdir(parents=True, exist_ok=True)
            (self.directory / str(step)).rename(where)
        barrier(f"jmegatron set aside {step}")
        self.manager.reload()
        return where

    def _check_leaves(self, step: int, meta: dict, canonical) -> None:
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{self.directory / str(step)} has format "
                                  f"{meta.get('format')}, expected {FORMAT} (written by another "
                                  "version of jmegatron)")
        want = _leaf_shapes(canonical)
        saved = meta["leaves"]
        for leaf, shape in want.items():
            if leaf not in saved:
                raise CheckpointError(f"checkpoint {self.directory / str(step)} has no leaf {leaf} "
                                      f"(written by optimizer {meta.get('optim')!r}, model "
                                      f"{json.dumps(meta.get('model', {}))[:200]})")
            if saved[leaf] != shape:
                raise CheckpointError(f"checkpoint leaf {leaf} has shape {tuple(saved[leaf])}, but "
                                      f"this model needs {tuple(shape)} "
                                      f"({self.directory / str(step)})")
        extra = sorted(set(saved) - set(want))
        if extra:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} has leaves this run "
                                  f"does not: {extra[:5]}")

    def close(self) -> None:
        """Waits for a save in flight (its errors are the caller's to have seen) and closes."""
        try:
            self.manager.wait_until_finished()
        finally:
            self.manager.close()


def _is_partition(x) -> bool:
    return isinstance(x, optax.transforms.PartitionState)


def relabelled(tree, labels: dict[str, str]):
    """``tree`` with each ``optax.partition`` state's inner states renamed by ``labels``
    (old label -> new label; the others as they are)."""
    def rename(x):
        if not _is_partition(x):
            return x
        return x._replace(inner_states={labels.get(k, k): v for k, v in x.inner_states.items()})
    return jax.tree.map(rename, tree, is_leaf=_is_partition) if labels else tree


def carried_over(canonical, meta: dict) -> dict[str, str]:
    """{this run's label: the checkpoint's optimizer} where the run's optimizer differs
    from the one that wrote the checkpoint (``--allow-change optim``) but its state has
    the same leaves and shapes once relabelled (a matrix optimizer's state is keyed by
    its name in an ``optax.partition``: Muon, MuonBP, MOP and Dion2 each keep a count
    and a momentum per matrix); else {}."""
    saved = meta.get("optim")
    partitions = jax.tree.leaves(canonical, is_leaf=_is_partition)
    labels = {k for x in partitions if _is_partition(x) for k in x.inner_states}
    if saved is None or saved in labels:
        return {}
    for label in sorted(labels):
        if _leaf_shapes(relabelled(canonical, {label: saved})) == meta.get("leaves"):
            return {label: saved}
    return {}


def _leaf_shapes(tree) -> dict[str, list[int]]:
    """Each leaf's path and shape, as the meta item records them."""
    return {jax.tree_util.keystr(p): list(x.shape) for p, x in jax.tree.leaves_with_path(tree)}


def abstract_of(tree):
    """Shapes, dtypes and shardings of ``tree``'s arrays (a restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def _os_error(err: BaseException) -> str:
    """The operating system's words for why a write failed, and the file: from an
    OSError, or from TensorStore's message (``... "PATH" ... [os_error_code='28']``)."""
    first = err
    while err is not None:
        if isinstance(err, OSError):
            return f"{err.strerror or err}" + (f" ({err.filename})" if err.filename else "")
        text = str(err)
        code = re.search(r"os_error_code='?(\d+)", text)
        if code:
            files = re.findall(r'"(/[^"]+)"', text)
            return os.strerror(int(code.group(1))) + (f" (writing {files[-1]})" if files else "")
        err = err.__cause__ or err.__context__
    return error_line(first)


def _orbax_leftover(record: logging.LogRecord) -> bool:
    """False for asyncio's report of an orbax read or write whose error nobody retrieved
    (orbax leaves the others of a failed restore or save as such futures). Each is
    reported when it is garbage-collected, from whatever allocation triggers that; its
    traceback, formatted there, can run ast.parse inside another ast.parse, which Python
    3.11.7 turns into a SystemError in the outer one (CPython gh-106905: it failed a
    test's command-line parse on CI)."""
    err = record.exc_info[1] if record.exc_info else None
    if err is None or "never retrieved" not in str(record.msg):
        return True
    files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(err.__traceback__)]
    ours = any("orbax" in f or "tensorstore" in f for f in files)
    return not (ours or "TensorStore" in str(err) or "OCDBT" in str(err))


def _orbax_errors(record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


@functools.cache
def _quiet_orbax_failures() -> None:
    """A failed write makes orbax log the error with a traceback in each of its writer
    threads, and TensorStore's callbacks then hit orbax's closed event loop (reported
    through ``sys.unraisablehook``): hundreds of lines for one full disk; and the reads
    and writes a failure leaves unawaited are reported by asyncio when collected
    (``_orbax_leftover``). Each failure reaches the user once instead, as the SaveError
    or CheckpointDamaged raised here."""
    logging.getLogger("absl").addFilter(_orbax_errors)
    logging.getLogger("asyncio").addFilter(_orbax_leftover)
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = hook


def error_line(err: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters; without orbax's
    pointer to TensorStore's details, which names a Python method, not a fact)."""
    text = str(err).strip().splitlines()
    line = text[0].split(" See full TensorStore details")[0] if text else ""
    return f"{type(err).__name__}: {line[:300]}"
