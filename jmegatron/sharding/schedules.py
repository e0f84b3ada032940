"""Pipeline schedules as data: which work each stage does at each tick.

A schedule is a ``Schedule``: for every (tick, stage), the work item whose
forward the stage runs (item i = r M + k: microbatch k through the stage's
chunk r, its repeat) and, for a schedule that runs its own backward, the
microbatch whose backward it runs; -1 where the stage idles. The pipeline's
tick loops read their work from these tables (``sharding.pipeline``,
``sharding.pipeline_1f1b``), and the tick count, the bubble and the slots a
stage keeps are counted on them, not derived from a schedule's name.

  gpipe     forward of item t - s at tick t on stage s, M + S - 1 ticks; JAX
            differentiates the ticks (the backward runs them in reverse).
  circular  the same over V M items (V chunks a stage): V M + S - 1 ticks.
  1f1b      forward of t - s and backward of t - (2S - 2 - s) at tick t: each
            microbatch's backward starts as soon as its forward has left the
            last stage; M + 2S - 2 ticks, each a forward and a backward.

A new schedule is a builder in ``SCHEDULES`` returning its tables.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """One schedule's tables for S stages, M microbatches and V chunks a stage."""

    name: str
    stages: int
    microbatches: int
    repeats: int
    forward: np.ndarray                  # [ticks, S] work item r M + k, or -1
    backward: np.ndarray | None = None   # [ticks, S] microbatch, or -1; None: JAX's

    @property
    def ticks(self) -> int:
        """The ticks of the schedule's loop (each way, where JAX runs the backward)."""
        return self.forward.shape[0]

    @property
    def own_backward(self) -> bool:
        """Whether the schedule runs its backward itself, beside the forwards."""
        return self.backward is not None

    @property
    def bubble(self) -> float:
        """The idle share of the stages' work slots (a forward and, in a schedule with
        its own backward, a backward per tick)."""
        tables = [t for t in (self.forward, self.backward) if t is not None]
        return float(sum((t < 0).sum() for t in tables) / sum(t.size for t in tables))

    @functools.cached_property
    def slots(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Where a stage keeps each microbatch's input from its forward to its backward
        (own backward only): (the slot its forward writes [ticks, S], the slot its
        backward reads [ticks, S], -1 where none; the slots a stage needs). A slot is
        free again after the tick of its backward; a stage takes the lowest free one."""
        fwd = np.full(self.forward.shape, -1)
        bwd = np.full(self.forward.shape, -1)
        if self.backward is None:
            return fwd, bwd, 0
        count = 0
        for s in range(self.stages):
            end = {int(k): t for t, k in enumerate(self.backward[:, s]) if k >= 0}
            free_after, slot_of = {}, {}   # slot -> the tick of its holder's backward
            for t in range(self.ticks):
                k, b = int(self.forward[t, s]), int(self.backward[t, s])
                if k >= 0:
                    slot = next(i for i in itertools.count() if free_after.get(i, -1) < t)
                    free_after[slot], slot_of[k], fwd[t, s] = end[k], slot, slot
                if b >= 0:
                    bwd[t, s] = slot_of[b]
            count = max(count, len(free_after))
        return fwd, bwd, count


class ScheduleKind(NamedTuple):
    """A registered schedule: its builder and its bubble as the startup line prints it."""

    build: Callable[[int, int, int], tuple[np.ndarray, np.ndarray | None]]
    formula: str
    circular: bool = False   # runs V >= 2 chunks a stage (the others: one)


def _diagonal(ticks: int, stages: int, items: int, delay) -> np.ndarray:
    """[ticks, S]: item t - delay(s) where that is in [0, items), else -1."""
    t, s = np.meshgrid(np.arange(ticks), np.arange(stages), indexing="ij")
    item = t - delay(s)
    return np.where((item >= 0) & (item < items), item, -1)


def _gpipe(s: int, m: int, v: int):
    return _diagonal(v * m + s - 1, s, v * m, lambda stage: stage), None


def _one_f_one_b(s: int, m: int, v: int):
    ticks = m + 2 * s - 2
    return (_diagonal(ticks, s, m, lambda stage: stage),
            _diagonal(ticks, s, m, lambda stage: 2 * s - 2 - stage))


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(_gpipe, "(S-1)/(M+S-1)"),
    "circular": ScheduleKind(_gpipe, "(S-1)/(V M+S-1)", circular=True),
    "1f1b": ScheduleKind(_one_f_one_b, "(2S-2)/(M+2S-2)"),
}


def make_schedule(name: str, stages: int, microbatches: int, repeats: int = 1) -> Schedule:
    """The tables of schedule ``name``; ValueError for an unknown name, or repeats
    that do not match it (circular: 2 or more, the others 1)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of "
                         f"{tuple(SCHEDULES)}")
    kind = SCHEDULES[name]
    if kind.circular != (repeats > 1):
        raise ValueError(f"the {name} schedule with {repeats} chunks a stage: circular "
                         f"needs repeats >= 2, the others 1")
    forward, backward = kind.build(stages, microbatches, repeats)
    return Schedule(name, stages, microbatches, repeats, forward, backward)
