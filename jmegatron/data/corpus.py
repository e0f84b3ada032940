"""Text corpora as token streams: the built-in stdlib corpus, text files, token files.

Every corpus gives a train and a validation stream of token ids (a 1-D
array, a memmap for token files). Documents are joined with EOS.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from jmegatron.data import tokenizer
from jmegatron.jsonfile import json_object

TEST_DIRS = {"test", "tests", "idle_test"}
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """A corpus that cannot be used; the message names the path or value."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and validation token streams and where they came from."""

    train: np.ndarray
    val: np.ndarray
    source: str
    vocab_size: int = tokenizer.VOCAB_SIZE
    tokenizer: object = tokenizer.Bytes()
    """What encoded it and decodes samples (``tokenizer.load_tokenizer``)."""


def is_validation(relative_path: str, val_fraction: float) -> bool:
    """Deterministic split by file: a stable hash of the path picks validation files."""
    return zlib.crc32(relative_path.encode()) % 10_000 < val_fraction * 10_000


def stdlib_files() -> tuple[Path, list[Path]]:
    """The running interpreter's standard library ``.py`` files, without
    ``site-packages`` and test folders, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in TEST_DIRS and d != "site-packages"
                         and d != "__pycache__")
        files += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    return root, files


def text_files(spec: str) -> tuple[Path, list[Path]]:
    """Files of a folder (recursively, hidden ones skipped) or of a glob pattern."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        return path, files
    if any(ch in spec for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        root = Path(os.path.commonpath([p.parent for p in files])) if files else Path(".")
        return root, files
    raise DataError(f"corpus path {spec!r} does not exist (give a folder, a glob "
                    "pattern, or a folder/file of tokens made by experiments.prepare_data)")


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start}: "
                        f"{err.object[err.start:err.start + 4]!r})") from None


def tokenize_files(root: Path, files: list[Path], val_fraction: float,
                   tok=tokenizer.Bytes()) -> tuple[np.ndarray, np.ndarray]:
    """Token streams of the train and validation files (each document ends with EOS)."""
    splits: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for path in files:
        text = _read_text(path)
        if text:
            val = is_validation(path.relative_to(root).as_posix(), val_fraction)
            splits[val].append(tok.encode(text, eos=True))
    join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    return join(splits[False]), join(splits[True])


def split_tail(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The last ``val_fraction`` of one stream is validation (for single files)."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def load_token_files(path: Path, val_fraction: float, tok=None) -> Corpus:
    """A folder with ``train.bin``/``val.bin`` (+ ``meta.json``), or one ``.bin`` file
    whose last ``val_fraction`` becomes validation; decoded by ``tok``, by default
    the tokenizer meta.json names. The vocabulary is meta.json's vocab_size, else the
    tokenizer's; a file holding an id at or above it is refused (DataError)."""
    folder = path if path.is_dir() else path.parent
    meta_path = folder / "meta.json"
    meta = _read_meta(meta_path)
    dtype = meta.get("dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"{meta_path}: dtype {dtype!r} is not one of {sorted(TOKEN_DTYPES)}")
    if tok is None:
        try:
            tok = tokenizer.load_tokenizer(meta.get("tokenizer"))
        except ValueError as err:
            raise DataError(f"{meta_path}: {err} (give --data.tokenizer)") from None
    vocab = int(meta.get("vocab_size", tok.vocab_size))
    if tok.name != "bytes" and tok.vocab_size < vocab:   # (bytes: ids of unknown origin)
        raise DataError(f"{meta_path}: vocab_size {vocab} is larger than tokenizer "
                        f"{tok.name}'s {tok.vocab_size}")
    where = f"vocab_size in {meta_path}" if "vocab_size" in meta else f"tokenizer {tok.name}"
    if path.is_dir():
        train, val = (_tokens(path / f"{split}.bin", dtype, vocab, where)
                      for split in ("train", "val"))
    else:
        train, val = split_tail(_tokens(path, dtype, vocab, where), val_fraction)
    return Corpus(train, val, str(path), vocab, tok)


def _read_meta(meta_path: Path) -> dict:
    """A token folder's meta.json ({} when there is none)."""
    return (json_object(meta_path, DataError, " (as experiments.prepare_data writes it)")
            if meta_path.exists() else {})


def _tokens(file: Path, dtype: str, vocab: int, where: str) -> np.ndarray:
    """The ids of a token file, memory-mapped. One max over the file refuses one whose
    ids reach past the vocabulary (another tokenizer's, or no tokens at all), which
    the embedding lookup would otherwise silently clamp."""
    if not file.is_file():
        raise DataError(f"{file}: no such token file (a token folder holds train.bin, val.bin "
                        "and meta.json)")
    if file.stat().st_size == 0:   # np.memmap refuses empty files; empty splits are named later
        return np.zeros(0, TOKEN_DTYPES[dtype])
    try:
        tokens = np.memmap(file, dtype=TOKEN_DTYPES[dtype], mode="r")
    except ValueError as err:   # a size that is no whole number of ids
        raise DataError(f"{file}: not {dtype} tokens ({err})") from None
    top = int(tokens.max())
    if top >= vocab:
        raise DataError(f"{file}: largest token id {top} is not below the vocabulary size "
                        f"{vocab} ({where}): not tokens of this vocabulary")
    return tokens


def load_corpus(path: str | None = None, val_fraction: float = 0.05,
                tokenizer_path: str | None = None) -> Corpus:
    """The corpus at ``path`` (``None``: the built-in Python stdlib corpus), text
    encoded with the tokenizer at ``tokenizer_path`` (``None``: bytes; token
    folders default to the one their meta.json names)."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must lie strictly between 0 and 1")
    try:
        tok = tokenizer.load_tokenizer(tokenizer_path)
    except ValueError as err:
        raise DataError(str(err)) from None
    if path is not None:
        p = Path(path).expanduser()
        if (p.is_dir() and (p / "train.bin").exists()) or (p.is_file() and p.suffix == ".bin"):
            corpus = load_token_files(p, val_fraction, tok if tokenizer_path else None)
        elif p.is_file():
            tokens = tok.encode(_read_text(p), eos=True)
            corpus = Corpus(*split_tail(tokens, val_fraction), path, tok.vocab_size, tok)
        else:
            corpus = None
        if corpus is not None:
            _check_nonempty(corpus)
            return corpus
        root, files = text_files(path)
        source = path
    else:
        root, files = stdlib_files()
        source = f"python stdlib ({root})"
    if not files:
        raise DataError(f"no files found in corpus {source!r}")
    train, val = tokenize_files(root, files, val_fraction, tok)
    corpus = Corpus(train, val, source, tok.vocab_size, tok)
    _check_nonempty(corpus)
    return corpus


def _check_nonempty(corpus: Corpus) -> None:
    for name in ("train", "val"):
        if len(getattr(corpus, name)) == 0:
            raise DataError(f"the {name} split of corpus {corpus.source!r} is empty "
                            "(too few files or too small a val_fraction)")


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequencies (the loss of the best unigram model)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
