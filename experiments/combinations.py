"""What combines: a pairwise (all-pairs) set of short CLI runs over the options a user
reaches by flags, each of which must train with a finite loss or be refused in one
line before anything compiles; their outcomes as a table for docs/combinations.md.

    python -m experiments.combinations --out docs/combinations.md   # planned (seconds)
    python -m experiments.combinations --run    # each trained, 2 steps (about 4 minutes)

Every pair of values of two options occurs in at least one run (a greedy all-pairs
cover, deterministic: the same runs every time), not the full product, which would
be thousands of runs. Each prints the pairs it is the first to cover.
``tests/test_combinations.py`` plans them all and checks that the page equals
docs/combinations.md; its slow tier trains them.
"""

from __future__ import annotations

import argparse
import itertools
import math
import tempfile
from pathlib import Path
from typing import NamedTuple

# Each option's values, each value the flags that select it (the sizes are below).
STAGED = ["--mesh.stage", "2", "--microbatches", "2", "--pipeline.schedule"]
OPTIONS: dict[str, dict[str, list[str]]] = {
    "optimizer": {name: ["--optim", name] for name in
                  ("adamw", "muon", "soap", "dion2", "muon_bp", "mop")}
    | {"normuon": ["--optim", "adaptive_muon", "--adaptive-muon.second-moment", "normuon"]},
    "layout": {name: ["--layout", name]
               for name in ("auto", "replicated", "layerwise", "fsdp", "owner")},
    "preset": {"tiny": ["--preset", "tiny"],
               "qwen3-moe-tiny": ["--preset", "qwen3-moe-tiny"],   # MoE every second layer
               "qwen3-moe-tiny, every layer MoE": ["--preset", "qwen3-moe-tiny",
                                                   "--model.moe.every", "1"]},
    "schedule": {"none": [], "gpipe": STAGED + ["gpipe"],
                 "circular": STAGED + ["circular", "--pipeline.repeats", "2"],
                 "1f1b": STAGED + ["1f1b"]},
    "dtype": {"fp32": [], "bf16": ["--model.dtype", "bfloat16"]},
    "qk-clip": {"off": [], "on": ["--qk-clip", "50"]},
    "remat": {"off": [], "on": ["--model.remat", "full"]},
    "prefetch": {"off": [], "on": ["--model.prefetch"]},
}
# Tiny sizes for every run (the presets' meshes and layer counts stay): 2 steps, no
# samples, one validation batch.
SIZES = ["--model.d-model", "32", "--model.n-heads", "2", "--model.n-kv-heads", "2",
         "--model.d-ff", "64", "--model.moe.d-ff", "32", "--batch-size", "16",
         "--seq-len", "16", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
         "--sample-tokens", "0", "--no-progress", "--log-every", "1"]


class Run(NamedTuple):
    """One combination: a value of every option, and the pairs it is the first to cover."""

    values: dict[str, str]
    covers: tuple[tuple[tuple[str, str], tuple[str, str]], ...]

    def flags(self) -> list[str]:
        return [f for name, value in self.values.items() for f in OPTIONS[name][value]] + SIZES

    def name(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items())


def _pairs(row: dict[str, str]) -> set:
    return set(itertools.combinations(sorted(row.items()), 2))


def all_pairs(options: dict[str, dict] = OPTIONS) -> list[Run]:
    """A greedy all-pairs cover (AETG's idea, deterministic): each run starts from the
    first pair no run covers yet, then takes, option by option, the value that covers
    the most uncovered pairs with the values already taken (the first on a tie)."""
    names = list(options)
    todo = {pair for a, b in itertools.combinations(sorted(names), 2)
            for pair in itertools.product(((a, v) for v in options[a]),
                                          ((b, v) for v in options[b]))}
    runs = []
    while todo:
        (a, va), (b, vb) = min(todo)
        row = {a: va, b: vb}
        for name in names:
            if name not in row:
                row[name] = max(options[name], key=lambda v: len(
                    _pairs({**row, name: v}) & todo))
        row = {name: row[name] for name in names}
        covered = _pairs(row) & todo
        todo -= covered
        runs.append(Run(row, tuple(sorted(covered))))
    return runs


class Outcome(NamedTuple):
    """What one run did: trained to ``loss``, was refused with ``error`` (one line), or
    raised ``crash`` (a defect: its exception's type and first line)."""

    loss: float | None = None
    error: str | None = None
    compiled: int = 0   # XLA compilations the run started
    crash: str | None = None

    def says(self) -> str:
        if self.crash:
            return f"crashed: {self.crash}"
        return "trains" if self.error is None else "refused: " + self.error.removeprefix("error: ")


