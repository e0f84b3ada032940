"""Loss curves of one or several runs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from jmegatron.train.metrics import read_metrics


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Train and eval loss against step for each run, overlaid, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for i, run_dir in enumerate(run_dirs):
        records = read_metrics(run_dir)
        color = f"C{i}"
        name = Path(run_dir).name
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.8, label=f"{name} train")
        if evals:
            ax.plot(*zip(*evals), "o--", color=color, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
