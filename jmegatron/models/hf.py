"""Hugging Face checkpoints in and out: Llama, Qwen2, Qwen3 and Qwen3-MoE folders.

A Hugging Face folder holds ``config.json`` and ``*.safetensors`` (one file, or
shards named by ``model.safetensors.index.json``) with one tensor per
projection and layer. jmegatron stacks the layers ([L, ...], or [G, g, ...]
under the owner layout) and fuses Q, K and V into [D, K, G+2, H] and gate
and up into [D, 2, F]. ``load`` builds every shard of every parameter with
``jax.make_array_from_callback``: each device's block is read from the
layer tensors it covers (the vocabulary rows straight from the file), so no
host or device ever holds the whole model; the host holds a few layer
tensors at a time. ``save`` writes the inverse. A damaged file (truncated, not
JSON, an index entry outside the folder, NaN or infinite weights) is refused
with one line naming the file and tensor, before it is used (the reading and
its checks: ``jmegatron.models.safetensors_file``).

What maps to what (per layer i, ``model.layers.{i}.`` omitted):

    embed [V, D]              model.embed_tokens.weight (padded rows zero)
    head [D, V]               lm_head.weight^T (absent when tied)
    final_norm                model.norm.weight
    attn_norm, mlp_norm       input_layernorm, post_attention_layernorm
    attn.qkv [D, K, G+2, H]   self_attn.{q,k,v}_proj.weight, q rows as [K, G, H]
    attn.out [N, H, D]        self_attn.o_proj.weight^T
    attn.qkv_bias [K, G+2, H] self_attn.{q,k,v}_proj.bias (Qwen2)
    attn.q_norm, k_norm       self_attn.{q,k}_norm.weight (Qwen3)
    mlp.gate_up [D, 2, F]     mlp.{gate,up}_proj.weight^T
    mlp.down [F, D]           mlp.down_proj.weight^T
    moe.router [D, E]         mlp.gate.weight^T (Qwen3-MoE)
    moe.gate_up [E, D, 2, F]  mlp.experts.{e}.{gate,up}_proj.weight^T
    moe.down [E, F, D]        mlp.experts.{e}.down_proj.weight^T
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jmegatron.models.config import GPTConfig, MoEConfig
from jmegatron.models.gpt import GPT
# HFError and tensor_names are re-exported: callers import them from here.
from jmegatron.models.safetensors_file import (INDEX, HFError, Tensors, model_file,  # noqa: F401
                                               read_json, tensor_names)
from jmegatron.models.sharded import state_shardings
from jmegatron.sharding.rules import DEFAULT_RULES, VOCAB, Rules, split_size
from jmegatron.sharding.stacks import stack_of

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Options that change the computation and that jmegatron does not have; each
# must be absent or equal to the value here.
_UNSUPPORTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "use_sliding_window": False, "shared_expert_intermediate_size": 0}


def config_from_hf(path: str | Path, base: GPTConfig = GPTConfig()) -> GPTConfig:
    """The GPTConfig of the Hugging Face folder ``path``, its vocabulary unpadded.

    The architecture comes from config.json, jmegatron's own choices from
    ``base``.

    Args:
      path: a Hugging Face model folder (its config.json's model_type "llama",
        "qwen2", "qwen3" or "qwen3_moe").
      base: the config whose fields config.json does not set are kept (dtype,
        remat, init_std, MoE dispatch, aux-loss weights, ...).

    Returns:
      The config, ``padded_vocab_size`` unset (``pad_vocab`` sets it).

    Raises:
      HFError: a model type or option jmegatron does not have, a field
        config.json lacks, or a config.json that is not JSON; the message names it.
    """
    hf = read_json(model_file(Path(path), "config.json"))
    try:
        return _config(hf, path, base)
    except KeyError as err:   # one line naming the field, not a traceback
        raise HFError(f"{path}: config.json has no field {err.args[0]!r}") from None


def _config(hf: dict, path, base: GPTConfig) -> GPTConfig:
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise HFError(f"{path}: model_type={kind!r} is not supported; "
                      f"supported: {', '.join(ARCHITECTURES)}")
    for field, ok in _UNSUPPORTED.items():
        if hf.get(field) not in (None, ok):
            raise HFError(f"{path}: {field}={hf[field]!r} is not supported (jmegatron needs "
                          f"{ok!r})")
    heads = hf["num_attention_heads"]
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise HFError(f"{path}: rope_scaling={scaling!r} is not supported (jmegatron has "
                      "rope_type 'llama3' or none)")
    moe = _moe_from_hf(hf, path, base.moe) if kind == "qwen3_moe" else MoEConfig()
    return dataclasses.replace(
        base, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        d_ff=hf["intermediate_size"], rope_theta=float(hf.get("rope_theta", 10_000.0)),
        rope_scaling=(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                      float(scaling["high_freq_factor"]),
                      int(scaling["original_max_position_embeddings"])) if scaling else (),
        qk_norm=kind in ("qwen3", "qwen3_moe"), qkv_bias=kind == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf["rms_norm_eps"]), padded_vocab_size=None, moe=moe)


def _moe_from_hf(hf: dict, path, base: MoEConfig) -> MoEConfig:
    """Qwen3-MoE's layer pattern as first_dense + every: layer i is MoE when it is
    not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [i not in dense and (i + 1) % step == 0 for i in range(n)]
    first = next((i for i, m in enumerate(pattern) if m), n)
    moe = dataclasses.replace(
        base, n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
        d_ff=hf["moe_intermediate_size"], first_dense=first if step == 1 else 0, every=step,
        normalize_top_k=bool(hf.get("norm_topk_prob", False)), scoring="softmax",
        shared_d_ff=0)
    cfg = GPTConfig(n_layers=n, moe=moe)
    if list(cfg.moe_layers) != pattern:
        raise HFError(f"{path}: mlp_only_layers={sorted(dense)} with decoder_sparse_step={step}"
                      " is not a dense prefix followed by every step-th layer MoE")
    return moe


