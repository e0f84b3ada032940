"""What combines (``experiments.combinations``): every run of the all-pairs set trains
with a finite loss, or is refused in one line that names a flag, before anything
compiles; docs/combinations.md is their outcome.

The default tier reads the page's runs back and plans each (the CLI's parse and
``plan_run``: what it refuses before compiling, seconds for all of them): every pair of
values trains together in a run the plan accepts, or is listed with its refusal. The
slow tier (``python -m pytest -m slow tests/test_combinations.py``, 9 min 28 s on 2
cores) generates the page again (the cover asks the planner: about 20 s) and trains
every run the plan accepts, 2 steps each.
"""

import math
import re
from pathlib import Path

import pytest

from experiments.combinations import (OPTIONS, Outcome, Run, all_pairs, every_pair, page,
                                      planner, run_one, _pairs)

DOCS = Path(__file__).parent.parent / "docs" / "combinations.md"


def read_page(text: str) -> tuple[list[dict[str, str]], list[str], set]:
    """(each run's values, each run's outcome as written, the pairs listed as training
    nowhere) of docs/combinations.md."""
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
             for line in text.splitlines() if line.startswith("| ")]
    runs = [row for row in cells if row[0].isdigit()]
    values = [dict(zip(OPTIONS, row[1:-1])) for row in runs]
    never = {tuple(sorted(tuple(p.split("=", 1)) for p in row[:2]))
             for row in cells if "=" in row[0]}
    return values, [row[-1] for row in runs], never


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> tuple[str, str]:
    """(out_dir, corpus): a small corpus, read and tokenized by every run."""
    out = tmp_path_factory.mktemp("combinations")
    corpus = out / "corpus.txt"
    corpus.write_text("".join(p.read_text() for p in sorted(
        (Path(__file__).parent.parent / "jmegatron" / "models").glob("*.py"))))
    return str(out / "runs"), str(corpus)


@pytest.fixture(scope="module")
def refusal(where):
    return planner(*where)


@pytest.fixture(scope="module")
def written():
    return read_page(DOCS.read_text())


def test_the_pages_runs_are_what_the_cli_decides(written, refusal):
    values, said, _ = written
    assert len(values) > 30 and all(len(v) == len(OPTIONS) for v in values)
    for row, outcome in zip(values, said):
        assert outcome == Outcome(error=refusal(row)).says().replace("|", "\\|"), row


def test_every_pair_trains_in_a_run_or_is_listed_with_its_refusal(written, refusal):
    values, said, never = written
    trained = set().union(*(_pairs(v) for v, out in zip(values, said) if out == "trains"))
    assert trained | never == every_pair() and not trained & never
    refused = set().union(*(_pairs(v) for v, out in zip(values, said) if out != "trains"))
    assert never <= refused
    assert sum(out == "trains" for out in said) < 1.5 * len(every_pair()) / 7   # near 40


def assert_refused_in_one_line(error: str) -> None:
    assert error.startswith("error: ") and "\n" not in error, error
    assert re.search(r"--[a-z]", error), ("a refusal names the option to change", error)


def test_each_refusal_is_one_line_that_names_an_option(written, refusal):
    refusals = [refusal(v) for v in written[0] if refusal(v) is not None]
    assert refusals   # the matrix reaches refusals (13 of 53 today)
    for error in refusals:
        assert_refused_in_one_line(error)


@pytest.fixture(scope="module")
def generated(refusal):
    return all_pairs(refusal)


@pytest.mark.slow
def test_the_page_is_what_the_generator_writes(generated, refusal):
    runs, never = generated
    assert DOCS.read_text() == page(runs, [Outcome(error=refusal(r.values)) for r in runs],
                                    never), (
        "regenerate: python -m experiments.combinations --out docs/combinations.md")


@pytest.mark.slow
def test_every_planned_run_trains_and_every_refusal_comes_before_compiling(
        generated, refusal, where):
    for run in generated[0]:
        out, plan = run_one(run, *where), refusal(run.values)
        assert out.crash is None, (run.name(), out.crash)
        assert out.error == plan, (run.name(), out.error, plan)
        if out.error is None:
            assert math.isfinite(out.loss), run.name()
        else:
            assert out.compiled == 0, (run.name(), out.error, "refused after compiling")
