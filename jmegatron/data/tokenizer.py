"""Byte-level tokenizer: the 256 byte values plus BOS, EOS and PAD."""

from __future__ import annotations

import numpy as np

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259


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