def config_to_hf(cfg: GPTConfig) -> dict:
    """The config.json of ``cfg``, as a dict.

    The family: Qwen3-MoE with experts, Qwen3 with QK-norm, Qwen2 with a QKV
    bias, else Llama.

    Args:
      cfg: the model's ``GPTConfig``.

    Returns:
      The dict (weights declared fp32, as ``save`` writes them).

    Raises:
      HFError: a model no family here has: QK-norm with a QKV bias, or experts
        without QK-norm or softmax scoring, or with a shared expert, an expert
        bias, or first_dense with every > 1.
    """
    m = cfg.moe
    kind = ("qwen3_moe" if m.n_experts else "qwen3" if cfg.qk_norm
            else "qwen2" if cfg.qkv_bias else "llama")
    if cfg.qk_norm and cfg.qkv_bias:
        raise HFError("no Hugging Face family here has both QK-norm and a QKV bias")
    if m.n_experts and (not cfg.qk_norm or m.shared_d_ff or m.scoring != "softmax"
                        or m.bias_rate or (m.first_dense and m.every > 1)):
        raise HFError("Qwen3-MoE needs qk_norm, softmax scoring and no shared expert, expert "
                      "bias or first_dense with every > 1")
    hf = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
          "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.resolved_head_dim,
          "intermediate_size": cfg.d_ff, "rope_theta": cfg.rope_theta,
          "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
          "hidden_act": "silu", "initializer_range": cfg.init_std,
          "max_position_embeddings": 4096, "attention_bias": False, "torch_dtype": "float32"}
    if cfg.rope_scaling:
        factor, low, high, context = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                              "high_freq_factor": high,
                              "original_max_position_embeddings": context}
    if m.n_experts:
        hf.update(num_experts=m.n_experts, num_experts_per_tok=m.top_k,
                  moe_intermediate_size=m.d_ff, decoder_sparse_step=m.every,
                  mlp_only_layers=list(range(m.first_dense)), norm_topk_prob=m.normalize_top_k)
    return hf


# Per stacked leaf: one layer's value in jmegatron's layout, from the tensors
# under `p` ("model.layers.{i}.").
def _qkv(t: Tensors, p: str, cfg: GPTConfig) -> np.ndarray:
    k, g, h = cfg.n_kv_heads, cfg.group_size, cfg.resolved_head_dim
    q = t.get(p + "self_attn.q_proj.weight").reshape(k, g, h, -1)
    kv = [t.get(p + f"self_attn.{n}_proj.weight").reshape(k, 1, h, -1) for n in "kv"]
    return np.concatenate([q, *kv], axis=1).transpose(3, 0, 1, 2)       # [D, K, G+2, H]


