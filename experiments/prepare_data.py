"""Tokenize text files into a token folder the trainer memory-maps.

    python -m experiments.prepare_data SOURCE OUT_DIR [--val-fraction 0.05]

SOURCE is a folder or glob of UTF-8 text files, a single text file, or `stdlib`
(the built-in corpus). OUT_DIR receives `train.bin` and `val.bin` (uint16 byte
tokens, nanoGPT style) and `meta.json`; train on it with
`python -m experiments.train --data.path OUT_DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jmegatron.data import DataError, load_corpus, tokenizer


def prepare(source: str | None, out_dir: str | Path, val_fraction: float = 0.05) -> Path:
    corpus = load_corpus(source, val_fraction)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus.train.astype("uint16").tofile(out / "train.bin")
    corpus.val.astype("uint16").tofile(out / "val.bin")
    meta = {"dtype": "uint16", "vocab_size": tokenizer.VOCAB_SIZE, "tokenizer": "bytes",
            "source": corpus.source, "train_tokens": len(corpus.train),
            "val_tokens": len(corpus.val)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("out_dir")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    args = parser.parse_args(argv)
    try:
        out = prepare(None if args.source == "stdlib" else args.source, args.out_dir,
                      args.val_fraction)
    except DataError as err:
        sys.exit(f"error: {err}")
    print(f"wrote {out}/train.bin, val.bin, meta.json")
    return out


if __name__ == "__main__":
    main()
