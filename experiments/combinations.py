"""What combines: a pairwise (all-pairs) set of short CLI runs over the options a user
reaches by flags, each of which must train with a finite loss or be refused in one
line before anything compiles; their outcomes as a table for docs/combinations.md.

    python -m experiments.combinations --out docs/combinations.md   # planned (seconds)
    python -m experiments.combinations --run    # each trained, 2 steps (about 9 minutes)

A pair of values of two options counts as covered once a run holding it trains (a
greedy all-pairs cover that asks the CLI's planner, deterministic: the same runs every
time), not the full product, which would be thousands of runs. A pair whose first try
is refused is tried again with each other option changed in turn; a pair that still
trains nowhere is listed with its refusal. Each run prints the pairs it is the first to
train. ``tests/test_combinations.py`` checks the cover and that the page equals
docs/combinations.md; its slow tier trains every run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

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
                 "1f1b": STAGED + ["1f1b"],
                 "interleaved-1f1b": STAGED + ["interleaved-1f1b", "--pipeline.repeats", "2"]},
    "dtype": {"fp32": [], "bf16": ["--model.dtype", "bfloat16"]},
    "qk-clip": {"off": [], "on": ["--qk-clip", "50"]},
    "remat": {"off": [], "on": ["--model.remat", "full"]},
    # prefetch gathers from a map manual over the batch axes only: tiny's tensor 2 off
    "prefetch": {"off": [], "on": ["--model.prefetch", "--mesh.tensor", "1"]},
}
# Tiny sizes for every run (the presets' meshes and layer counts stay): 2 steps, no
# samples, one validation batch.
SIZES = ["--model.d-model", "32", "--model.n-heads", "2", "--model.n-kv-heads", "2",
         "--model.d-ff", "64", "--model.moe.d-ff", "32", "--batch-size", "16",
         "--seq-len", "16", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
         "--sample-tokens", "0", "--no-progress", "--log-every", "1"]


Pair = tuple[tuple[str, str], tuple[str, str]]


class Run(NamedTuple):
    """One combination: a value of every option, and the pairs it is the first to train
    (none for a refused one, kept for the page: what does not combine, and why)."""

    values: dict[str, str]
    covers: tuple[Pair, ...]

    def flags(self) -> list[str]:
        return flags_of(self.values)

    def name(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items())


def flags_of(values: dict[str, str]) -> list[str]:
    return [f for name, value in values.items() for f in OPTIONS[name][value]] + SIZES


def _pairs(row: dict[str, str]) -> set[Pair]:
    return set(itertools.combinations(sorted(row.items()), 2))


def every_pair(options: dict[str, dict] = OPTIONS) -> set[Pair]:
    return {pair for a, b in itertools.combinations(sorted(options), 2)
            for pair in itertools.product(((a, v) for v in options[a]),
                                          ((b, v) for v in options[b]))}


def all_pairs(refusal: Callable[[dict[str, str]], str | None],
              options: dict[str, dict] = OPTIONS) -> tuple[list[Run], dict[Pair, str]]:
    """A greedy all-pairs cover (AETG's idea, deterministic) by runs that train: each
    run starts from the first pair no run trains yet, then takes, option by option, the
    value that covers the most such pairs with the values already taken (the first on a
    tie) among those that train with the options not yet taken at their first values
    (off, none, fp32: ``refusal(values)`` is None where values train, else the line
    that refuses them). A pair refused with the others at their first values, and with
    any one of them changed, is kept as a refused run and in the second result,
    {pair: its refusal}."""
    todo, runs, never = every_pair(options), [], {}
    while todo:
        seed = min(todo)
        start = {**{name: next(iter(values)) for name, values in options.items()}, **dict(seed)}
        tries = [start] + [{**start, name: v} for name in options if name not in dict(seed)
                           for v in options[name] if v != start[name]]
        row = next((_greedy(r, dict(seed), todo, options, refusal)
                    for r in tries if refusal(r) is None), None)
        if row is None:
            todo.discard(seed)
            never[seed] = refusal(start)
            runs.append(Run(start, ()))
            continue
        covered = _pairs(row) & todo
        todo -= covered
        runs.append(Run(row, tuple(sorted(covered))))
    return runs, never


def _greedy(start, row, todo, options, refusal) -> dict[str, str]:
    """``row`` completed option by option, each value the best-covering one that trains
    with the options not yet taken as in ``start`` (values that train; so ``start``'s
    own value always does)."""
    for name in options:
        if name not in row:
            ranked = sorted(options[name], key=lambda v: -len(_pairs({**row, name: v}) & todo))
            row[name] = next(v for v in ranked if refusal({**start, **row, name: v}) is None)
    return {name: row[name] for name in options}


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


def planner(out_dir: str, data: str) -> Callable[[dict[str, str]], str | None]:
    """``refusal(values)``: what the CLI decides on those values' flags (corpus ``data``)
    before it compiles anything (its parse and ``plan_run``): None (the run would be
    built and trained), or the line it is refused with. Each row is planned once."""
    from experiments.train import parse
    from jmegatron.train import plan_run
    from jmegatron.train.config import ConfigError

    @functools.cache
    def decide(row: tuple[tuple[str, str], ...]) -> str | None:
        try:
            plan_run(parse(flags_of(dict(row)) + ["--out-dir", out_dir, "--data.path", data]))
        except (ValueError, ConfigError) as err:   # as experiments.train reports them
            return f"error: {err}"
        return None

    return lambda values: decide(tuple(values.items()))


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


def page(runs: list[Run], outcomes: list[Outcome], never: dict[Pair, str]) -> str:
    trained = sum(out.says() == "trains" for out in outcomes)
    full = math.prod(len(v) for v in OPTIONS.values())
    return (f"# What combines\n\nGenerated by `python -m experiments.combinations --out "
            f"docs/combinations.md`; `tests/test_combinations.py` plans the same {len(runs)} "
            f"runs and checks this page, and its slow tier (`python -m pytest -m slow "
            f"tests/test_combinations.py`) trains them. Each run is 2 steps of a tiny model (the "
            f"preset's mesh and layer count, `{' '.join(SIZES[:12])}`) on 8 CPU devices. "
            f"Every pair of values of two options trains together in one of them (all-pairs, "
            f"not the {full:,} runs of the full product), but the {len(never)} pairs listed "
            f"below, which no run trains. A run trains with a finite loss, or is refused in "
            f"one line, naming the option to change, before anything compiles; {trained} of "
            f"{len(runs)} train, and each refused run is one of those pairs with the other "
            f"options at their first values (adamw, auto, tiny, none, fp32, off).\n\n"
            f"The schedules run on `--mesh.stage 2 --microbatches 2` (circular and "
            f"interleaved-1f1b with `--pipeline.repeats 2`); qk-clip is "
            f"`--qk-clip 50`, remat `--model.remat full`, prefetch `--model.prefetch "
            f"--mesh.tensor 1` (its gathers are manual over the batch axes only).\n\n"
            + table(runs, outcomes) + "\n\n## Pairs no run trains\n\nEach refused with "
            "the other options at their first values, and with any one of them changed."
            "\n\n| value | with | refused |\n|---|---|---|\n"
            + "".join(f"| {a[0]}={a[1]} | {b[0]}={b[1]} | "
                      + why.removeprefix("error: ").replace("|", "\\|") + " |\n"
                      for (a, b), why in sorted(never.items())))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true",
                        help="train each run (about 9 minutes); else plan each (seconds)")
    parser.add_argument("--out", help="write the outcomes' page here (docs/combinations.md)")
    parser.add_argument("--data", default="README.md", help="the corpus of every run")
    return parser


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    import jax
    jax.config.update("jax_num_cpu_devices", 8)   # the trainer's default, before JAX starts
    with tempfile.TemporaryDirectory() as out_dir:
        refusal = planner(out_dir, args.data)
        runs, never = all_pairs(refusal)
        for i, run in enumerate(runs, 1):
            print(f"{i:3d} {run.name()}\n    trains {len(run.covers)} new pairs: "
                  + "; ".join(f"{a[0]}={a[1]} x {b[0]}={b[1]}" for a, b in run.covers))
        outcomes = [run_one(run, out_dir, args.data) if args.run
                    else Outcome(error=refusal(run.values)) for run in runs]
    for i, out in enumerate(outcomes, 1):
        print(f"{i:3d} {out.says()}")
    if args.out:
        Path(args.out).write_text(page(runs, outcomes, never))


if __name__ == "__main__":
    main()