def _out(t, p, cfg):
    return t.get(p + "self_attn.o_proj.weight").T.reshape(cfg.n_heads, -1, cfg.d_model)


def _gate_up(t, p, prefix="mlp."):
    return np.stack([t.get(p + prefix + f"{n}_proj.weight").T for n in ("gate", "up")], axis=1)


_LAYER = {
    "attn_norm": lambda t, p, cfg: t.get(p + "input_layernorm.weight"),
    "mlp_norm": lambda t, p, cfg: t.get(p + "post_attention_layernorm.weight"),
    "attn.qkv": _qkv,
    "attn.out": _out,
    "attn.qkv_bias": lambda t, p, cfg: np.concatenate(
        [t.get(p + "self_attn.q_proj.bias").reshape(cfg.n_kv_heads, cfg.group_size, -1)]
        + [t.get(p + f"self_attn.{n}_proj.bias").reshape(cfg.n_kv_heads, 1, -1) for n in "kv"],
        axis=1),                                                        # [K, G+2, H]
    "attn.q_norm": lambda t, p, cfg: t.get(p + "self_attn.q_norm.weight"),
    "attn.k_norm": lambda t, p, cfg: t.get(p + "self_attn.k_norm.weight"),
    "mlp.gate_up": lambda t, p, cfg: _gate_up(t, p),
    "mlp.down": lambda t, p, cfg: t.get(p + "mlp.down_proj.weight").T,
    "moe.router": lambda t, p, cfg: t.get(p + "mlp.gate.weight").T,
}
# Expert stacks [E, ...]: only the experts a shard holds are read.
_EXPERTS = {
    "moe.gate_up": lambda t, p, e: _gate_up(t, p, f"mlp.experts.{e}."),
    "moe.down": lambda t, p, e: t.get(p + f"mlp.experts.{e}.down_proj.weight").T,
}


def _key(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def load(path: str | Path, mesh: jax.sharding.Mesh | None = None, rules: Rules = DEFAULT_RULES,
         cfg: GPTConfig | None = None) -> GPT:
    """The Hugging Face model in folder ``path`` as a jmegatron GPT, born sharded.

    Every parameter is born sharded on ``mesh`` under ``rules`` (one device when
    ``mesh`` is None), each device reading only its own blocks.

    Args:
      path: a folder with config.json and safetensors files.
      mesh: the device mesh the parameters live on (as for ``create_sharded``);
        None: the first device.
      rules: the logical-to-mesh axis rules that place each parameter.
      cfg: the config to build, from ``config_from_hf(path)`` with jmegatron-only
        fields changed (``layer_group``, ``remat``, ``dtype``, ...); by default
        ``config_from_hf(path).pad_vocab(tensor size)``.

    Returns:
      The GPT.

    Raises:
      HFError: a field of ``cfg`` that differs from the folder's, a missing
        tensor, a shape the config does not give, a file that is not JSON or
        not a whole safetensors file, an index entry outside the folder, or a
        tensor with NaN or infinite values (raised by the block readers, it
        reaches the caller of ``make_array_from_callback`` unchanged).
    """
    folder = Path(path)
    if cfg is None:
        cfg = config_from_hf(folder).pad_vocab(split_size(mesh.shape, rules, VOCAB)
                                               if mesh else 1)
    want = dataclasses.replace(config_from_hf(folder, base=cfg),
                               padded_vocab_size=cfg.padded_vocab_size)
    for field in dataclasses.fields(cfg):
        if getattr(cfg, field.name) != getattr(want, field.name):
            raise HFError(f"cfg.{field.name}={getattr(cfg, field.name)!r} differs from "
                          f"{folder}'s {getattr(want, field.name)!r}")
    tensors = Tensors(folder)
    _check_shapes(tensors, cfg)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda v: device, abstract,
                                 is_leaf=lambda v: isinstance(v, nnx.Variable))
    else:
        shardings = state_shardings(abstract, mesh, rules)
    is_var = lambda v: isinstance(v, nnx.Variable)

    def build(path, var, sharding):
        reader = _reader(_key(path), var, tensors, cfg)
        return var.replace(jax.make_array_from_callback(var.shape, sharding, reader))

    state = jax.tree.map_with_path(build, abstract, shardings, is_leaf=is_var)
    return nnx.merge(graphdef, state)


