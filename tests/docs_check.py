"""Checks of a markdown page against the code: its examples, commands, links and flags.

Each check takes a page's path and returns its problems as "page:line: message"
strings, so tests/test_docs.py asserts there are none and any file can be checked
by hand: ``docs_check.check_links(Path("/tmp/page.md"))``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import io
import os
import pkgutil
import re
import shlex
import subprocess
import sys
import traceback
import types
from pathlib import Path
from unittest import mock
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
SHELL = {"bash", "sh", "shell"}

FENCE = re.compile(r" {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
NOT_RUN = re.compile(r"<!-- not run: (.*\S)\s*-->")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r" {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_.-]*")
PYTHON = re.compile(r"(\S*/)?python(3(\.\d+)?)?")
OPERATOR = re.compile(r"[();<>|&]+")
SHELL_VARIABLE = re.compile(r"\$(\w+|\{\w+\})")


@dataclasses.dataclass
class Block:
    lang: str     # the fence's info string: python, bash, "" ...
    line: int     # line number of the opening fence
    code: str
    above: str    # the nearest non-blank line above the fence


@dataclasses.dataclass
class Page:
    path: Path
    blocks: list[Block]
    prose: list[tuple[int, str]]   # (line number, text) of every line outside the blocks

    @property
    def name(self) -> str:
        return read_name(self.path)


def read_name(path: Path) -> str:
    """The path as messages give it: from the repository root when inside it."""
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def read(path: Path) -> Page:
    lines = path.read_text().splitlines()
    blocks, prose, i = [], [], 0
    while i < len(lines):
        if not (m := FENCE.match(lines[i])):
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        mark = m.group(1)   # closed by a line of at least as many of the same character
        end = next((j for j in range(i + 1, len(lines))
                    if len(s := lines[j].strip()) >= len(mark) and set(s) == {mark[0]}), len(lines))
        above = next((line for line in reversed(lines[:i]) if line.strip()), "")
        blocks.append(Block(m.group(2).lower(), i + 1, "\n".join(lines[i + 1:end]), above.strip()))
        i = end + 1
    return Page(path, blocks, prose)


def not_run(block: Block) -> str | None:
    """The REASON of a ``<!-- not run: REASON -->`` line right above the block, if any."""
    return m.group(1) if (m := NOT_RUN.fullmatch(block.above)) else None


def bad_marker(block: Block) -> str | None:
    """The complaint about a not-run marker of another form (no reason, say), if any."""
    if re.match(r"<!--\s*not\s*run", block.above) and not not_run(block):
        return f"write the marker as <!-- not run: REASON -->, not {block.above}"
    return None


# 1. Python examples run.

def run_examples(path: Path) -> list[str]:
    """Runs the page's python blocks in order in one namespace, like a notebook's cells,
    and stops at the first that raises (the later ones would build on it)."""
    page = read(path)
    # A real module, so dataclasses, pickle and jit find the examples' definitions.
    module = types.ModuleType("docs_example")
    sys.modules[module.__name__] = module
    try:
        for block in page.blocks:
            if block.lang != "python":
                continue
            where = f"{page.name}:{block.line}"
            if problem := bad_marker(block):
                return [f"{where}: {problem}"]
            if not_run(block):
                continue
            try:
                # Blank lines first, so tracebacks give the page's own line numbers.
                exec(compile("\n" * block.line + block.code, str(path), "exec"), module.__dict__)
            except (Exception, SystemExit) as err:
                lines = [f.lineno for f in traceback.extract_tb(err.__traceback__)
                         if f.filename == str(path)] or [getattr(err, "lineno", block.line)]
                last = traceback.format_exception_only(err)[-1].strip()
                return [f"{where}: python block failed at line {lines[-1]}: {last}"]
    finally:
        del sys.modules[module.__name__]
    return []


# 2. Commands parse.

def shell_lines(block: Block) -> list[tuple[int, str]]:
    """(line number, text) of each command line, backslash continuations joined."""
    out, parts = [], []
    for n, line in enumerate(block.code.splitlines(), block.line + 1):
        parts.append((n, line.rstrip().removesuffix("\\")))
        if not line.rstrip().endswith("\\"):
            out.append((parts[0][0], " ".join(text for _, text in parts)))
            parts = []
    return out + ([(parts[0][0], " ".join(text for _, text in parts))] if parts else [])


def split(line: str) -> list[str]:
    """Shell words, with operators (&&, ;, |, &) as words of their own; comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def invocations(words: list[str]):
    """(script, args) of each ``python -m experiments.NAME ARGS`` among shell words, also
    inside one quoted word (``ssh HOST "cd repo && python -m ..."``, ``bash -c "..."``).
    Whatever precedes python (env assignments, srun, timeout) is not looked at."""
    for i, word in enumerate(words):
        if (PYTHON.fullmatch(word) and words[i + 1:i + 2] == ["-m"]
                and words[i + 2:i + 3] and words[i + 2].startswith("experiments.")):
            rest = words[i + 3:]
            end = next((j for j, w in enumerate(rest) if OPERATOR.fullmatch(w)), len(rest))
            if end and rest[end - 1].isdigit() and rest[end:end + 1] in ([">"], [">&"]):
                end -= 1   # the 2 of 2>&1
            # A shell variable's value is unknown here; 0 reads as an int, a float or a str.
            args = ["0" if SHELL_VARIABLE.fullmatch(arg) else arg for arg in rest[:end]]
            yield words[i + 2].removeprefix("experiments."), args
        elif re.search(r"\s-m\s+experiments\.", word):
            yield from invocations(split(word))


