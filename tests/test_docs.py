"""The docs (README.md, docs/*.md) against the code: examples run, commands parse,
links resolve, flags exist. The checks themselves are in tests/docs_check.py.

Conventions for the pages:
- ```python blocks of a page run in order in one namespace (in a temporary folder),
  unless the line right above the fence is ``<!-- not run: REASON -->``;
- the same marker above a ```bash block keeps its commands from being parsed;
- ``python -m experiments.NAME ARGS`` in ```bash / ```sh blocks must parse;
- every ``--flag`` in inline code or a shell block is an experiments script's option
  or one of OTHER_TOOLS below;
- every ``python -m experiments.train`` command of a shell block runs, in order, in a
  temporary folder, its step counts capped (``docs_check.capped``); those that need
  an accelerator, several hosts or a downloaded model are ``docs_check.CANNOT_RUN``;
- other scripts' commands (benchmarks, projections, demos) run in the slow tier at their
  own small sizes, output in a temporary folder (``docs_check.SMALL_RUNS``); those of
  the scripts that need a downloaded model or tokenizer are parsed, and why they are
  not run is ``docs_check.OTHER_SCRIPTS``.
"""

import pytest

import cli_runs
import docs_check
from docs_check import ROOT
from jmegatron.train.programs import sharing_programs

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
by_name = pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)

# Flags the docs give to tools other than the experiments scripts.
OTHER_TOOLS = {
    "--preset",                                    # experiments.train, read before tyro
    "--xla_force_host_platform_device_count",      # XLA (in XLA_FLAGS)
    "--durations", "--dist",                      # pytest, pytest-xdist (-n 2 --dist loadfile)
    "--quiet", "--index-url",                      # pip
    "--nodes", "--ntasks-per-node", "--gpus-per-node", "--time", "--signal",   # sbatch
}


@pytest.fixture(scope="module")
def known_flags():
    return docs_check.script_flags() | OTHER_TOOLS


def check(errors):
    assert not errors, "\n".join(errors)


@by_name
def test_python_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # what examples write stays out of the checkout
    check(docs_check.run_examples(page))


@by_name
def test_commands_parse(page):
    check(docs_check.check_commands(page))


@by_name
def test_links_resolve(page):
    check(docs_check.check_links(page))


@by_name
def test_flags_exist(page, known_flags):
    check(docs_check.check_flags(page, known_flags))


@by_name
def test_commands_the_suite_does_not_run_say_why(page):
    check(docs_check.unlisted_scripts(page))


@pytest.fixture(scope="module")
def programs():
    """The docs' training runs' programs, shared by every page's (the README, training.md
    and benchmarks.md show the default run, and parallelism.md and benchmarks.md the
    MoE preset's)."""
    return {}


@by_name
def test_training_commands_run(page, tmp_path, monkeypatch, programs):
    """Runs that differ only in steps, names and folders share their programs, across
    the pages too."""
    monkeypatch.chdir(tmp_path)
    with sharing_programs(programs):
        check(docs_check.run_commands(page, cli_runs.main))


@pytest.fixture(scope="module")
def small_runs_done():
    """The other scripts' commands run so far (a command two pages show runs once)."""
    return set()


@pytest.mark.slow
@by_name
def test_other_scripts_commands_run_at_their_small_size(page, tmp_path, small_runs_done):
    """Benchmarks, projections and demos as the page shows them, each at its own small
    size (``--small``; a demo's or comparison's steps capped): they exit 0, and no
    benchmark row reports a failure."""
    check(docs_check.run_small_commands(page, tmp_path, small_runs_done))
