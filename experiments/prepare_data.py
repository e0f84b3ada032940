"""Tokenize text files into a token folder the trainer memory-maps.

    python -m experiments.prepare_data SOURCE OUT_DIR [--val-fraction 0.05]

SOURCE is a folder or glob of UTF-8 text files, a single text file, or `stdlib`
(the built-in corpus). OUT_DIR receives `train.bin` and `val.bin` (uint16 byte
tokens, nanoGPT style; with `--tokenizer PATH`, a Hugging Face tokenizer.json or
model folder, its ids, uint32 past 65,536) and `meta.json`, which names the
tokenizer; train on it with
`python -m experiments.train --data.path OUT_DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jmegatron.data import DataError, load_corpus, tokenizer


def prepare(source: str | None, out_dir: str | Path, val_fraction: float = 0.05,
            tokenizer_path: str | None = None) -> Path:
    out = Path(out_dir)
    check_out_folder(out, DataError)   # before the corpus is read and tokenized
    corpus = load_corpus(source, val_fraction, tokenizer_path)
    out.mkdir(parents=True, exist_ok=True)
    dtype = tokenizer.token_dtype(corpus.vocab_size)
    corpus.train.astype(dtype).tofile(out / "train.bin")
    corpus.val.astype(dtype).tofile(out / "val.bin")
    meta = {"dtype": dtype, "vocab_size": corpus.vocab_size, "tokenizer": corpus.tokenizer.name,
            "source": corpus.source, "train_tokens": len(corpus.train),
            "val_tokens": len(corpus.val)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def check_out_folder(out: Path, error: type[Exception]) -> None:
    """Raises ``error`` (one line) if ``out`` is a file or lies under one, so the
    folder could never be created."""
    for path in (out, *out.parents):   # the nearest that exists decides
        if path.exists():
            if path.is_dir():
                return
            raise error(f"{out} is a file, not a folder" if path == out else
                        f"{out} cannot be created: {path} is a file, not a folder")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("out_dir")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json or Hugging Face folder (default: bytes)")
    return parser


def main(argv: list[str] | None = None) -> Path:
    args = parser().parse_args(argv)
    try:
        out = prepare(None if args.source == "stdlib" else args.source, args.out_dir,
                      args.val_fraction, args.tokenizer)
    except DataError as err:
        sys.exit(f"error: {err}")
    print(f"wrote {out}/train.bin, val.bin, meta.json")
    return out


if __name__ == "__main__":
    main()