def parse_error(script: str, args: list[str]) -> str | None:
    """Why ``python -m experiments.<script> args`` would stop at its arguments, or None.
    Only the parser runs: train's tyro parse, every other script's ``parser()``."""
    try:
        module = importlib.import_module(f"experiments.{script}")
    except ImportError as err:
        return f"cannot import experiments.{script}: {err}"
    if script == "train":
        parse = module.parse
    elif hasattr(module, "parser"):
        parse = module.parser().parse_args
    else:
        return f"experiments.{script} has no parser()"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parse(args)
    except SystemExit:
        return error_line(stderr.getvalue())
    except Exception as err:   # train's ConfigError: a value no setting accepts
        return f"{type(err).__name__}: {err}"
    return None


def error_line(stderr: str) -> str:
    """A parser's complaint on one line."""
    lines = [line.strip(" │") for line in stderr.splitlines() if line.strip(" │")]
    rules = [i for i, line in enumerate(lines) if set(line) <= set("-─╭╮╰╯")]
    if len(rules) >= 2:   # tyro's box: the message is between its first two rules
        return " ".join(lines[rules[0] + 1:rules[1]])
    # argparse: the usage, then "PROG: error: ..." (PROG is pytest's name here)
    return re.sub(r"^\S*: error", "error", lines[-1]) if lines else "exited"


def check_commands(path: Path) -> list[str]:
    """Every experiments command in the page's shell blocks parses (--help ones skipped)."""
    page, errors = read(path), []
    for block in page.blocks:
        if block.lang not in SHELL:
            continue
        if problem := bad_marker(block):
            errors.append(f"{page.name}:{block.line}: {problem}")
            continue
        if not_run(block):
            continue
        for n, line in shell_lines(block):
            try:
                found = list(invocations(split(line)))
            except ValueError as err:   # an unclosed quote
                errors.append(f"{page.name}:{n}: cannot split {line.strip()!r}: {err}")
                continue
            for script, args in found:
                if "--help" in args or "-h" in args:
                    continue
                if problem := parse_error(script, args):
                    command = shlex.join(["python", "-m", f"experiments.{script}", *args])
                    errors.append(f"{page.name}:{n}: {command}: {problem}")
    return errors


# 3. Links resolve.

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link counts by its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    """The anchors of the page's headings; a repeated one gets -1, -2, ..."""
    seen, out = collections.Counter(), set()
    for _, line in read(path).prose:
        if m := HEADING.fullmatch(line):
            s = slug(m.group(1))
            out.add(f"{s}-{seen[s]}" if seen[s] else s)
            seen[s] += 1
    return out


