"""Loss curves and largest attention logits of one or several runs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from jmegatron.train.metrics import read_metrics


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Train and eval loss against step for each run, overlaid, as a PNG; beside it the
    largest pre-softmax attention logit (``max_attention_logit``) where runs logged it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(run_dir).name, read_metrics(run_dir)) for run_dir in run_dirs]
    logits = any("max_attention_logit" in r for _, records in runs for r in records)
    fig, axes = plt.subplots(1, 2 if logits else 1, figsize=(12 if logits else 7, 4.2),
                             dpi=120, squeeze=False)
    loss_ax = axes[0, 0]
    for i, (name, records) in enumerate(runs):
        color = f"C{i}"
        train = _series(records, "loss")
        evals = _series(records, "eval_loss")
        if train:
            loss_ax.plot(*zip(*train), color=color, alpha=0.8, label=f"{name} train")
        if evals:
            loss_ax.plot(*zip(*evals), "o--", color=color, label=f"{name} val")
        if logits and (peaks := _series(records, "max_attention_logit")):
            axes[0, 1].plot(*zip(*peaks), color=color, label=name)
    loss_ax.set_ylabel("loss (nats/token)")
    if logits:
        axes[0, 1].set_ylabel("max attention logit (over layers and heads)")
        if all(v > 0 for line in axes[0, 1].get_lines() for v in line.get_ydata()):
            axes[0, 1].set_yscale("log")   # unclipped logits grow by orders of magnitude
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record holding ``key`` with a number (not a NaN's null)."""
    return [(r["step"], r[key]) for r in records if r.get(key) is not None]
