"""What combines (``experiments.combinations``): every run of the all-pairs set trains
with a finite loss, or is refused in one line that names a flag, before anything
compiles; docs/combinations.md is their outcome.

The default tier plans every run (the CLI's parse and ``plan_run``: what it refuses
before compiling, in a few seconds for all of them); the slow tier
(``python -m pytest -m slow tests/test_combinations.py``, 3 min 32 s on 2 cores) trains
those the plan accepts, 2 steps each, and checks that each does.
"""

import itertools
import math
import re
from pathlib import Path

import pytest

from experiments.combinations import OPTIONS, all_pairs, page, plan_one, run_one

RUNS = all_pairs()
DOCS = Path(__file__).parent.parent / "docs" / "combinations.md"


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> tuple[str, str]:
    """(out_dir, corpus): a small corpus, read and tokenized by every run."""
    out = tmp_path_factory.mktemp("combinations")
    corpus = out / "corpus.txt"
    corpus.write_text("".join(p.read_text() for p in sorted(
        (Path(__file__).parent.parent / "jmegatron" / "models").glob("*.py"))))
    return str(out / "runs"), str(corpus)


@pytest.fixture(scope="module")
def planned(where):
    return [plan_one(run, *where) for run in RUNS]


def test_every_pair_of_values_is_in_some_run():
    names = sorted(OPTIONS)
    for a, b in itertools.combinations(names, 2):
        seen = {(r.values[a], r.values[b]) for r in RUNS}
        assert seen == set(itertools.product(OPTIONS[a], OPTIONS[b])), (a, b)
    assert len(RUNS) < 2 * len(OPTIONS["optimizer"]) * len(OPTIONS["layout"])   # near 35


def assert_refused_in_one_line(error: str) -> None:
    assert error.startswith("error: ") and "\n" not in error, error
    assert re.search(r"--[a-z]", error), ("a refusal names the option to change", error)


def test_each_refusal_is_one_line_that_names_an_option(planned):
    refusals = [o.error for o in planned if o.error is not None]
    assert refusals   # the matrix reaches refusals (13 of 36 today)
    for error in refusals:
        assert_refused_in_one_line(error)


def test_the_docs_table_is_what_the_plans_decide(planned):
    """docs/combinations.md: refused as planned, and 'trains' where the plan accepts
    (what the slow tier checks by training)."""
    assert DOCS.read_text() == page(RUNS, planned), (
        "regenerate: python -m experiments.combinations --run --out docs/combinations.md")


@pytest.mark.slow
def test_every_planned_run_trains_and_every_refusal_comes_before_compiling(where, planned):
    for run, plan in zip(RUNS, planned):
        out = run_one(run, *where)
        assert out.crash is None, (run.name(), out.crash)
        assert out.error == plan.error, (run.name(), out.error, plan.error)
        if out.error is None:
            assert math.isfinite(out.loss), run.name()
        else:
            assert out.compiled == 0, (run.name(), out.error, "refused after compiling")
