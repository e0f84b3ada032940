"""Tokenizers: the built-in byte tokenizer (256 bytes plus BOS, EOS and PAD) and
any Hugging Face ``tokenizer.json`` (BPE, Unigram, WordPiece), through the
``tokenizers`` library.

Both give ``vocab_size``, ``eos`` and ``pad`` ids, ``encode(text, eos=)`` (a
uint32 id array) and ``decode(ids)``; ``load_tokenizer(None)`` is the bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jmegatron.jsonfile import json_object

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259
# Names end-of-text tokens go by, when tokenizer_config.json does not say.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "<|end_of_text|>")


def encode(text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
    """UTF-8 bytes of ``text`` as uint16 token ids (optionally framed by BOS/EOS)."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    parts = [np.array([BOS], np.uint16)] if bos else []
    parts.append(ids)
    if eos:
        parts.append(np.array([EOS], np.uint16))
    return np.concatenate(parts)


def decode(ids) -> str:
    """Text of the byte tokens in ``ids``; special tokens are dropped and bytes
    that are not valid UTF-8 (a model may emit them) become U+FFFD."""
    ids = np.asarray(ids).ravel()
    return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")


class Bytes:
    """The byte tokenizer as an object (what ``load_tokenizer(None)`` gives)."""

    name, vocab_size, eos, pad = "bytes", VOCAB_SIZE, EOS, PAD

    def encode(self, text: str, eos: bool = False) -> np.ndarray:
        return encode(text, eos=eos)

    def decode(self, ids) -> str:
        return decode(ids)


class HFTokenizer:
    """A Hugging Face tokenizer file; EOS from tokenizer_config.json's eos_token or
    the first of ``EOS_NAMES`` it has, PAD from its pad_token or EOS. A file the
    ``tokenizers`` library refuses, or a tokenizer_config.json that is not JSON,
    raises ValueError naming it (one line)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer
        path = Path(path).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"tokenizer {str(path)!r}: no tokenizer.json there (give a "
                             "tokenizer.json or a Hugging Face model folder)")
        self.file, self.name = file, str(file.resolve())
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as err:   # the library raises a bare Exception
            raise ValueError(f"tokenizer {file} is not a tokenizer.json the tokenizers library "
                             f"reads ({_first_line(err)})") from None
        self.vocab_size = self.tokenizer.get_vocab_size()
        config = _config(file.parent / "tokenizer_config.json")
        token = lambda key: _token_name(config.get(key))
        eos_names = [token("eos_token"), *EOS_NAMES]
        ids = [self.tokenizer.token_to_id(n) for n in eos_names if n]
        ids = [i for i in ids if i is not None]
        if not ids:
            raise ValueError(f"tokenizer {self.name}: no end-of-text token (tokenizer_config.json "
                             f"eos_token, or one of {', '.join(EOS_NAMES)})")
        self.eos = ids[0]
        pad = token("pad_token")
        self.pad = self.tokenizer.token_to_id(pad) if pad else None
        self.pad = self.eos if self.pad is None else self.pad

    def encode(self, text: str, eos: bool = False) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids + ([self.eos] if eos else []), np.uint32)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).ravel()],
                                     skip_special_tokens=True)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _config(file: Path) -> dict:
    """tokenizer_config.json beside the tokenizer ({} when absent)."""
    return json_object(file, hint=" (the tokenizer's config)") if file.is_file() else {}


def _token_name(entry) -> str | None:
    """A special token of tokenizer_config.json: a string or {"content": string}."""
    return entry.get("content") if isinstance(entry, dict) else entry


def load_tokenizer(path: str | Path | None):
    """``Bytes()`` for None or "bytes", else the Hugging Face tokenizer at ``path``."""
    return Bytes() if path in (None, "bytes") else HFTokenizer(path)


def token_dtype(vocab_size: int) -> str:
    """The narrowest stored dtype for ids below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
