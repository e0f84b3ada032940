"""Which rank owns (stores and orthogonalizes) each whole matrix.

Round-robin gives matrix i to rank i mod n. The balanced assignment is
longest-processing-time first on Newton-Schulz cost (max(m, n) min(m, n)^2
per matrix): heaviest matrix first, each to the least-loaded rank, ties to
the lower index, so it is deterministic. LPT's makespan is at most 4/3 of
the optimum (Graham 1969); it usually beats round-robin when shapes differ,
but not always (costs 2, 3, 2, 3, 2 on two ranks: 6 round-robin, 7 LPT).
"""

from __future__ import annotations

import heapq
from typing import Sequence

METHODS = ("round_robin", "balanced")


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