def check_links(path: Path) -> list[str]:
    """Relative links and images point to files that exist, and #anchors to headings."""
    page, errors = read(path), []
    for n, line in page.prose:
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http(s):, mailto: ...
                continue
            file, _, anchor = unquote(target).partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                errors.append(f"{page.name}:{n}: link ({target}): no file {read_name(dest)}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                errors.append(f"{page.name}:{n}: link ({target}): no heading #{anchor} "
                              f"in {dest.name}")
    return errors


# 4. Flags exist.

def script_flags() -> set[str]:
    """The option strings of every experiments script: each ``parser()``'s, and train's
    tyro flags as its help lists them (a boolean both as --X and --no-X)."""
    import experiments
    flags = set()
    for info in pkgutil.iter_modules(experiments.__path__):
        module = importlib.import_module(f"experiments.{info.name}")
        if hasattr(module, "parser"):
            flags |= set(module.parser()._option_string_actions)
    from experiments import train
    helptext = io.StringIO()
    # A fixed width: tyro lays wide help out in columns, and wraps narrow help mid-option.
    with mock.patch.dict(os.environ, COLUMNS="80"), contextlib.redirect_stdout(helptext):
        with contextlib.suppress(SystemExit):
            train.parse(["--help"])
    for line in helptext.getvalue().splitlines():
        if re.match(r"[ │] {1,3}-", line):   # an option line, not a description
            flags |= set(FLAG.findall(line))
    return flags


def flag_uses(path: Path) -> list[tuple[int, str]]:
    """(line, flag) of every --flag in the prose's inline code and in shell blocks
    (their comments included: they name flags too), but those under a not-run marker:
    a block of commands that do not parse (a typo shown on purpose) may name any flag."""
    page = read(path)
    uses = [(n, flag) for n, line in page.prose
            for _, code in INLINE_CODE.findall(line) for flag in FLAG.findall(code)]
    for block in page.blocks:
        if block.lang in SHELL and not not_run(block):
            uses += [(n, flag) for n, line in enumerate(block.code.splitlines(), block.line + 1)
                     for flag in FLAG.findall(line)]
    return uses


def check_flags(path: Path, known: set[str]) -> list[str]:
    """Every flag the page writes is known; ``--mesh.*`` (read as --mesh.) names a group."""
    def ok(flag):
        return flag in known or flag.endswith(".") and any(k.startswith(flag) for k in known)
    return [f"{read(path).name}:{n}: unknown flag {flag}" for n, flag in flag_uses(path)
            if not ok(flag)]


# 5. Commands run.

# Commands the suite cannot run on this machine's CPU, by a word they contain, and why.
CANNOT_RUN = {
    "--dist.": "several hosts (one process each; tests/test_multihost.py runs two on one machine)",
    "--init-from": "a Hugging Face model folder the user downloads (tests/test_hf.py builds one)",
    "gpt2-small": "an accelerator preset (124M parameters, 64 x 1024 tokens a step)",
    "dense-1b": "an accelerator preset (0.89B parameters)",
    "qwen3-moe-small": "an accelerator preset (0.70B parameters)",
}
# The other scripts whose commands the suite runs (slow tier), by name or prefix: each at
# its own small size, its output in a temporary folder: (arguments added, output flag).
SMALL_RUNS = {
    "bench_": (["--small"], "--out"),
    "project_scale": (["--small"], "--out"),
    "compare_optimizers": (["--steps", "4"], "--out"),
    "qk_clip_demo": (["--steps", "4"], "--out-dir"),
}
# The other scripts the pages show whose commands the suite only parses (check_commands),
# and why. A page that shows another script must run it or say here why not.
OTHER_SCRIPTS = {
    "prepare_data": "reads the user's files with a downloaded Hugging Face tokenizer "
                    "(tests/test_hf.py and tests/test_data.py run it on built ones)",
    "export_hf": "exports huggingface.md's run, which starts from a downloaded model "
                 "(tests/test_hf.py exports trained runs into transformers)",
}


