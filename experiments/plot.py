"""Plot loss curves: `python -m experiments.plot RUN_DIR [RUN_DIR ...] [--out PATH]`.

One run writes RUN_DIR/loss.png; several are overlaid in one picture.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jmegatron.train.plots import plot_runs


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", help="run folders holding metrics.jsonl")
    parser.add_argument("--out", help="PNG path (default: RUN_DIR/loss.png, or "
                        "loss_comparison.png in the current folder for several runs)")
    return parser


def main(argv: list[str] | None = None) -> Path:
    cli = parser()
    args = cli.parse_args(argv)
    missing = [r for r in args.runs if not (Path(r) / "metrics.jsonl").exists()]
    if missing:
        cli.error(f"no metrics.jsonl in {', '.join(missing)}")
    out = args.out or (Path(args.runs[0]) / "loss.png" if len(args.runs) == 1
                       else Path("loss_comparison.png"))
    path = plot_runs(args.runs, out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
