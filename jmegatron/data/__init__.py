"""Tokenizer, corpora and deterministic, resumable, sharded batches."""

from jmegatron.data import tokenizer
from jmegatron.data.batches import eval_batch, make_batch, window_offsets
from jmegatron.data.corpus import (Corpus, DataError, load_corpus, stdlib_files,
                                   unigram_entropy)

__all__ = ["tokenizer", "Corpus", "DataError", "load_corpus", "stdlib_files",
           "unigram_entropy", "make_batch", "eval_batch", "window_offsets"]
