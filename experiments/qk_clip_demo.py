"""QK-clip at a learning rate where attention logits grow:
`python -m experiments.qk_clip_demo [--steps N] [--lr LR] [--tau TAU]`.

Trains the default model (the ``tiny`` preset, no QK-norm) twice with Muon at a
high learning rate, without and with ``--qk-clip TAU``, prints the largest
attention logit and the loss along the way, and writes both runs' curves to
OUT_DIR/qk_clip_demo.png (loss left, max logit right).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax

from experiments.presets import tiny
from jmegatron.train import plot_runs, read_metrics, train
from jmegatron.train.planning import plan_run


def run_pair(steps: int, lr: float, tau: float, out_dir: str) -> dict[str, list[dict]]:
    """{run name: its train records} for the runs without and with QK-clip."""
    base = dataclasses.replace(tiny(), steps=steps, lr=lr, eval_every=steps, out_dir=out_dir,
                               overwrite=True, progress=False)
    records = {}
    for name, clip in (("no_clip", 0.0), (f"qk_clip_{tau:g}", tau)):
        cfg = dataclasses.replace(base, name=name, qk_clip=clip)
        summary = train(cfg, plan_run(cfg))
        records[name] = [r for r in read_metrics(summary["run_dir"]) if "loss" in r]
        records[name][-1]["val_loss"] = summary["val_loss"]
    return records


def table(records: dict[str, list[dict]], every: int) -> str:
    """Max logit and train loss every ``every`` steps, then peak and val loss."""
    names = list(records)
    rows = [f"| step | " + " | ".join(f"{n} max logit | {n} loss" for n in names) + " |",
            "|---:|" + "---:|" * 2 * len(names)]
    steps = [r["step"] for r in records[names[0]] if r["step"] % every == 0 or r["step"] == 1]
    for step in steps:
        cells = []
        for n in names:
            r = next(r for r in records[n] if r["step"] == step)
            cells += [f"{r['max_attention_logit']:.1f}", f"{r['loss']:.3f}"]
        rows.append(f"| {step} | " + " | ".join(cells) + " |")
    peak = [f"{max(r['max_attention_logit'] for r in records[n]):.1f}" for n in names]
    val = [f"{records[n][-1]['val_loss']:.3f}" for n in names]
    rows.append("| peak / val loss | " + " | ".join(f"{p} | {v}" for p, v in zip(peak, val))
                + " |")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.1, help="Muon's and AdamW's peak rate")
    parser.add_argument("--tau", type=float, default=30.0, help="the QK-clip threshold")
    parser.add_argument("--out-dir", default="runs/qk_clip_demo")
    return parser


def main(argv: list[str] | None = None) -> Path:
    args = parser().parse_args(argv)
    jax.config.update("jax_num_cpu_devices", tiny().cpu_devices)   # before JAX starts
    records = run_pair(args.steps, args.lr, args.tau, args.out_dir)
    print(table(records, every=max(args.steps // 6, 1)))
    out = plot_runs([Path(args.out_dir) / name for name in records],
                    Path(args.out_dir) / "qk_clip_demo.png")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
