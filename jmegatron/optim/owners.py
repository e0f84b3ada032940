"""Which rank owns (stores and orthogonalizes) each whole matrix.

Round-robin gives matrix i to rank i mod n. The balanced assignment is
longest-processing-time first on Newton-Schulz cost (max(m, n) min(m, n)^2
per matrix): heaviest matrix first, each to the least-loaded rank, ties to
the lower index, so it is deterministic. LPT's makespan is at most 4/3 of
the optimum (Graham 1969); it usually beats round-robin when shapes differ,
but not always (costs 2, 3, 2, 3, 2 on two ranks: 6 round-robin, 7 LPT).

The layerwise layout splits each stack of same-shape matrices evenly over
the ranks (an SPMD program holds the same slots on every rank), so there
only a stack's first rank is free: ``stack_offsets`` applies both methods
to stacks, and ``assign`` gives the single-matrix LPT it is measured against.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from jmegatron.sharding.layouts import ASSIGNMENTS as METHODS


def ns_cost(m: int, n: int) -> int:
    """Newton-Schulz work of one m x n matrix, up to a constant: max x min^2."""
    return max(m, n) * min(m, n) ** 2


def assign(costs: Sequence[float], n_ranks: int, method: str = "round_robin") -> list[int]:
    """The owning rank of each matrix."""
    if method == "round_robin":
        return [i % n_ranks for i in range(len(costs))]
    if method != "balanced":
        raise ValueError(f"unknown assignment {method!r}; one of {METHODS}")
    owner = [0] * len(costs)
    loads = [(0.0, r) for r in range(n_ranks)]          # (load, rank) heap
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owner[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    return owner


def stack_offsets(stacks: Sequence[tuple[int, float]], n_ranks: int,
                  method: str = "round_robin") -> list[int]:
    """The first rank of each stack of (count, cost per matrix), whose matrix i
    goes to rank (offset + i) mod n. Round-robin continues from one stack to the
    next. Balanced is LPT for stacks: heaviest matrices first, each stack at the
    offset leaving the lowest maximum load (ties to the lower offset)."""
    if method == "round_robin":
        starts = [0]
        for count, _ in stacks[:-1]:
            starts.append(starts[-1] + count)
        return [start % n_ranks for start in starts]
    if method != "balanced":
        raise ValueError(f"unknown assignment {method!r}; one of {METHODS}")
    loads, offsets = [0.0] * n_ranks, [0] * len(stacks)
    for s in sorted(range(len(stacks)), key=lambda s: (-stacks[s][1], s)):
        count, cost = stacks[s]
        after = lambda o: [load + cost * ((count - (r - o) % n_ranks + n_ranks - 1) // n_ranks)
                           for r, load in enumerate(loads)]
        offsets[s] = min(range(n_ranks), key=lambda o: (max(after(o)), o))
        loads = after(offsets[s])
    return offsets


def rank_loads(costs: Sequence[float], owner: Sequence[int], n_ranks: int) -> list[float]:
    loads = [0.0] * n_ranks
    for cost, rank in zip(costs, owner):
        loads[rank] += cost
    return loads


def load_report(costs: Sequence[float], owner: Sequence[int], n_ranks: int) -> str:
    """Per-rank Newton-Schulz load and the imbalance (max / mean)."""
    loads = rank_loads(costs, owner, n_ranks)
    mean = sum(loads) / n_ranks
    ranks = " ".join(f"{load / max(loads):.2f}" for load in loads)
    return (f"per-rank load (relative to the heaviest): {ranks} | imbalance max/mean "
            f"{max(loads) / mean:.3f}" if mean else "no matrices")


def tail_owner_bytes(sizes: Sequence[int], n_ranks: int) -> dict[str, float]:
    """Non-matrix params (bytes each) element-wise over ``n_ranks`` (ZeRO-3) against
    whole on "tail" owners (LPT by size): what the heaviest rank holds, and the
    most bytes a rank receives to have them all whole for the forward. (The
    element-wise optimizer state of these params scales like ``held``.)"""
    total = sum(sizes)
    loads = rank_loads(sizes, assign(sizes, n_ranks, "balanced"), n_ranks)
    zero3 = sum(-(-s // n_ranks) for s in sizes)
    return {"zero3_held": zero3, "tail_held": max(loads),
            "zero3_received": total - total / n_ranks, "tail_received": total - min(loads)}