def _check_shapes(t: Tensors, cfg: GPTConfig) -> None:
    """Every layer-0 and top-level tensor has the shape the config says (one line
    naming the first that does not)."""
    d, h, v = cfg.d_model, cfg.resolved_head_dim, cfg.vocab_size
    want = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        want["lm_head.weight"] = (v, d)
    p = "model.layers.0."
    want |= {p + "self_attn.q_proj.weight": (cfg.n_heads * h, d),
             p + "self_attn.k_proj.weight": (cfg.n_kv_heads * h, d),
             p + "self_attn.o_proj.weight": (d, cfg.n_heads * h)}
    if cfg.moe_layers[0]:
        want[p + "mlp.experts.0.gate_proj.weight"] = (cfg.moe.d_ff, d)
    else:
        want[p + "mlp.gate_proj.weight"] = (cfg.d_ff, d)
    for name, shape in want.items():
        if t.shape(name) != shape:
            raise HFError(f"{t.folder}: {name} has shape {t.shape(name)}, the config says {shape}")


def _reader(key: str, var, t: Tensors, cfg: GPTConfig):
    """index -> the block of leaf ``key`` that a shard with that index holds."""
    if key in ("embed", "head"):
        def vocab_block(index):
            rows = index[0 if key == "embed" else 1]
            start, stop, _ = rows.indices(cfg.vocab)
            real = t.rows("model.embed_tokens.weight" if key == "embed" or cfg.tie_embeddings
                          else "lm_head.weight", slice(start, min(stop, cfg.vocab_size)))
            block = np.zeros((stop - start, cfg.d_model), np.float32)
            block[:len(real)] = real
            return block[:, index[1]] if key == "embed" else block.T[index[0]]
        return vocab_block
    if key == "final_norm":
        return lambda index: t.get("model.norm.weight")[index]
    stack, leaf = key.split(".", 1)
    moe = stack == "moe_blocks"
    layers = [i for i, m in enumerate(cfg.moe_layers) if m == moe]   # stack slot -> HF layer
    shape = stack_of(var)   # None: [L, ...]

    def one_layer(slot: int, rest: tuple) -> np.ndarray:
        p = f"model.layers.{layers[slot]}."
        if leaf in _EXPERTS:
            experts = range(*rest[0].indices(cfg.moe.n_experts))
            return np.stack([_EXPERTS[leaf](t, p, e) for e in experts])[(slice(None), *rest[1:])]
        if leaf == "moe.expert_bias":   # jmegatron's balancing bias starts at zero
            return np.zeros(cfg.moe.n_experts, np.float32)[rest]
        if leaf not in _LAYER:
            raise HFError(f"jmegatron parameter {key} has no Hugging Face counterpart")
        return _LAYER[leaf](t, p, cfg)[rest]

    def stacked_block(index):
        if shape is None:
            slots = range(*index[0].indices(len(layers)))
            return np.stack([one_layer(s, index[1:]) for s in slots])
        depth = len(shape.dims)
        held, rest = shape.layer_at()[index[:depth]], index[depth:]
        padding = np.broadcast_to(np.float32(0), var.shape[depth:])[rest]   # the skipped slots
        blocks = [one_layer(s, rest) if s >= 0 else padding for s in held.reshape(-1)]
        return np.stack(blocks).reshape(*held.shape, *padding.shape)
    return stacked_block


def save(params: nnx.State | GPT, cfg: GPTConfig, path: str | Path,
         max_shard_bytes: int = 2 << 30) -> Path:
    """Writes ``params`` of a model ``cfg`` as a Hugging Face folder.

    The folder (config.json, fp32 safetensors shards and their index) is what
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Gathers the whole
    model onto this process's host before writing (one process: its devices must
    hold all of it).

    Args:
      params: a GPT's state (an nnx.State; grouped stacks are fine) or the GPT.
      cfg: the model's ``GPTConfig`` (its family: see ``config_to_hf``).
      path: the folder, created if missing; files of the same names are
        overwritten.
      max_shard_bytes: the most bytes of one safetensors shard (default 2 GiB);
        a larger tensor gets a shard of its own.

    Returns:
      The folder's path.

    Raises:
      HFError: a model no Hugging Face family has (``config_to_hf``), or a folder
        holding weights this save would not overwrite (an index or shards of
        another model), which readers would mix with the new ones.
    """
    from safetensors.numpy import save_file
    out = Path(path)
    hf = config_to_hf(cfg)
    out.mkdir(parents=True, exist_ok=True)
    state = params if isinstance(params, nnx.State) else nnx.state(params)
    leaves = {_key(p): v for p, v in jax.tree.leaves_with_path(
        state, is_leaf=lambda v: isinstance(v, nnx.Variable))}
    tensors = {name: np.ascontiguousarray(a) for name, a in _hf_tensors(leaves, cfg)}
    shards, size = [{}], 0
    for name, value in tensors.items():
        if size and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    _refuse_stale_weights(out, names + [INDEX] * (len(shards) > 1))
    for name, shard in zip(names, shards):
        save_file(shard, out / name, metadata={"format": "pt"})
        # safetensors writes a temporary file (mode 0600) and renames it: give the weights
        # the mode of any new file, as config.json gets, so the umask decides who reads them.
        (out / name).chmod(0o666 & ~_umask())
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return out


