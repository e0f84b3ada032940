"""Write a jmegatron checkpoint as a Hugging Face model folder.

    python -m experiments.export_hf RUN_DIR/checkpoints/STEP OUT_DIR

OUT_DIR receives config.json and safetensors shards that
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads (Llama,
Qwen3 with QK-norm, Qwen3-MoE with experts; see ``jmegatron.models.hf``), and
the run's tokenizer files when it trained with a Hugging Face tokenizer. The
checkpoint may come from any mesh and layout; it is read onto one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
from flax import nnx

from jmegatron.data.tokenizer import HFTokenizer
from jmegatron.models import GPT, GPTConfig, MoEConfig, hf
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import make_layout
from jmegatron.train import TrainConfig, create_train_state
from jmegatron.train.checkpoint import Checkpointer, CheckpointError, abstract_of, leaf_codecs
from jmegatron.train.config import CheckpointConfig
from jmegatron.train.optimizer import make_optimizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def run_config(meta: dict) -> TrainConfig:
    """The TrainConfig that wrote a checkpoint, from its meta: the model as built
    (ungrouped, unpadded) and the run settings (``run_folder.run_settings``)."""
    groups, flat = {}, {}
    for key, value in meta["run"].items():
        group, _, name = key.partition(".")
        if group != "model":
            (groups.setdefault(group, {}).__setitem__(name, value) if name
             else flat.__setitem__(group, value))
    model = {**meta["model"], "layer_group": 1, "padded_vocab_size": None}
    model = GPTConfig(**{**model, "moe": MoEConfig(**model["moe"])})
    base = TrainConfig()
    parts = {g: dataclasses.replace(getattr(base, g), **fields) for g, fields in groups.items()}
    return dataclasses.replace(base, model=model, **flat, **parts)


def export(step_dir: str | Path, out_dir: str | Path) -> Path:
    step_dir = Path(step_dir)
    if not step_dir.name.isdigit() or not step_dir.is_dir():
        raise CheckpointError(f"{step_dir} is not a checkpoint step folder (RUN/checkpoints/STEP)")
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
    out = hf.save(state.params, cfg.model, out_dir)
    tok = tokenizer_of(cfg.data)
    if tok is not None:   # the tokenizer files beside the weights, as transformers expects
        for name in TOKENIZER_FILES:
            if (tok.file.parent / name).is_file():
                shutil.copyfile(tok.file.parent / name, out / name)
    return out


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
    parser.add_argument("out_dir")
    return parser


def main(argv: list[str] | None = None) -> Path:
    args = parser().parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir)
    except (CheckpointError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {out} (config.json, safetensors)")
    return out


if __name__ == "__main__":
    main()
