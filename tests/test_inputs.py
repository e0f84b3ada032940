"""Bad input files are refused in one line naming the file (and tensor), never used
silently and never a traceback: Hugging Face folders (shard index, safetensors
files, JSON, non-finite weights), tokenizers, token files, and the output folders
of export_hf and prepare_data (nothing deleted when refused)."""

import dataclasses
import json
import re
import shutil

import chex
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from experiments import export_hf, prepare_data
from experiments import train as train_cli
from jmegatron.data import DataError, load_corpus
from jmegatron.data.tokenizer import HFTokenizer
from jmegatron.models import GPT, GPTConfig, hf
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import make_layout
from jmegatron.train import TrainConfig, create_train_state
from jmegatron.train.checkpoint import Checkpointer, leaf_codecs
from jmegatron.train.config import CheckpointConfig
from jmegatron.train.optimizer import make_optimizer
from jmegatron.train.run_folder import run_settings

CFG = GPTConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)


def one_line(err) -> str:
    """The message of an exception or a CLI's exit, checked to be one line."""
    text = err.code if isinstance(err, SystemExit) else str(err)
    assert isinstance(text, str) and "\n" not in text, text
    return text


def cli_error(main, *args) -> str:
    """Runs a CLI's main in this process; the one line it exits with."""
    with pytest.raises(SystemExit) as stop:
        main([str(a) for a in args])
    return one_line(stop.value)


