"""Muon and SOAP against AdamW on the same preset, side by side.

    python -m experiments.compare_optimizers [--steps N] [--out PATH] [--small]

Trains the `tiny` preset (or a shorter run with --small) once per optimizer
with identical data, schedule and seed, prints a table and writes JSON to
bench_results/compare_optimizers.json.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

from experiments.bench_common import argv, print_table, write_results
from experiments.presets import tiny
from jmegatron.train import plan_run, train


def compare(steps: int, out_dir: str, **overrides) -> list[dict]:
    """Trains the tiny preset (with ``overrides``) once per optimizer; one row each."""
    rows = []
    base = dataclasses.replace(tiny(), **overrides)
    for name in ("adamw", "muon", "soap"):
        # A rerun replaces the previous comparison's run folders.
        cfg = dataclasses.replace(base, steps=steps, eval_every=steps, progress=False,
                                  out_dir=out_dir, name=f"compare-{name}", optim=name,
                                  overwrite=True)
        summary = train(cfg, plan_run(cfg))
        rows.append({"variant": name, "steps": steps, "val_loss": summary["val_loss"],
                     "train_loss": summary["train_loss"], "seconds": summary["seconds"],
                     "tokens_per_s": summary["tokens_per_s"]})
    adamw = rows[0]["val_loss"]
    for row in rows:
        row["val_loss_ratio_vs_adamw"] = row["val_loss"] / adamw
    return rows


def main(args_list: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--small", action="store_true", help="100 steps instead of 300")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(args_list)
    jax.config.update("jax_num_cpu_devices", 8)
    steps = args.steps or (100 if args.small else tiny().steps)
    rows = compare(steps, "runs")
    print_table(rows, [("variant", "optimizer", ""), ("steps", "steps", "d"),
                       ("val_loss", "val loss", ".3f"), ("train_loss", "train loss", ".3f"),
                       ("tokens_per_s", "tok/s", ",.0f"),
                       ("val_loss_ratio_vs_adamw", "val loss vs adamw", ".3f")])
    write_results("compare_optimizers", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