def plan_one(run: Run, out_dir: str, data: str) -> Outcome:
    """What the CLI decides on ``run``'s flags before it compiles anything (its parse
    and ``plan_run``): refused, or no error (the run would be built and trained)."""
    from experiments.train import parse
    from jmegatron.train import plan_run
    from jmegatron.train.config import ConfigError
    try:
        plan_run(parse(run.flags() + ["--out-dir", out_dir, "--data.path", data]))
    except (ValueError, ConfigError) as err:   # as experiments.train reports them
        return Outcome(error=f"error: {err}")
    return Outcome()


def run_one(run: Run, out_dir: str, data: str) -> Outcome:
    """The CLI in this process on ``run``'s flags (corpus ``data``), with the compiles
    it started counted."""
    from jax import monitoring
    from experiments import train as train_cli

    compiles = []
    listener = lambda event, *_, **__: compiles.append(event) if event.endswith(
        "backend_compile_duration") else None
    monitoring.register_event_duration_secs_listener(listener)
    try:
        summary = train_cli.main(run.flags() + ["--out-dir", out_dir, "--data.path", data])
    except SystemExit as stop:
        return Outcome(error=str(stop.code), compiled=len(compiles))
    except Exception as err:   # noqa: BLE001 - recorded, and the tests fail on it
        return Outcome(compiled=len(compiles),
                       crash=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    finally:
        monitoring.unregister_event_duration_listener(listener)
    return Outcome(loss=summary["train_loss"], compiled=len(compiles))


def table(runs: list[Run], outcomes: list[Outcome]) -> str:
    """The outcomes as docs/combinations.md's Markdown table."""
    names = list(OPTIONS)
    lines = ["| # | " + " | ".join(names) + " | outcome |",
             "|---" * (len(names) + 2) + "|"]
    for i, (run, out) in enumerate(zip(runs, outcomes), 1):
        said = out.says().replace("|", "\\|")
        lines.append(f"| {i} | " + " | ".join(run.values[n] for n in names) + f" | {said} |")
    return "\n".join(lines)


def page(runs: list[Run], outcomes: list[Outcome]) -> str:
    trained = sum(out.says() == "trains" for out in outcomes)
    full = math.prod(len(v) for v in OPTIONS.values())
    return (f"# What combines\n\nGenerated by `python -m experiments.combinations --out "
            f"docs/combinations.md`; `tests/test_combinations.py` plans the same {len(runs)} "
            f"runs and checks this page, and its slow tier (`python -m pytest -m slow "
            f"tests/test_combinations.py`) trains them. Each run is 2 steps of a tiny model (the "
            f"preset's mesh and layer count, `{' '.join(SIZES[:12])}`) on 8 CPU devices. "
            f"Together they hold every pair of values of two options (all-pairs, not the "
            f"{full:,} runs of the full product). A run trains with a finite loss, or is "
            f"refused in one line, naming the option to change, before anything compiles; "
            f"{trained} of {len(runs)} train.\n\nThe schedules run on `--mesh.stage 2 "
            f"--microbatches 2` (circular with `--pipeline.repeats 2`); qk-clip is "
            f"`--qk-clip 50`, remat `--model.remat full`.\n\n" + table(runs, outcomes) + "\n")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true",
                        help="train each run (about 4 minutes); else plan each (seconds)")
    parser.add_argument("--out", help="write the outcomes' page here (docs/combinations.md)")
    parser.add_argument("--data", default="README.md", help="the corpus of every run")
    return parser


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    import jax
    jax.config.update("jax_num_cpu_devices", 8)   # the trainer's default, before JAX starts
    runs = all_pairs()
    for i, run in enumerate(runs, 1):
        print(f"{i:3d} {run.name()}\n    covers {len(run.covers)} new pairs: "
              + "; ".join(f"{a[0]}={a[1]} x {b[0]}={b[1]}" for a, b in run.covers))
    with tempfile.TemporaryDirectory() as out_dir:
        outcomes = [(run_one if args.run else plan_one)(run, out_dir, args.data)
                    for run in runs]
    for i, out in enumerate(outcomes, 1):
        print(f"{i:3d} {out.says()}")
    if args.out:
        Path(args.out).write_text(page(runs, outcomes))


if __name__ == "__main__":
    main()
