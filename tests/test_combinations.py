"""What combines (``experiments.combinations``): every run of the all-pairs set trains
with a finite loss, or is refused in one line that names a flag, before anything
compiles; docs/combinations.md is their outcome."""

import itertools
import math
import re
from pathlib import Path

import pytest

from experiments.combinations import OPTIONS, all_pairs, page, run_one

RUNS = all_pairs()
DOCS = Path(__file__).parent.parent / "docs" / "combinations.md"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every run's outcome, in order (one module: the runs share the process's caches)."""
    out = tmp_path_factory.mktemp("combinations")
    corpus = out / "corpus.txt"   # a small corpus: read and tokenized 36 times
    corpus.write_text("".join(p.read_text() for p in sorted(
        (Path(__file__).parent.parent / "jmegatron" / "models").glob("*.py"))))
    return [run_one(run, str(out / "runs"), str(corpus)) for run in RUNS]


def test_every_pair_of_values_is_in_some_run():
    names = sorted(OPTIONS)
    for a, b in itertools.combinations(names, 2):
        seen = {(r.values[a], r.values[b]) for r in RUNS}
        assert seen == set(itertools.product(OPTIONS[a], OPTIONS[b])), (a, b)
    assert len(RUNS) < 2 * len(OPTIONS["optimizer"]) * len(OPTIONS["layout"])   # near 35


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[f"run{i + 1}" for i in range(len(RUNS))])
def test_each_run_trains_or_is_refused_in_one_line_before_compiling(outcomes, i):
    out = outcomes[i]
    assert out.crash is None, (RUNS[i].name(), out.crash)
    if out.error is None:
        assert math.isfinite(out.loss), RUNS[i].name()
        return
    assert out.error.startswith("error: ") and "\n" not in out.error, out.error
    assert out.compiled == 0, (out.error, "refused after compiling")
    assert re.search(r"--[a-z]", out.error), ("a refusal names the option to change", out.error)


def test_the_readme_presets_train_under_the_default_layout(outcomes):
    """The README's quickstart presets with --layout auto: each trains."""
    for preset in ("tiny", "qwen3-moe-tiny"):
        auto = [o for r, o in zip(RUNS, outcomes) if r.values["preset"] == preset
                and r.values["layout"] == "auto" and o.error is None]
        assert auto, preset


def test_the_docs_table_is_what_the_runs_did(outcomes):
    assert DOCS.read_text() == page(RUNS, outcomes), (
        "regenerate: python -m experiments.combinations --run --out docs/combinations.md")