def snapshot(folder) -> dict:
    """name -> bytes of every file under ``folder`` (to show nothing changed)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def params():
    return nnx.state(GPT(CFG.pad_vocab(1), nnx.Rngs(0)), nnx.Param)


@pytest.fixture(scope="module")
def saved(params, tmp_path_factory):
    """(single-file folder, sharded folder) of the tiny model."""
    root = tmp_path_factory.mktemp("hf")
    return (hf.save(params, CFG, root / "single"),
            hf.save(params, CFG, root / "sharded", max_shard_bytes=20_000))


def copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / folder.name)


# Hugging Face folders

def test_healthy_folders_load_unchanged(saved, params):
    """The checks refuse nothing sound: both folders load into the saved params."""
    single, sharded = saved
    assert len(list(sharded.glob("*.safetensors"))) > 2
    chex.assert_trees_all_equal(nnx.state(hf.load(single), nnx.Param), params)
    chex.assert_trees_all_equal(nnx.state(hf.load(sharded), nnx.Param), params)


@pytest.mark.parametrize("entry", ["../other/model-00001-of-00004.safetensors", "/etc/passwd"])
def test_index_entries_outside_the_folder_are_refused(saved, tmp_path, entry):
    folder = copy(saved[1], tmp_path)
    (tmp_path / "other").mkdir()   # a sound shard out there: it must not be read either
    shutil.copy(folder / "model-00001-of-00004.safetensors", tmp_path / "other")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = entry
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf.HFError) as err:
        hf.load(folder)
    assert one_line(err.value) == (f"{folder}/model.safetensors.index.json: weight_map entry "
                                   f"model.norm.weight -> {entry!r} is not a file inside the "
                                   "model folder")


def damage(file, how: str) -> None:
    data = file.read_bytes()
    size = int.from_bytes(data[:8], "little")
    if how == "short":
        file.write_bytes(data[:5])
    elif how == "header length":
        file.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    elif how == "header":
        file.write_bytes(data[:8] + b"{" * size + data[8 + size:])
    elif how == "data":
        file.write_bytes(data[:-100])


@pytest.mark.parametrize("how, message", [   # regular expressions
    ("short", r"truncated safetensors file \(5 bytes, shorter than its 8-byte header length\)"),
    ("header length", r"safetensors header length 1000000000000 is larger than the file "
                      r"\(\d+ bytes\): a truncated or damaged file"),
    ("header", r"the safetensors header is not a JSON object"),
    ("data", r"tensor [\w.]+'s data_offsets \[\d+, \d+\] lie beyond the file's \d+ data bytes "
             r"\(a truncated or damaged file\)"),
])
def test_damaged_safetensors_files_are_named(saved, tmp_path, how, message):
    folder = copy(saved[0], tmp_path)
    damage(folder / "model.safetensors", how)
    with pytest.raises(hf.HFError) as err:
        hf.load(folder)
    assert re.fullmatch(re.escape(f"{folder}/model.safetensors: ") + message,
                        one_line(err.value)), str(err.value)


def test_a_tensor_whose_size_disagrees_with_its_shape_is_named(saved, tmp_path):
    folder = copy(saved[0], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    data = (folder / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header["model.norm.weight"]["shape"] = [64]   # 32 floats stored
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    (folder / "model.safetensors").write_bytes(data[:8] + text + data[8 + size:])
    assert tensors["model.norm.weight"].shape == (32,)
    with pytest.raises(hf.HFError) as err:
        hf.tensor_names(folder / "model.safetensors")
    assert one_line(err.value) == (f"{folder}/model.safetensors: tensor model.norm.weight has "
                                   "128 bytes, its shape (64,) and dtype F32 need 256")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_config_or_index_that_is_not_json_is_named(saved, tmp_path, name):
    folder = copy(saved[1], tmp_path)
    (folder / name).write_text("{not json")
    with pytest.raises(hf.HFError) as err:
        hf.load(folder)
    assert one_line(err.value) == (f"{folder}/{name} is not readable JSON (Expecting property "
                                   "name enclosed in double quotes: line 1 column 2 (char 1))")


@pytest.mark.parametrize("tensor, value, sharded", [
    ("model.layers.0.mlp.down_proj.weight", np.nan, False),
    ("model.layers.1.self_attn.k_proj.weight", np.inf, True),
    ("model.embed_tokens.weight", -np.inf, True),   # read by vocabulary rows
])
def test_non_finite_weights_are_refused_by_name(saved, tmp_path, tensor, value, sharded):
    """Raised inside jax.make_array_from_callback's reader, the HFError itself
    reaches the caller, on one device and on a data 2 x fsdp 2 x tensor 2 mesh."""
    folder = copy(saved[0], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors[tensor][-1, -1] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=1, tensor=2)) if sharded else None
    with pytest.raises(hf.HFError) as err:
        hf.load(folder, mesh)
    assert type(err.value) is hf.HFError
    assert one_line(err.value) == f"{tensor} in {folder}/model.safetensors has non-finite values"


def test_save_refuses_to_leave_old_shards_beside_new_weights(saved, params, tmp_path):
    """A single model.safetensors beside an old index and shards: transformers would
    load the new weights, hf.load the old ones."""
    folder = copy(saved[1], tmp_path)
    before = snapshot(folder)
    with pytest.raises(hf.HFError) as err:
        hf.save(params, CFG, folder)
    assert one_line(err.value) == (f"{folder} holds model-00001-of-00004.safetensors of another "
                                   "model, which this save would not overwrite: write into an "
                                   "empty folder")
    assert snapshot(folder) == before


# Tokenizers and token files

@pytest.mark.parametrize("text, reason", [
    ("garbage{", "expected value at line 1 column 1"),
    ("[1, 2]", "invalid type: sequence, expected struct Tokenizer at line 1 column 1"),
])
def test_a_garbage_tokenizer_is_named(tmp_path, text, reason):
    file = tmp_path / "tokenizer.json"
    file.write_text(text)
    expected = (f"tokenizer {file} is not a tokenizer.json the tokenizers library reads "
                f"({reason})")
    with pytest.raises(ValueError) as err:
        HFTokenizer(tmp_path)
    assert one_line(err.value) == expected
    source = tmp_path / "text.txt"
    source.write_text("some text\n" * 50)
    with pytest.raises(DataError) as err:
        load_corpus(str(source), tokenizer_path=str(file))
    assert one_line(err.value) == expected
    assert cli_error(train_cli.main, "--data.tokenizer", file, "--out-dir", tmp_path / "runs",
                     "--steps", 1, "--no-progress") == f"error: {expected}"
    assert not (tmp_path / "runs").exists()


def test_a_tokenizer_config_that_is_not_json_is_named(tmp_path):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a")).save(
        str(tmp_path / "tokenizer.json"))
    assert HFTokenizer(tmp_path).eos == 1
    (tmp_path / "tokenizer_config.json").write_text("eos_token: </s>")
    with pytest.raises(ValueError) as err:
        HFTokenizer(tmp_path)
    assert one_line(err.value) == (f"{tmp_path}/tokenizer_config.json is not readable JSON "
                                   "(Expecting value: line 1 column 1 (char 0)) (the "
                                   "tokenizer's config)")


def test_a_bin_file_that_is_not_tokens_is_refused(tmp_path):
    """A bare .bin is byte tokens (vocabulary 259) unless a tokenizer is given."""
    file = tmp_path / "blob.bin"
    np.arange(0, 4000, 7, dtype=np.uint16).tofile(file)
    expected = (f"{file}: largest token id 3997 is not below the vocabulary size 259 "
                "(tokenizer bytes): not tokens of this vocabulary")
    with pytest.raises(DataError) as err:
        load_corpus(str(file))
    assert one_line(err.value) == expected
    assert cli_error(train_cli.main, "--data.path", file, "--out-dir", tmp_path / "runs",
                     "--steps", 1, "--no-progress") == f"error: {expected}"
    np.arange(0, 250, dtype=np.uint16).tofile(file)   # byte ids: accepted
    assert load_corpus(str(file)).vocab_size == 259


def test_token_ids_beyond_meta_json_vocab_are_refused(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello tokens\n" * 200)
    folder = prepare_data.prepare(str(text), tmp_path / "tokens")
    assert len(load_corpus(str(folder)).train) > 0
    ids = np.fromfile(folder / "val.bin", np.uint16)
    ids[3] = 259
    ids.tofile(folder / "val.bin")
    with pytest.raises(DataError) as err:
        load_corpus(str(folder))
    assert one_line(err.value) == (f"{folder}/val.bin: largest token id 259 is not below the "
                                   f"vocabulary size 259 (vocab_size in {folder}/meta.json): "
                                   "not tokens of this vocabulary")
    (folder / "meta.json").write_text("{")
    with pytest.raises(DataError) as err:
        load_corpus(str(folder))
    assert one_line(err.value) == (f"{folder}/meta.json is not readable JSON (Expecting "
                                   "property name enclosed in double quotes: line 1 column 2 "
                                   "(char 1)) (as experiments.prepare_data writes it)")
    (folder / "meta.json").write_text("[1, 2]")
    with pytest.raises(DataError) as err:
        load_corpus(str(folder))
    assert one_line(err.value) == (f"{folder}/meta.json is not a JSON object (as "
                                   "experiments.prepare_data writes it)")


def test_prepare_data_refuses_a_file_as_out_dir(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello\n" * 100)
    before = snapshot(tmp_path)
    assert cli_error(prepare_data.main, text, text) == f"error: {text} is a file, not a folder"
    assert cli_error(prepare_data.main, text, text / "out") == (
        f"error: {text}/out cannot be created: {text} is a file, not a folder")
    assert snapshot(tmp_path) == before


# export_hf's output folder

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(RUN/checkpoints/1 of the tiny model, its params), written as the trainer does."""
    cfg = TrainConfig(model=CFG)
    mesh = make_mesh(MeshConfig(1, 1, 1, 1), make_mesh().devices.flat[:1])
    make_model = lambda: GPT(CFG.pad_vocab(1), nnx.Rngs(0))
    abstract = nnx.split(nnx.eval_shape(make_model))[1]
    optimizer = make_optimizer(cfg, abstract, mesh, make_layout("replicated", mesh.shape))
    _, state = create_train_state(make_model, optimizer.tx, optimizer.plan)
    folder = tmp_path_factory.mktemp("run") / "checkpoints"
    checkpointer = Checkpointer(folder, CheckpointConfig(async_save=False))
    checkpointer.save(1, state, leaf_codecs(state, optimizer.plan),
                      {"model": dataclasses.asdict(CFG), "run": run_settings(cfg)})
    checkpointer.close()
    return folder / "1", state.params


