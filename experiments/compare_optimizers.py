"""Every optimizer against AdamW on the same preset, side by side.

    python -m experiments.compare_optimizers [--steps N] [--small] [--only NAME ...] [--out PATH]

Trains the `tiny` preset (or a shorter run with --small) once per optimizer
with identical data, schedule and seed, prints a table (validation loss, step
time, optimizer matmul FLOPs per step) and writes JSON to
bench_results/compare_optimizers.json.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

from experiments.bench_common import argv, print_table, write_results
from experiments.presets import tiny
from jmegatron.train import plan_run, train
from jmegatron.train.config import AdaptiveMuonConfig, MuonConfig

# Adaptive Muon's second moments: AdaMuon's element-wise division leaves an
# update of RMS about 1, so it takes no shape scale (0.2 gives AdamW's RMS);
# NorMuon keeps Newton-Schulz's norm and NAMO shrinks it, so both keep Muon's.
VARIANTS = {
    "adamw": dict(optim="adamw"),
    "muon": dict(optim="muon"),
    "muon (gram NS)": dict(optim="muon", muon=MuonConfig(ns_method="gram")),
    "mop": dict(optim="mop"),
    "adamuon": dict(optim="adaptive_muon", muon=MuonConfig(scale="none", rms_factor=0.2),
                    adaptive_muon=AdaptiveMuonConfig(second_moment="adamuon")),
    "normuon": dict(optim="adaptive_muon",
                    adaptive_muon=AdaptiveMuonConfig(second_moment="normuon")),
    "namo": dict(optim="adaptive_muon", adaptive_muon=AdaptiveMuonConfig(second_moment="namo")),
    "soap": dict(optim="soap"),
    "rekls": dict(optim="rekls"),
    "dion2": dict(optim="dion2"),
    "muon_bp": dict(optim="muon_bp"),
}


def compare(steps: int, out_dir: str, variants=tuple(VARIANTS), **overrides) -> list[dict]:
    """Trains the tiny preset (with ``overrides``) once per variant; one row each,
    the first variant being the baseline of the ratios."""
    rows = []
    base = dataclasses.replace(tiny(), **overrides)
    for name in variants:
        # A rerun replaces the previous comparison's run folders.
        folder = "compare-" + name.replace(" ", "-").replace("(", "").replace(")", "")
        cfg = dataclasses.replace(base, steps=steps, eval_every=steps, progress=False,
                                  out_dir=out_dir, name=folder, overwrite=True,
                                  **VARIANTS[name])
        summary = train(cfg, plan_run(cfg))
        step_time = cfg.batch_size * cfg.seq_len / summary["tokens_per_s"]
        rows.append({"variant": name, "steps": steps, "val_loss": summary["val_loss"],
                     "train_loss": summary["train_loss"], "seconds": summary["seconds"],
                     "tokens_per_s": summary["tokens_per_s"], "step_time_s": step_time,
                     "optimizer_gflop_per_step": summary["optimizer_flops_per_s"] * step_time
                     / 1e9})
    for row in rows:
        row["val_loss_ratio"] = row["val_loss"] / rows[0]["val_loss"]
        row["step_time_ratio"] = row["step_time_s"] / rows[0]["step_time_s"]
    return rows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--small", action="store_true", help="100 steps instead of 300")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="variants to train (the first is the ratios' baseline)")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    jax.config.update("jax_num_cpu_devices", 8)
    steps = args.steps or (100 if args.small else tiny().steps)
    rows = compare(steps, "runs", tuple(args.only))
    print_table(rows, [("variant", "optimizer", ""), ("steps", "steps", "d"),
                       ("val_loss", "val loss", ".3f"), ("train_loss", "train loss", ".3f"),
                       ("val_loss_ratio", f"val loss vs {rows[0]['variant']}", ".3f"),
                       ("step_time_s", "step s", ".3f"),
                       ("step_time_ratio", "step time ratio", ".2f"),
                       ("optimizer_gflop_per_step", "optimizer GFLOP/step", ".3f")])
    write_results("compare_optimizers", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