def small_run(script: str) -> tuple[list[str], str] | None:
    """``SMALL_RUNS``' entry for ``script``, or None."""
    return next((run for name, run in SMALL_RUNS.items() if script.startswith(name)), None)


def unlisted_scripts(path: Path) -> list[str]:
    """The page's commands of scripts neither run (train, ``SMALL_RUNS``) nor in
    ``OTHER_SCRIPTS``."""
    return [f"{read(path).name}:{n}: experiments.{script} is neither run by the suite nor in "
            "docs_check.OTHER_SCRIPTS" for n, script, _ in commands(path)
            if script != "train" and small_run(script) is None
            and not any(script.startswith(name) for name in OTHER_SCRIPTS)]


# How a command's step counts shrink: every count to 2 (--steps to 4), and a checkpoint
# the page names (checkpoints/N) to step 2, the one a capped run writes.
CAPPED = {"--steps": "4", "--stop-after": "2", "--checkpoint.every": "2"}
SHORT = ["--sample-tokens", "0", "--eval-batches", "1", "--no-progress"]


def cannot_run(args: list[str]) -> str | None:
    """Why the suite cannot run ``python -m experiments.train args``, or None."""
    return next((why for word, why in CANNOT_RUN.items()
                 if any(word in arg for arg in args)), None)


def capped(args: list[str]) -> list[str]:
    """``args`` with every step count capped (``CAPPED``); a run of the default 300
    steps gets ``--steps 4``; no samples to speak of, one validation batch."""
    out = [CAPPED.get(args[i - 1], arg) if i else arg for i, arg in enumerate(args)]
    out = [re.sub(r"checkpoints/\d+", "checkpoints/2", arg) for arg in out]
    return out + ([] if "--steps" in out else ["--steps", "4"]) + SHORT


def commands(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, script, args) of every ``python -m experiments.SCRIPT`` the page's shell
    blocks run, in order."""
    page, out = read(path), []
    for block in page.blocks:
        if block.lang not in SHELL or not_run(block):
            continue
        for n, line in shell_lines(block):
            out += [(n, script, args) for script, args in invocations(split(line))]
    return out


def train_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line, args) of every ``python -m experiments.train`` the page's shell blocks
    run, in order (not --help: the parse checks it)."""
    return [(n, args) for n, script, args in commands(path)
            if script == "train" and "--help" not in args]


def run_commands(path: Path, main) -> list[str]:
    """Runs the page's training commands in order in the current folder (their
    ``runs/`` stays there), each capped (``capped``) by ``main(argv)``, which returns
    the line a run exits with (None: trained). The ones ``CANNOT_RUN`` are skipped, and a
    command the page repeats runs once."""
    errors, done = [], set()
    for n, args in train_commands(path):
        if cannot_run(args) or tuple(args) in done:   # a command the page repeats: once
            continue
        done.add(tuple(args))
        if (error := main(*capped(args))) is not None:
            command = shlex.join(["python", "-m", "experiments.train", *args])
            errors.append(f"{read(path).name}:{n}: {command}: {error}")
    return errors


def run_small_commands(path: Path, folder: Path, done: set) -> list[str]:
    """Runs the page's commands of ``SMALL_RUNS`` scripts in ``folder``, at their small
    size with their output there, but those in ``done`` (which gains the others: another
    page's); a line for each that exits non-zero or prints a row that failed
    (``NAME: failed: ...``)."""
    errors = []
    for n, script, args in commands(path):
        if (run := small_run(script)) is None or (script, tuple(args)) in done:
            continue
        done.add((script, tuple(args)))
        added, out_flag = run
        out = folder / f"{script}-{len(done)}{'.json' if out_flag == '--out' else ''}"
        ran = subprocess.run([sys.executable, "-m", f"experiments.{script}", *args, *added,
                              out_flag, str(out)], cwd=folder, capture_output=True, text=True)
        failed = [line for line in ran.stdout.splitlines() if ": failed: " in line]
        if ran.returncode or failed:
            command = shlex.join(["python", "-m", f"experiments.{script}", *args])
            why = failed[0] if failed else error_line(ran.stderr)
            errors.append(f"{read(path).name}:{n}: {command}: {why}")
    return errors
