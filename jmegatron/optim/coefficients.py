"""Newton-Schulz coefficient sets.

Each iteration maps X to a X + b (X X^T) X + c (X X^T)^2 X, i.e. every
singular value s to p(s) = a s + b s^3 + c s^5. A set lists the (a, b, c) of
successive iterations and says what happens when more steps are asked for
than it lists. Every named set with several tuples repeats its last one:
the last tuple is a polishing step with a fixed point near 1, while the
first tuples are tuned to lift tiny singular values and throw values near 1
far off (quintic's first maps 1 to 0.12, aol's to -0.59), so cycling back to
them would undo the work.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Literal, Sequence

import numpy as np

Coefficients = tuple[float, float, float]


@dataclasses.dataclass(frozen=True)
class CoefficientSet:
    """Per-iteration coefficients, what follows the list, and the first-step scaling.

    Attributes:
      name: the set's name (a key of ``COEFFICIENT_SETS``, or "custom").
      steps: the (a, b, c) of successive iterations, each mapping a singular value
        s to a s + b s^3 + c s^5.
      after_list: what iterations past the list use: "repeat_last" (its last tuple
        again, the default) or "cycle" (the list from its start).
      default_steps: the iterations run when a caller passes ``steps=None``.
      normalization: the scaling before the first iteration: "frobenius" (unit
        Frobenius norm) or "aol" (then AOL row scaling, spectral norm <= 1).
    """

    name: str
    steps: tuple[Coefficients, ...]
    after_list: Literal["cycle", "repeat_last"] = "repeat_last"
    default_steps: int = 5
    normalization: Literal["frobenius", "aol"] = "frobenius"

    def __post_init__(self):
        # A NaN or inf coefficient makes every update NaN (or inf) from the first step on.
        bad = [step for step in self.steps if not np.all(np.isfinite(np.asarray(step, float)))]
        if bad:
            raise ValueError(f"coefficients must be finite numbers, got {bad[0]} in coefficient "
                             f"set {self.name!r}")

    def schedule(self, n: int) -> list[Coefficients]:
        """The coefficients of ``n`` iterations."""
        if n < 1:
            raise ValueError(f"Newton-Schulz needs at least 1 step, got {n}")
        if self.after_list == "cycle":
            source = itertools.cycle(self.steps)
        else:
            source = itertools.chain(self.steps, itertools.repeat(self.steps[-1]))
        return list(itertools.islice(source, n))


COEFFICIENT_SETS = {s.name: s for s in (
    # Keller Jordan's Muon: one tuple maximizing the slope at zero.
    CoefficientSet("simple", ((3.4445, -4.7750, 2.0315),)),
    # Per-step quintic coefficients of modded-nanogpt's train_gpt_medium.py
    # (tuned by You Jiacheng; also optax's "dion" set).
    CoefficientSet("quintic", (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    )),
    # Polar Express (Amsel et al. 2025), degree 5, with the paper's safety
    # factor 1.01 folded in; the last tuple, the classic (15, -10, 3)/8
    # iteration, repeats and converges to exactly 1.
    CoefficientSet("polar_express", (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    )),
    # CANS (Grishina et al. 2025): Chebyshev-alternance polynomials on an
    # adaptively shrinking interval; the last tuple repeats.
    CoefficientSet("cans", (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    )),
    # Turbo-Muon (Boissin et al. 2025): AOL rescaling replaces the Frobenius
    # normalization, so four steps do the work of five.
    CoefficientSet("aol", (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ), default_steps=4, normalization="aol"),
    # DeepSeek-V4 (DeepSeek-AI, DeepSeek-V4 technical report, 2026, DeepSeek_V4.pdf
    # at huggingface.co/deepseek-ai/DeepSeek-V4-Pro; also NVIDIA
    # Emerging-Optimizers 0.3.0's "deepseekv4" set): eight steps of
    # Keller Jordan's tuple lift the small singular values fast, then two
    # steps of (2, -1.5, 0.5), whose fixed point is exactly 1 with zero slope
    # there, pull the band around 1 in.
    CoefficientSet("deepseekv4", ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
                   default_steps=10),
    # The classic cubic Newton-Schulz iteration X <- 1.5 X - 0.5 X X^T X:
    # converges to exactly 1 but slowly from small singular values.
    CoefficientSet("cubic", ((1.5, -0.5, 0.0),), default_steps=10),
)}


def coefficient_set(coefficients: str | Coefficients | Sequence[Coefficients] | CoefficientSet
                    ) -> CoefficientSet:
    """The ``CoefficientSet`` that a ``coefficients=`` option names or lists.

    Args:
      coefficients: a name of ``COEFFICIENT_SETS`` ("simple", "quintic",
        "polar_express", "cans", "aol", "deepseekv4", "cubic"), one (a, b, c)
        tuple, a list (or [n, 3] array) of them, or a ``CoefficientSet``
        (returned as it is). A user list's last tuple repeats; build a
        ``CoefficientSet(..., after_list="cycle")`` to cycle instead.

    Returns:
      The set (user tuples as one named "custom", run with 5 default steps).

    Raises:
      ValueError: an unknown name, tuples that are not of 3 numbers, or a NaN or inf.
    """
    if isinstance(coefficients, CoefficientSet):
        return coefficients
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(f"unknown coefficient set {coefficients!r}; "
                             f"choose one of {sorted(COEFFICIENT_SETS)} or pass (a, b, c) tuples")
        return COEFFICIENT_SETS[coefficients]
    array = np.asarray(coefficients, dtype=np.float64)   # tuples, lists or (n, 3) arrays
    if array.size == 0 or array.shape[-1] != 3 or array.ndim > 2:
        raise ValueError(f"coefficients must be (a, b, c) or a list of them, got {coefficients!r}")
    return CoefficientSet("custom", tuple(tuple(map(float, row)) for row in array.reshape(-1, 3)))