def test_export_replaces_a_sharded_model_without_a_mix(checkpoint, saved, tmp_path):
    """--replace removes the old index and shards: hf.load and transformers (which
    prefers model.safetensors) read the same, new weights."""
    step, params = checkpoint
    out = copy(saved[1], tmp_path)
    (out / "tokenizer.json").write_text("{}")
    (out / "generation_config.json").write_text("{}")
    before = snapshot(out)
    assert cli_error(export_hf.main, step, out) == (
        f"error: {out} is not empty: pass --replace to replace the Hugging Face model in it")
    assert snapshot(out) == before
    assert export_hf.main([str(step), str(out), "--replace"]) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    chex.assert_trees_all_equal(nnx.state(hf.load(out), nnx.Param), params)


def test_export_replace_deletes_nothing_in_a_wrong_folder(checkpoint, saved, tmp_path):
    step, _ = checkpoint
    out = copy(saved[0], tmp_path)
    (out / "notes.txt").write_text("mine")
    (out / "runs").mkdir()
    before = snapshot(out)
    expected = (f"{out} holds notes.txt, which is not a Hugging Face model file: --replace "
                "deletes nothing there (give the model's own folder)")
    assert cli_error(export_hf.main, step, out, "--replace") == f"error: {expected}"
    with pytest.raises(ValueError) as err:   # the library: HFError, the same line
        export_hf.export(step, out, replace=True)
    assert type(err.value) is hf.HFError and one_line(err.value) == expected
    assert snapshot(out) == before and (out / "runs").is_dir()


def test_export_replace_reads_the_checkpoint_before_deleting(saved, tmp_path):
    out = copy(saved[0], tmp_path)
    before = snapshot(out)
    step = tmp_path / "run" / "checkpoints" / "3"
    step.mkdir(parents=True)   # a step folder without a checkpoint in it
    line = cli_error(export_hf.main, step, out, "--replace")
    assert line.startswith(f"error: checkpoint {step} is damaged: cannot read its meta"), line
    assert snapshot(out) == before


def test_export_refuses_a_file_as_out_dir(checkpoint, tmp_path):
    step, _ = checkpoint
    file = tmp_path / "file"
    file.write_text("x")
    assert cli_error(export_hf.main, step, file) == f"error: {file} is a file, not a folder"
    assert cli_error(export_hf.main, step, file / "out", "--replace") == (
        f"error: {file}/out cannot be created: {file} is a file, not a folder")
    assert file.read_text() == "x"
