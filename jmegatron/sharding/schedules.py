"""Pipeline schedules as data: which work each stage does at each tick.

A schedule is a ``Schedule``: for every (tick, stage), the work item whose
forward the stage runs (item i = r M + k: microbatch k through the stage's
chunk r, its repeat) and the item whose backward it runs; -1 where the stage
idles. One interpreter runs every table (``sharding.own_backward``), and the
tick count, the bubble and the buffers a stage keeps are counted on them, not
derived from a schedule's name.

  gpipe     all forwards, then all backwards: the forward of item t - s at tick t
            on stage s, the backwards from the last stage back once it has run
            its last forward; every microbatch in flight; 2(M + S) - 3 ticks.
  circular  the same over V M items (V chunks a stage, the last stage's outputs
            wrapping around to stage 0), the backwards last chunk first.
  1f1b      a forward and a backward a tick: each microbatch's backward starts
            as soon as its forward has left the last stage; at most 2(S - s) - 1
            microbatches in flight on stage s; M + 2S - 2 ticks.
  interleaved-1f1b  1f1b over V chunks a stage (Megatron's interleaved
            schedule): microbatches in groups of S, each group through chunk 0,
            then chunk 1, ...; backwards in the reverse chunk order; at most
            2(S - s - 1) + (V - 1) S + 1 chunk inputs in flight on stage s.

The tables are simulated tick by tick from each stage's order of work
(``_simulated``): a stage runs its next forward once its input has arrived, and
its next backward once its input gradient has, so a table holds only work whose
inputs exist (``Schedule.buffers`` checks it).
A new schedule is a builder in ``SCHEDULES`` returning its tables.

References:
  Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism", arXiv:1811.06965, 2019.
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", arXiv:2104.04473, 2021 (1F1B and its
    interleaved form).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, NamedTuple

import numpy as np


class Buffers(NamedTuple):
    """Where a stage of an own-backward schedule keeps what passes between its ticks:
    [ticks, S] slot tables (-1: nothing) and the slots each buffer needs.

    ``inputs`` holds a chunk input from its arrival (or, for a microbatch's first
    chunk, its embedding at the forward) until its backward; what the forward keeps
    for the backward (``own_backward.Stash``) has slots of the same index; ``grads`` holds an input gradient from its arrival until its backward
    reads it (the last chunk's backward starts from the loss instead)."""

    arrive: np.ndarray          # the slot the activation received at this tick goes to
    forward_slot: np.ndarray    # the slot the forward reads (a first chunk's: writes)
    backward_slot: np.ndarray   # the slot the backward reads
    inputs: int
    grad_arrive: np.ndarray     # the slot the gradient received at this tick goes to
    grad_slot: np.ndarray       # the slot the backward's input gradient is in
    grads: int


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """One schedule's tables for S stages, M microbatches and V chunks a stage (all the
    stacks' chunks, where the schedule runs several stacks as one pipeline)."""

    name: str
    stages: int
    microbatches: int
    repeats: int
    forward: np.ndarray    # [ticks, S] work item r M + k, or -1
    backward: np.ndarray   # [ticks, S] work item, or -1

    @property
    def ticks(self) -> int:
        """The ticks of the schedule's loops."""
        return self.forward.shape[0]

    @functools.cached_property
    def phases(self) -> tuple[tuple[int, int, bool, bool], ...]:
        """The runs of ticks doing the same kinds of work: (first tick, end, whether
        some stage runs a forward, whether some stage runs a backward). A tick runs
        only the work its phase has (1f1b's first S - 1 ticks only forwards, its last
        S - 1 only backwards; gpipe's forwards, then backwards)."""
        kinds = [(bool((self.forward[t] >= 0).any()), bool((self.backward[t] >= 0).any()))
                 for t in range(self.ticks)]
        out, start = [], 0
        for kind, run in itertools.groupby(kinds):
            n = len(list(run))
            out.append((start, start + n, *kind))
            start += n
        return tuple(out)

    @property
    def bubble(self) -> float:
        """The idle share of the stages' work slots: a forward and a backward slot per
        tick of the phases that run them (a forward and a backward counted alike)."""
        slots = sum((end - start) * (f + b) for start, end, f, b in self.phases) * self.stages
        work = (self.forward >= 0).sum() + (self.backward >= 0).sum()
        return float(1 - work / slots)

    @functools.cached_property
    def buffers(self) -> Buffers:
        """The ``Buffers`` of the tables; ValueError where a table runs work before its
        input exists. Slots are taken lowest-free-first, and a slot is free again the
        tick after its holder's backward."""
        arrive, fwd, bwd, g_arrive, g_bwd = (np.full(self.forward.shape, -1) for _ in range(5))
        inputs_used = grads_used = 0
        for s in range(self.stages):
            inputs, grads = self._intervals(s)
            slot, used = _colour({item: (start, b) for item, (start, _, b) in inputs.items()})
            inputs_used = max(inputs_used, used)
            for item, (start, f, b) in inputs.items():
                fwd[f, s] = bwd[b, s] = slot[item]
                if s or item >= self.microbatches:   # a first chunk's input is embedded
                    arrive[start, s] = slot[item]
            slot, used = _colour(grads)
            grads_used = max(grads_used, used)
            for item, (start, b) in grads.items():
                g_arrive[start, s] = g_bwd[b, s] = slot[item]
        return Buffers(arrive, fwd, bwd, inputs_used, g_arrive, g_bwd, grads_used)

    def _tick(self, table: np.ndarray, stage: int, item: int) -> int:
        ticks = np.flatnonzero(table[:, stage] == item)
        if len(ticks) != 1:
            raise ValueError(f"the {self.name} table runs item {item} {len(ticks)} times "
                             f"on stage {stage}")
        return int(ticks[0])

    def _intervals(self, s: int):
        """({item: (first tick held, tick of its forward, tick of its backward)} of
        stage ``s``'s inputs, {item: (first tick held, tick of its backward)} of its
        input gradients)."""
        inputs, grads = {}, {}
        source = functools.partial(_source, self.stages, self.microbatches, self.repeats, s)
        for item in range(self.repeats * self.microbatches):
            f, b = (self._tick(t, s, item) for t in (self.forward, self.backward))
            sent = source(item)
            start = f if sent is None else self._tick(self.forward, *sent) + 1   # or embedded
            if not start <= f <= b:
                raise ValueError(f"the {self.name} table runs item {item} on stage {s} "
                                 f"before its input (arrives at tick {start}, forward at "
                                 f"{f}, backward at {b})")
            inputs[item] = (start, f, b)
            sent = source(item, backward=True)
            if sent is None:
                continue   # its backward starts from the loss
            arrives = self._tick(self.backward, *sent) + 1
            if arrives > b:
                raise ValueError(f"the {self.name} table runs item {item}'s backward on "
                                 f"stage {s} at tick {b}, before its gradient arrives "
                                 f"({arrives})")
            grads[item] = (arrives, b)
        return inputs, grads


def _source(stages: int, m: int, chunks: int, stage: int, item: int,
            backward: bool = False) -> tuple[int, int] | None:
    """(stage, item) whose output (``backward``: input gradient) is ``item``'s input
    (input gradient) on ``stage``: the same item on the stage before (after), or,
    around the ring where the chunks wrap, the previous (next) chunk's on the last
    (first) stage; None where the item starts there: a first chunk is embedded, the
    last chunk's backward starts from the loss."""
    if not backward:
        return (stage - 1, item) if stage else ((stages - 1, item - m) if item >= m else None)
    if stage < stages - 1:
        return stage + 1, item
    return (0, item + m) if item < (chunks - 1) * m else None


def _colour(spans: dict) -> tuple[dict, int]:
    """({key: slot}, slots used) for intervals {key: (start, end)}: in order of start,
    each takes the lowest slot whose holder's end is before its start."""
    free_after, slot = {}, {}
    for key, (start, end) in sorted(spans.items(), key=lambda kv: kv[1]):
        i = next(i for i in itertools.count() if free_after.get(i, -1) < start)
        free_after[i], slot[key] = end, i
    return slot, len(free_after)


class ScheduleKind(NamedTuple):
    """A registered schedule: its builder and its bubble as the startup line prints it."""

    build: Callable[[int, int, int], tuple[np.ndarray, np.ndarray]]
    formula: str
    chunked: bool = False   # runs V >= 2 chunks a stage (the others: one)
    groups: bool = False    # takes the microbatches in groups of S (M a multiple of S)


def _simulated(stages: int, m: int, v: int, forward_order, backward_order, in_flight,
               flush: bool = False):
    """(forward, backward) tables of stages that each run their forwards in
    ``forward_order`` and their backwards in ``backward_order`` (lists of items),
    each tick the next forward whose input has arrived (a tick after its sender ran
    it) while fewer than ``in_flight(stage)`` of its items await their backward, then
    the next backward whose gradient has arrived (the last chunk on the last stage:
    once its forward has run, that tick or before); with ``flush``, a stage's first
    backward waits for its last forward."""
    items = v * m
    done = {(d, s): {} for d in "fb" for s in range(stages)}   # item -> its tick
    sent = lambda kind, src, t: done[kind, src[0]].get(src[1], t) < t   # by tick t - 1
    rows = []
    for t in itertools.count():
        if all(len(done["b", s]) == items for s in range(stages)):
            break
        if t > 4 * (items + stages):
            raise ValueError(f"the schedule's orders deadlock at tick {t}")
        row = np.full((2, stages), -1)
        for s in range(stages):
            fwd, bwd = done["f", s], done["b", s]
            source = functools.partial(_source, stages, m, v, s)
            if len(fwd) < items and len(fwd) - len(bwd) < in_flight(s):
                i = forward_order[len(fwd)]
                if source(i) is None or sent("f", source(i), t):   # embedded, or arrived
                    fwd[i], row[0, s] = t, i
            if len(bwd) < items and not (flush and len(fwd) < items):
                j = backward_order[len(bwd)]
                src = source(j, backward=True)
                if (fwd.get(j, t + 1) <= t) if src is None else sent("b", src, t):
                    bwd[j], row[1, s] = t, j
        rows.append(row)
    table = np.stack(rows)
    return table[:, 0], table[:, 1]


def _flushed(s: int, m: int, v: int):
    """GPipe (v = 1) and circular: every stage runs its forwards in order (a
    microbatch's chunks V ticks of M apart), then its backwards, last chunk first."""
    items = range(v * m)
    return _simulated(s, m, v, list(items), sorted(items, key=lambda i: (-(i // m), i % m)),
                      lambda stage: v * m, flush=True)


def _one_f_one_b(s: int, m: int, v: int):
    """1F1B (v = 1) and its interleaved form: Megatron's orders, groups of S
    microbatches through the chunks in turn (backwards: last chunk first)."""
    group = lambda i, reverse: (i % m // s, (v - 1 - i // m) if reverse else i // m, i % m % s)
    items = range(v * m)
    return _simulated(s, m, v, sorted(items, key=lambda i: group(i, False)),
                      sorted(items, key=lambda i: group(i, True)),
                      lambda stage: 2 * (s - stage - 1) + (v - 1) * s + 1)


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(_flushed, "(S-1)/(M+S-1)"),
    "circular": ScheduleKind(_flushed, "(S-1)/(V M+S-1)", chunked=True),
    "1f1b": ScheduleKind(_one_f_one_b, "(S-1)/(M+S-1)"),
    "interleaved-1f1b": ScheduleKind(_one_f_one_b, "(S-1)/(V M+S-1)", chunked=True,
                                     groups=True),
}


def schedule_refusal(name: str, stages: int, microbatches: int, repeats: int = 1) -> str | None:
    """Why schedule ``name`` cannot run S stages, M microbatches and V chunks a stage,
    in one line; None where it can."""
    if name not in SCHEDULES:
        return f"unknown pipeline schedule {name!r}; choose one of {tuple(SCHEDULES)}"
    reason = repeats_refusal(name, repeats)
    if reason:
        return reason
    if SCHEDULES[name].groups and repeats > 1 and microbatches % stages:
        return (f"the {name} schedule takes the microbatches in groups of the {stages} "
                f"stages: --microbatches {microbatches} must be a multiple of {stages}")
    return None


def repeats_refusal(name: str, repeats: int) -> str | None:
    """Why schedule ``name`` cannot take ``repeats`` chunks a stage; None where it can."""
    chunked = [n for n, kind in SCHEDULES.items() if kind.chunked]
    if SCHEDULES[name].chunked == (repeats > 1):
        return None
    return (f"--pipeline.repeats {repeats}: must be >= 2 with {' or '.join(chunked)}, 1 with "
            f"{' and '.join(n for n in SCHEDULES if n not in chunked)}")


@functools.cache   # tables and buffers computed once per sizes (read at every trace)
def make_schedule(name: str, stages: int, microbatches: int, repeats: int = 1,
                  stacks: int = 1) -> Schedule:
    """The tables of schedule ``name``; ValueError where it cannot run these sizes
    (``schedule_refusal``). A model of several ``stacks`` (dense layers, then MoE
    ones) runs as one pipeline: each stack's V chunks a stage are chunks of the
    table, stack after stack (``Schedule.repeats`` counts them all)."""
    reason = schedule_refusal(name, stages, microbatches, repeats)
    if reason:
        raise ValueError(reason)
    forward, backward = SCHEDULES[name].build(stages, microbatches, repeats * stacks)
    return Schedule(name, stages, microbatches, repeats * stacks, forward, backward)