def _umask() -> int:
    """The process's umask (reading it means setting it; set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _refuse_stale_weights(out: Path, writing: list[str]) -> None:
    """Refuses a folder whose old weights would outlive this save beside the new ones:
    transformers reads model.safetensors before an index, ``load`` the index first,
    so each would load another model."""
    stale = sorted(p.name for p in out.iterdir() if p.name not in writing
                   and (p.suffix == ".safetensors" or p.name == INDEX))
    if stale:
        raise HFError(f"{out} holds {stale[0]} of another model, which this save would not "
                      "overwrite: write into an empty folder")


def _hf_tensors(leaves: dict, cfg: GPTConfig):
    """(name, fp32 array) of every Hugging Face tensor, layer by layer."""
    host = lambda a: np.asarray(jax.device_get(a), np.float32)
    v, g = cfg.vocab_size, cfg.group_size
    yield "model.embed_tokens.weight", host(leaves["embed"][...][:v])
    yield "model.norm.weight", host(leaves["final_norm"][...])
    if not cfg.tie_embeddings:
        yield "lm_head.weight", host(leaves["head"][...][:, :v].T)
    slots = {False: 0, True: 0}
    for i, moe in enumerate(cfg.moe_layers):
        stack, slot = "moe_blocks" if moe else "blocks", slots[moe]
        slots[moe] += 1

        def layer(leaf):
            var = leaves[f"{stack}.{leaf}"]
            shape = stack_of(var)
            return host(var[...][slot if shape is None else shape.slot_of(slot)])

        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", layer("attn_norm")
        yield p + "post_attention_layernorm.weight", layer("mlp_norm")
        qkv = layer("attn.qkv").transpose(1, 2, 3, 0)                  # [K, G+2, H, D]
        yield p + "self_attn.q_proj.weight", qkv[:, :g].reshape(-1, cfg.d_model)
        yield p + "self_attn.k_proj.weight", qkv[:, g].reshape(-1, cfg.d_model)
        yield p + "self_attn.v_proj.weight", qkv[:, g + 1].reshape(-1, cfg.d_model)
        yield p + "self_attn.o_proj.weight", layer("attn.out").reshape(-1, cfg.d_model).T
        if cfg.qkv_bias:
            bias = layer("attn.qkv_bias")                              # [K, G+2, H]
            yield p + "self_attn.q_proj.bias", bias[:, :g].reshape(-1)
            yield p + "self_attn.k_proj.bias", bias[:, g].reshape(-1)
            yield p + "self_attn.v_proj.bias", bias[:, g + 1].reshape(-1)
        if cfg.qk_norm:
            yield p + "self_attn.q_norm.weight", layer("attn.q_norm")
            yield p + "self_attn.k_norm.weight", layer("attn.k_norm")
        if moe:
            yield p + "mlp.gate.weight", layer("moe.router").T
            gate_up, down = layer("moe.gate_up"), layer("moe.down")
            for e in range(cfg.moe.n_experts):
                q = p + f"mlp.experts.{e}."
                yield q + "gate_proj.weight", gate_up[e, :, 0].T
                yield q + "up_proj.weight", gate_up[e, :, 1].T
                yield q + "down_proj.weight", down[e].T
        else:
            gate_up = layer("mlp.gate_up")
            yield p + "mlp.gate_proj.weight", gate_up[:, 0].T
            yield p + "mlp.up_proj.weight", gate_up[:, 1].T
            yield p + "mlp.down_proj.weight", layer("mlp.down").T
