"""Write a jmegatron checkpoint as a Hugging Face model folder.

    python -m experiments.export_hf RUN_DIR/checkpoints/STEP OUT_DIR [--replace]

OUT_DIR receives config.json and safetensors shards that
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads (Llama,
Qwen3 with QK-norm, Qwen3-MoE with experts; see ``jmegatron.models.hf``), and
the run's tokenizer files when it trained with a Hugging Face tokenizer. The
checkpoint may come from any mesh and layout; it is read onto one device.
OUT_DIR must be new or empty; ``--replace`` first removes the Hugging Face
model files in it (and refuses a folder holding anything else).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
from flax import nnx

from experiments.prepare_data import check_out_folder
from jmegatron.data.tokenizer import HFTokenizer
from jmegatron.models import GPT, GPTConfig, MoEConfig, hf
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import make_layout
from jmegatron.train import TrainConfig, create_train_state
from jmegatron.train.checkpoint import Checkpointer, CheckpointError, abstract_of, leaf_codecs
from jmegatron.train.config import CheckpointConfig
from jmegatron.train.optimizer import make_optimizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# What --replace may delete (with every *.safetensors): a Hugging Face model's files.
HF_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json",
            *TOKENIZER_FILES)


def run_config(meta: dict) -> TrainConfig:
    """The TrainConfig that wrote a checkpoint, from its meta: the model as built
    (ungrouped, unpadded) and the run settings (``run_folder.run_settings``)."""
    groups, flat = {}, {}
    for key, value in meta["run"].items():
        group, _, name = key.partition(".")
        if group != "model":
            (groups.setdefault(group, {}).__setitem__(name, value) if name
             else flat.__setitem__(group, value))
    model = {**meta["model"], "layer_group": 1, "stages": 1, "padded_vocab_size": None}
    model = GPTConfig(**{**model, "moe": MoEConfig(**model["moe"])})
    base = TrainConfig()
    parts = {g: dataclasses.replace(getattr(base, g), **fields) for g, fields in groups.items()}
    return dataclasses.replace(base, model=model, **flat, **parts)


def export(step_dir: str | Path, out_dir: str | Path, replace: bool = False) -> Path:
    """Writes checkpoint ``step_dir`` as a Hugging Face folder ``out_dir``.

    Everything is read and checked before anything in ``out_dir`` is deleted.

    Args:
      step_dir: RUN/checkpoints/STEP.
      out_dir: a new or empty folder; with ``replace``, one holding only Hugging
        Face model files (``HF_FILES``, ``*.safetensors``), which are removed first,
        so no old index or shard is left beside the new weights.
      replace: remove an old Hugging Face model in ``out_dir``.

    Returns:
      The folder.

    Raises:
      CheckpointError: not a step folder, or a damaged checkpoint.
      HFError: an ``out_dir`` that is a file, not empty (without ``replace``) or
        holding other files, or a model with no Hugging Face family.
    """
    step_dir, out = Path(step_dir), Path(out_dir)
    if not step_dir.name.isdigit() or not step_dir.is_dir():
        raise CheckpointError(f"{step_dir} is not a checkpoint step folder (RUN/checkpoints/STEP)")
    old = replaced_files(out, replace)
    cfg, params = read_checkpoint(step_dir)
    hf.config_to_hf(cfg.model)   # a model no family has: refused before anything is deleted
    tok = tokenizer_of(cfg.data)   # read now: it may live in out_dir itself
    files = {name: (tok.file.parent / name).read_bytes() for name in TOKENIZER_FILES
             if (tok.file.parent / name).is_file()} if tok is not None else {}
    for path in old:
        path.unlink()
    out = hf.save(params, cfg.model, out)
    for name, data in files.items():   # beside the weights, as transformers expects
        (out / name).write_bytes(data)
    return out


def replaced_files(out: Path, replace: bool) -> list[Path]:
    """The old Hugging Face files ``--replace`` removes from ``out``; raises HFError
    (one line, nothing deleted) if ``out`` is a file, is not empty without
    ``replace``, or holds anything else (``--replace`` given the wrong folder)."""
    check_out_folder(out, hf.HFError)
    entries = sorted(out.iterdir()) if out.is_dir() else []
    if entries and not replace:
        raise hf.HFError(f"{out} is not empty: pass --replace to replace the Hugging Face model "
                         "in it")
    other = [p for p in entries if p.is_dir() or not (p.name in HF_FILES
                                                      or p.name.endswith(".safetensors"))]
    if other:
        raise hf.HFError(f"{out} holds {other[0].name}, which is not a Hugging Face model file: "
                         "--replace deletes nothing there (give the model's own folder)")
    return entries


def read_checkpoint(step_dir: Path) -> tuple[TrainConfig, nnx.State]:
    """The run's config and the checkpoint's params, restored onto one device."""
    checkpointer = Checkpointer(step_dir.parent, CheckpointConfig(async_save=False))
    cfg = run_config(checkpointer.read_meta(int(step_dir.name)))
    mesh = make_mesh(MeshConfig(1, 1, 1, 1), jax.devices()[:1])
    make_model = lambda: GPT(cfg.model.pad_vocab(1), nnx.Rngs(0))
    abstract = nnx.split(nnx.eval_shape(make_model))[1]
    optimizer = make_optimizer(cfg, abstract, mesh, make_layout("replicated", mesh.shape))
    _, state = create_train_state(make_model, optimizer.tx, optimizer.plan)
    state, _ = checkpointer.restore(int(step_dir.name), abstract_of(state),
                                    leaf_codecs(state, optimizer.plan))
    checkpointer.close()
    return cfg, state.params


def tokenizer_of(data) -> HFTokenizer | None:
    """The Hugging Face tokenizer a run trained with: --data.tokenizer, or the one
    its token folder's meta.json names (None: bytes)."""
    meta = Path(data.path or "").expanduser() / "meta.json"
    path = data.tokenizer or (json.loads(meta.read_text()).get("tokenizer")
                              if data.path and meta.is_file() else None)
    return None if path in (None, "bytes") else HFTokenizer(path)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="RUN_DIR/checkpoints/STEP")
    parser.add_argument("out_dir", help="a new or empty folder")
    parser.add_argument("--replace", action="store_true",
                        help="replace the Hugging Face model in OUT_DIR (refused if it holds "
                             "other files)")
    return parser


def main(argv: list[str] | None = None) -> Path:
    args = parser().parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir, args.replace)
    except (CheckpointError, ValueError, OSError) as err:   # OSError: a full disk, no permission
        sys.exit(f"error: {err}")
    print(f"wrote {out} (config.json, safetensors)")
    return out


if __name__ == "__main__":
    main()
