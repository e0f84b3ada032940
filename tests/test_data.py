"""Tokenizer, corpora and batches."""

import json
import sysconfig

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding

from experiments.prepare_data import prepare
from jmegatron.data import (DataError, eval_batch, load_corpus, make_batch, stdlib_files,
                            tokenizer, unigram_entropy)
from jmegatron.sharding import DEFAULT_RULES, MeshConfig, logical_to_spec, make_mesh


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_tokenizer_round_trips_any_text(text):
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids[0] == tokenizer.BOS and ids[-1] == tokenizer.EOS
    assert ids.max(initial=0) < tokenizer.VOCAB_SIZE
    assert tokenizer.decode(ids) == text


def test_decode_replaces_invalid_utf8():
    assert tokenizer.decode([0xE2, 0x82]) == "\ufffd"


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus()


def test_stdlib_corpus_skips_tests_and_site_packages(stdlib):
    root, files = stdlib_files()
    assert root.as_posix() == sysconfig.get_paths()["stdlib"]
    rel = [f.relative_to(root).parts for f in files]
    assert len(files) > 300 and all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "site-packages"} & set(parts) for parts in rel)
    assert ("os.py",) in rel
    assert 0.01 < len(stdlib.val) / (len(stdlib.train) + len(stdlib.val)) < 0.15


def test_split_is_deterministic_by_file(stdlib):
    again = load_corpus()
    np.testing.assert_array_equal(again.val, stdlib.val)
    assert 2.5 < unigram_entropy(stdlib.val) < 4.0


def test_user_corpora(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(40):
        (folder / f"f{i}.txt").write_text(f"document {i} " * 20)
    (folder / ".hidden").write_bytes(b"\xff\xfe")   # hidden files are skipped
    corpus = load_corpus(str(folder), val_fraction=0.2)
    total = len(corpus.train) + len(corpus.val)
    assert total == sum(len(f"document {i} " * 20) + 1 for i in range(40))
    glob = load_corpus(str(folder / "f1*.txt"), val_fraction=0.3)   # f1, f10..f19
    assert len(glob.train) + len(glob.val) < total
    single = load_corpus(str(folder / "f3.txt"), val_fraction=0.25)
    assert len(single.val) == len(tokenizer.encode("document 3 " * 20, eos=True)) - len(single.train)


def test_token_folder_round_trips(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(20):
        (folder / f"{i}.py").write_text(f"x = {i}\n" * 30)
    prepare(str(folder), tmp_path / "tok", val_fraction=0.2)
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    tokens = load_corpus(str(tmp_path / "tok"))
    text = load_corpus(str(folder), val_fraction=0.2)
    np.testing.assert_array_equal(tokens.train, text.train)
    assert meta["train_tokens"] == len(text.train)
    single = load_corpus(str(tmp_path / "tok" / "train.bin"), val_fraction=0.5)
    assert len(single.val) == len(text.train) - len(text.train) // 2


def folder_with(tmp_path, files: dict[str, bytes]) -> str:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return str(folder)


@pytest.mark.parametrize("files, message", [
    (None, "does not exist"),
    ({}, "no files found"),
    ({"a.txt": b""}, "split of corpus .* is empty"),
    ({"x.txt": b"ok\xff\xfe"}, r"x.txt is not UTF-8 text \(byte 2"),
])
def test_bad_corpora_name_the_path(tmp_path, files, message):
    path = str(tmp_path / "missing") if files is None else folder_with(tmp_path, files)
    with pytest.raises(DataError, match=message):
        load_corpus(path)


def test_sequence_longer_than_the_corpus():
    with pytest.raises(DataError, match="seq_len=64 needs at least 65 tokens"):
        make_batch(np.arange(30, dtype=np.uint16), 2, 64, 0, 0)


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = make_batch(tokens, 8, 16, seed=3, step=7)
    assert a.shape == (8, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, make_batch(tokens, 8, 16, seed=3, step=7))
    assert not np.array_equal(a, make_batch(tokens, 8, 16, seed=3, step=8))
    assert not np.array_equal(a, make_batch(tokens, 8, 16, seed=4, step=7))
    np.testing.assert_array_equal(a[:, 1:], a[:, :-1] + 1)   # contiguous windows
    assert not np.array_equal(eval_batch(tokens, 8, 16, 3, 0), a)


@pytest.mark.parametrize("mesh_config", [MeshConfig(data=8, fsdp=1),
                                         MeshConfig(data=2, fsdp=2, tensor=2),
                                         MeshConfig(fsdp=4, tensor=2)])
def test_sharded_batches_equal_on_every_mesh(mesh_config):
    tokens = np.arange(10_000, dtype=np.uint16)
    mesh = make_mesh(mesh_config)
    sharding = NamedSharding(mesh, logical_to_spec(("batch", "seq"), DEFAULT_RULES))
    for step in (0, 5):   # resuming at step 5 needs only the number 5
        batch = make_batch(tokens, 8, 16, 1, step, sharding)
        assert batch.sharding == sharding
        np.testing.assert_array_equal(jax.device_get(batch), make_batch(tokens, 8, 16, 1, step))
