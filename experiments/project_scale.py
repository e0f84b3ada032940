"""Every optimizer layout projected to real cluster sizes from AOT-compiled programs.

    python -m experiments.project_scale [--settings NAME ...] [--hardware h100 gb300 ...]
                                        [--slow] [--no-megatron] [--small] [--out PATH]
                                        [--no-optimizers | --only-optimizers]
                                        [--pipelines | --only-pipelines]

For each setting (a model, a mesh of 8 to 64 devices, a batch) and each layout
(replicated, layerwise, fsdp, owner), this compiles without allocating anything
(``jax.jit(fn).lower(jax.ShapeDtypeStruct(..., sharding=...)).compile()`` on
virtual CPU devices, one subprocess per device count) one train step
(``train.programs.build_programs``'s, as the trainer builds it) and one
optimizer step (``tx.update`` + ``optax.apply_updates``), and reads from them:

  measured   the collectives of each program with their bytes per device,
             device groups and execution counts (``hlo.parse_collectives`` of
             the optimized HLO); params + optimizer state per device
             (``memory_analysis().argument_size_in_bytes``: the train step's
             arguments, the token batch included) and temporaries
             (``temp_size_in_bytes``); the optimizer step's FLOPs per device
             (``cost_analysis()["flops"]``: Newton-Schulz's matmuls are not in a
             loop there, so the count is whole, padding and owner imbalance
             included)
  analytic   the model's training FLOPs, ``GPTConfig.flops_per_token(T) * B * T``
             split evenly over all devices (XLA's cost analysis counts a scanned
             layer body once, so it cannot be used for the model)
  assumed    every hardware figure (``jmegatron.analysis.cost_model.HARDWARE``,
             with sources): MFU 40% of the dense bf16 peak for model and
             Newton-Schulz FLOPs alike; NVLink inside a node, InfiniBand across,
             each collective timed by NCCL's ring model (its latencies by protocol
             and ring steps, 82% of NVLink's and 96% of InfiniBand's line rate;
             ``cost_model.NCCL_RING``); a device order that keeps the last mesh
             axes inside a node; no overlap (``serial``), or perfect overlap
             (``overlap``, a lower bound)

The cluster projections count FLOPs and bytes: no kernel efficiency loss for
small per-GPU matmuls, no memory-bound elementwise time (the Megatron-LM check
below adds both, ``compute_model``), no stragglers, no hierarchical
collectives, no compression. The numbers come from XLA:CPU's
partitioning: XLA:GPU may combine or schedule collectives differently.
XLA:CPU widens bf16 collectives to f32; ``hlo`` counts those buffers at 2 bytes
an element, as an accelerator sends them. What the compiled programs show, and
the projection inherits:
  - the layerwise layout gathers its updated fp32 params (Megatron gathers
    bf16 model weights); owner and fsdp gather bf16 for a bf16 model;
  - the owner layout gathers whole groups of f layer slots: with f = 64 and
    32 layers, half of every gather is padding (llama-7b/fsdp64), and
    layerwise pads its stacks the same way;
  - the MoE settings use capacity dispatch (factor 1.25), which drops what
    overflows an expert; the dropless exchange that compiles on XLA:CPU is a
    padded all_to_all sized for the worst case (every token on one expert
    rank): about 90% of qwen3-30b-a3b's train-step bytes (the opt-in
    ``qwen3-30b-a3b-dropless`` settings). The ragged exchange would send the
    routed rows only, but XLA:CPU cannot compile it.

Communication-reduced optimizers: MuonBP (``--optim muon_bp``, period P = 5) and
Dion2 (``--optim dion2``, its defaults) on llama-7b at fsdp 8, 32 and 64 (settings
``llama-7b/fsdp<N>/muon_bp`` and ``llama-7b/fsdp<N>/dion2``, the fsdp layout only:
the layout they exist for; on owner each device holds whole matrices, where MuonBP
is Muon), printed next to Muon's layouts of the same model, mesh and batch
(``Setting.base``; "vs fsdp" compares with Muon's fsdp row). One compiles in about
10 s at fsdp 8 (2-core machine), so they run by default; ``--no-optimizers`` skips
them, ``--only-optimizers`` compiles only them and Muon's llama-7b settings of the
same meshes (the comparison table). MuonBP's program holds each matrix's full step
and block step in one conditional; one step in P takes the full branch (the
registry's ``Entry.period``), so each collective counts at the share of steps it
runs in (``hlo.period_weights``: 1/P in a full-step branch, (P-1)/P in a block-step
one, 1 outside; the ``weight`` of a ``*_collective_list`` entry), in both the train
step (which holds the update) and the optimizer step: bytes, collective counts
(fractional: averaged over P) and the projected times are per step averaged over
P. XLA's cost analysis charges a conditional its costlier branch, so MuonBP's
optimizer FLOPs are corrected to the period's average of each branch's matmul
(dot) FLOPs (``opt_flops_xla_per_device`` keeps XLA's count). Every other
optimizer has P = 1: no weight, its numbers as before.

Choices per model (stated in the output too):
  gpt2-small     12 layers, D=768, 12 heads, V=50257 (padded), tied embeddings,
                 SwiGLU F=2048 (as many parameters and FLOPs as GPT-2's 4D GELU
                 MLP), T=1024, 8 sequences per batch rank, no remat
  llama-7b       32 layers, D=4096, F=11008, 32 heads (MHA), V=32000, untied,
                 T=4096, 1 sequence per batch rank, full remat
  qwen3-30b-a3b  48 MoE layers, D=2048, 32 q / 4 kv heads of H=128, QK-norm,
                 128 experts top-8 of F=768, V=151936, untied, T=4096,
                 1 sequence per batch rank, full remat; capacity dispatch (factor
                 1.25: each expert takes at most 1.25x its share of a device's
                 assignments, the rest are dropped), whose exchange is 1.25x the
                 routed rows. The dropless exchange XLA:CPU compiles is a padded
                 all_to_all sized for every token on one rank (P x the rows:
                 settings qwen3-30b-a3b-dropless/..., opt-in); the ragged one
                 (``MoEConfig(exchange="ragged")``) moves only the routed rows but
                 does not compile on XLA:CPU, so it cannot be projected here
Every model computes in bf16 with fp32 master weights; Muon with bf16
Newton-Schulz matmuls (5 quintic steps) for hidden matrices, AdamW for the rest;
no gradient clipping (as bench_layouts).

Pipelines (``--pipelines``; ``--only-pipelines``; with ``--slow`` also the 256-GPU
settings): a 70B dense model (Llama 2 70B's shape, T=4096, full remat) on 64 GPUs
as fsdp 64 and as 4 stages of fsdp 16 (gpipe, M = 16; the same batch of 256), and
with --slow on 256 GPUs (fsdp 256 against stage 4 x fsdp 64, batch 1024); rows
for layerwise, fsdp and owner (no optax row: its Muon needs equal Q/K/V blocks,
which grouped-query attention does not have). Kimi K2's mesh (--slow): PP4 DP64 EP64 on 256
devices as stage 4 x expert 64 (the expert axis is also the data axis of the
dense parts), Kimi K2's shape with GQA for its MLA attention, 2048 sequences in
M = 32 microbatches, Muon (layerwise, owner) and AdamW, against the published
1,080 and 1,051 model TFLOP/s per GPU. The projected step of a pipeline: the
layers' FLOPs over 1 - bubble (every tick computes; idle ones on zeros), the
embedding and head on every stage (the pipeline runs them outside, replicated
over the stages), the collectives as compiled (the permutes between stages on
InfiniBand: ``stage`` is the outermost mesh axis), then the optimizer step: each
stage orthogonalizes only its own matrices, after the pipeline has drained, on
every stage at once (nothing hides it; an MPMD pipeline could start the last
stage's while the first still runs its backward).

Anchors (published, other software and models; set next to the projection of
the closest setting here):
  MatrixFSDP (github.com/findlamp/matrix-fsdp, README): owner-Muon optimizer step
    4.2x faster than FSDP2-Muon on one node of 8 A100 (a 32-layer D=4096
    F=16384 model: 747 -> 175 ms) and 54.6x on 8 nodes (64 A100). Projected:
    llama-7b fsdp vs owner on the a100 preset at 8 and 64 devices.
  Megatron-Core layer-wise distributed Muon (NVIDIA's emerging-optimizers
    write-up, as quoted in issue 19): 632 -> 157 ms per optimizer step on 32
    GB300 (model not restated here). Projected: replicated vs layerwise at 32
    devices on the gb300 preset, llama-7b and qwen3-30b-a3b.

Megatron-LM check (Shoeybi et al. 2019, arXiv:1909.08053, Table 1 and Figure 1,
weak scaling of model parallelism): GPT-2-style models 1.2B on 1 GPU (D=1536,
40 layers, 16 heads), 2.5B on 2 (1920, 54, 20), 4.2B on 4 (2304, 64, 24),
8.3B on 8 (3072, 72, 32), tensor parallel 1/2/4/8, T=1024, V=51200, batch 8,
Adam, activation checkpointing per layer (remat full), fp16 (bf16 here: the
same bytes). Projected on the v100-dgx2h preset (39 TFLOP/s sustained on one
GPU, NVSwitch 150 GB/s per direction) against the measured weak-scaling
efficiencies 100/95/82/77%: efficiency = the model FLOP rate per GPU over the
one-GPU run's. Two compute models (``megatron_rows``): 'flops only' (FLOPs at
39 TFLOP/s) and 'calibrated' (``jmegatron.analysis.compute_model``: each matmul
slowed by its wave quantization, the element-wise work at HBM speed, the one
matmul rate set by the one-GPU run), each plus the compiled collectives.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from experiments.bench_common import argv, print_table, write_results
from experiments.bench_layouts import OPTAX

LAYOUT_NAMES = ("replicated", "layerwise", "fsdp", "owner")
# The optax row: optax.contrib.muon on the fsdp layout's params (bench_layouts' OPTAX).
WITH_OPTAX = LAYOUT_NAMES + (OPTAX,)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One model on one mesh with one batch."""

    name: str
    model: str
    mesh: dict                      # MeshConfig fields, every axis fixed
    batch: int                      # global B (sequences)
    seq: int                        # T
    optim: str = "muon"
    layouts: tuple[str, ...] = WITH_OPTAX
    slow: bool = False              # opt-in (--slow): compiles for longer than a few minutes
    # "scale", "megatron" (the paper check), "small" (tests, --small), or "optimizers"
    # (the communication-reduced optimizers next to Muon: --no-optimizers, --optimizers)
    group: str = "scale"
    base: str | None = None         # the Muon setting of the same model and mesh, compared with
    microbatches: int = 1           # M, through the pipeline (mesh "stage" > 1)
    schedule: str = "gpipe"         # the pipeline's (sharding.schedules.SCHEDULES)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.get(a, 1) for a in ("stage", "data", "fsdp", "expert",
                                                       "tensor"))

    @property
    def stages(self) -> int:
        return self.mesh.get("stage", 1)


def _megatron_settings() -> list[Setting]:
    return [Setting(f"megatron-{size}/tp{k}", f"megatron-{size}", {"fsdp": 1, "tensor": k}, 8,
                    1024, optim="adamw", layouts=("replicated",), group="megatron")
            for size, k in (("1.2b", 1), ("2.5b", 2), ("4.2b", 4), ("8.3b", 8))]


# The optimizers that communicate less than Muon under fsdp, compared with Muon's layouts
# on the same mesh: MuonBP (its full step every period steps, block steps between) and
# Dion2 (a fraction of each matrix orthogonalized). On the fsdp layout only: it is the
# layout they exist for; on owner MuonBP is Muon (each device holds whole matrices).
REDUCED_COMM = ("muon_bp", "dion2")


def _optimizer_settings() -> list[Setting]:
    return [Setting(f"llama-7b/fsdp{n}/{optim}", "llama-7b", {"fsdp": n}, n, 4096, optim=optim,
                    layouts=("fsdp",), group="optimizers", base=f"llama-7b/fsdp{n}")
            for n in (8, 32, 64) for optim in REDUCED_COMM]


def _pipeline_settings() -> list[Setting]:
    """A 70B dense model on 64 and 256 GPUs without and with 4 pipeline stages (the
    same batch), and the Kimi K2 mesh (PP4 DP64 EP64 on 256 GB300) with Muon and
    AdamW; M = 16 or 32 microbatches of one sequence a batch rank."""
    # No optax row: the 70B model's grouped-query Q/K/V blocks are not equal matrices
    # (optax.contrib.muon needs them so); fsdp is the same algorithm (every rank
    # orthogonalizes every matrix).
    dense = ("layerwise", "fsdp", "owner")
    return [
        Setting("llama-70b/fsdp64", "llama-70b", {"fsdp": 64}, 256, 4096, layouts=dense,
                group="pipeline"),
        Setting("llama-70b/pp4-fsdp16", "llama-70b", {"stage": 4, "fsdp": 16}, 256, 4096,
                layouts=dense, group="pipeline", microbatches=16),
        Setting("llama-70b/fsdp256", "llama-70b", {"fsdp": 256}, 1024, 4096, layouts=dense,
                group="pipeline", slow=True),
        Setting("llama-70b/pp4-fsdp64", "llama-70b", {"stage": 4, "fsdp": 64}, 1024, 4096,
                layouts=dense, group="pipeline", microbatches=16, slow=True),
        Setting("kimi-k2/pp4-ep64", "kimi-k2", {"stage": 4, "expert": 64}, 2048, 4096,
                layouts=("layerwise", "owner"), group="pipeline", microbatches=32, slow=True),
        Setting("kimi-k2/pp4-ep64/adamw", "kimi-k2", {"stage": 4, "expert": 64}, 2048, 4096,
                optim="adamw", layouts=("layerwise",), group="pipeline", microbatches=32,
                slow=True),
    ]


SETTINGS: tuple[Setting, ...] = (
    Setting("small/fsdp8", "small", {"fsdp": 8}, 8, 128, group="small"),
    # The tests' period-weighting check (MuonBP's default period 5).
    Setting("small/fsdp8/muon_bp", "small", {"fsdp": 8}, 8, 128, optim="muon_bp",
            layouts=("fsdp",), group="small", base="small/fsdp8"),
    # The tests' pipeline check.
    Setting("small/pp2-fsdp4", "small", {"stage": 2, "fsdp": 4}, 8, 128,
            layouts=("layerwise",), group="small", microbatches=2),
    Setting("gpt2-small/fsdp8", "gpt2-small", {"fsdp": 8}, 64, 1024),
    Setting("gpt2-small/fsdp32-tp2", "gpt2-small", {"fsdp": 32, "tensor": 2}, 256, 1024),
    Setting("llama-7b/fsdp8", "llama-7b", {"fsdp": 8}, 8, 4096),
    Setting("llama-7b/fsdp32", "llama-7b", {"fsdp": 32}, 32, 4096),
    Setting("llama-7b/fsdp64", "llama-7b", {"fsdp": 64}, 64, 4096),
    Setting("llama-7b/fsdp8-tp8", "llama-7b", {"fsdp": 8, "tensor": 8}, 8, 4096),
    # No optax row: optax.contrib.muon orthogonalizes a leaf as a batch of equal
    # matrices, and grouped-query Q/K/V blocks are not (bench_layouts.optax_muon).
    Setting("qwen3-30b-a3b/fsdp4-ep8", "qwen3-30b-a3b", {"fsdp": 4, "expert": 8}, 32, 4096,
            layouts=LAYOUT_NAMES),
    Setting("qwen3-30b-a3b/fsdp8-ep8", "qwen3-30b-a3b", {"fsdp": 8, "expert": 8}, 64, 4096,
            layouts=LAYOUT_NAMES),
    # The padded dropless exchange, for comparison (opt-in: name them in --settings).
    *(Setting(f"qwen3-30b-a3b-dropless/{mesh}", "qwen3-30b-a3b-dropless",
              {"fsdp": fsdp, "expert": 8}, 8 * fsdp, 4096, layouts=LAYOUT_NAMES,
              group="dropless") for mesh, fsdp in (("fsdp4-ep8", 4), ("fsdp8-ep8", 8))),
    *_megatron_settings(),
    *_optimizer_settings(),
    *_pipeline_settings(),
)


def setting(name: str) -> Setting:
    """The setting ``name``; raises a one-line ValueError."""
    for s in SETTINGS:
        if s.name == name:
            return s
    raise ValueError(f"unknown setting {name!r}; choose one of {[s.name for s in SETTINGS]}")


def model_config(name: str, tensor: int = 1):
    """The GPTConfig of model ``name`` (vocabulary padded for ``tensor``); raises a
    one-line ValueError for an unknown name."""
    from experiments.bench_layouts import model_config as bench_model
    from jmegatron.models import GPTConfig, MoEConfig

    real = dict(dtype="bfloat16")
    megatron = {"1.2b": (1536, 40, 16), "2.5b": (1920, 54, 20), "4.2b": (2304, 64, 24),
                "8.3b": (3072, 72, 32)}
    if name == "small":   # bench_layouts --small, exactly
        return bench_model(True)
    if name == "gpt2-small":
        cfg = GPTConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                        d_ff=2048, tie_embeddings=True, **real)
    elif name == "llama-7b":
        cfg = GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                        d_ff=11008, remat="full", **real)
    elif name.startswith("qwen3-30b-a3b"):
        dispatch = ({} if name.endswith("-dropless")
                    else dict(dispatch="capacity", capacity_factor=1.25))
        cfg = GPTConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                        head_dim=128, d_ff=768, qk_norm=True, remat="full",
                        moe=MoEConfig(n_experts=128, top_k=8, d_ff=768, **dispatch), **real)
    elif name == "llama-70b":   # Llama 2 70B's shape
        cfg = GPTConfig(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        d_ff=28672, remat="full", **real)
    elif name == "kimi-k2":
        # Kimi K2's published shape, its MLA attention as GQA (64 query heads, 8 KV heads
        # of 128: 132M attention parameters a layer where MLA has about 100M): 1.03T
        # parameters, 32B active. Capacity dispatch (1.25) stands in for a dropless
        # exchange sized by the real load (a ragged all-to-all, which XLA:CPU does not
        # compile): the padded dropless exchange is sized for every token on one rank,
        # 64x the tokens at EP 64.
        cfg = GPTConfig(vocab_size=163840, d_model=7168, n_layers=61, n_heads=64, n_kv_heads=8,
                        head_dim=128, d_ff=18432, remat="full",
                        moe=MoEConfig(n_experts=384, top_k=8, d_ff=2048, shared_d_ff=2048,
                                      first_dense=1, dispatch="capacity",
                                      capacity_factor=1.25), **real)
    elif name.removeprefix("megatron-") in megatron:
        d, layers, heads = megatron[name.removeprefix("megatron-")]
        # SwiGLU F = 8D/3: GPT-2's 4D GELU MLP's parameters and FLOPs (8 D^2 per layer).
        cfg = GPTConfig(vocab_size=51200, d_model=d, n_layers=layers, n_heads=heads,
                        n_kv_heads=heads, d_ff=8 * d // 3, tie_embeddings=True, remat="full",
                        **real)
    else:
        raise ValueError(f"unknown model {name!r}; choose one of ('small', 'gpt2-small', "
                         f"'llama-7b', 'llama-70b', 'qwen3-30b-a3b', 'qwen3-30b-a3b-dropless', "
                         f"'kimi-k2', "
                         f"{', '.join(repr('megatron-' + k) for k in megatron)})")
    return cfg.pad_vocab(tensor)


# --------------------------------------------------------------------------- compiling


def train_config(s: Setting, layout_name: str):
    from jmegatron.train import ScheduleConfig, TrainConfig
    from jmegatron.train.config import MuonConfig
    if layout_name == OPTAX:
        # optax's own coefficients, 5 steps (as many matmuls as the other rows'), in
        # the params' dtype (fp32): optax.contrib.muon has no bf16 Newton-Schulz.
        muon = MuonConfig(ns_coefficients="simple", ns_steps=5)
    elif s.group == "small":   # bench_layouts' exact config (its bytes are compared)
        muon = MuonConfig()
    else:
        muon = MuonConfig(ns_dtype="bfloat16")
    return TrainConfig(steps=10, grad_clip=0.0, schedule=ScheduleConfig(warmup_steps=0),
                       optim=s.optim, muon=muon)


def abstract_tokens(s: Setting, mesh, layout):
    """The abstract [B, T+1] int32 batch of ``s``, split over the layout's batch axes."""
    import jax
    import jax.numpy as jnp
    from jmegatron.sharding.rules import axis_roles
    return jax.ShapeDtypeStruct((s.batch, s.seq + 1), jnp.int32, sharding=jax.NamedSharding(
        mesh, jax.P(axis_roles(layout.rules).batch)))


def opt_step_fn(optimizer):
    """One optimizer step as bench_layouts times it."""
    import optax

    def opt_step(params, grads, opt_state):
        updates, opt_state = optimizer.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return opt_step


@dataclasses.dataclass
class Programs:
    """One layout of a setting, ready to compile: the abstract inputs and the jitted
    train and optimizer steps."""

    mesh: object
    layout: object
    cfg: object
    optimizer: object
    graphdef: object
    state: object            # abstract TrainState (ShapeDtypeStructs with shardings)
    tokens: object           # abstract [B, T+1] int32 batch
    loss_fn: object
    train_step: object       # make_train_step's jitted step
    opt_step: object         # jax.jit(opt_step_fn(optimizer))


def build_programs(s: Setting, layout_name: str, devices=None) -> Programs:
    """The programs of one layout of ``s`` as the trainer builds them
    (``train.programs.build_programs``; optax's Muon in place of the plan's optimizer
    for the optax row), with abstract inputs: nothing compiled or allocated yet."""
    import functools
    import jax
    from jmegatron.sharding import MeshConfig, make_mesh
    from jmegatron.sharding.layouts import make_layout
    from jmegatron.train import programs
    from experiments.bench_layouts import optax_muon

    devices = list(jax.devices() if devices is None else devices)[:s.devices]
    mesh = make_mesh(MeshConfig(**{"fsdp": 1, **s.mesh}), devices)
    layout = make_layout("fsdp" if layout_name == OPTAX else layout_name, mesh.shape,
                         schedule=s.schedule)
    cfg = dataclasses.replace(model_config(s.model, mesh.shape["tensor"]),
                              **layout.stack_fields)
    train = dataclasses.replace(train_config(s, layout_name), microbatches=s.microbatches)
    run = programs.build_programs(train, cfg, mesh, layout, swap_optimizer=(
        functools.partial(optax_muon, train) if layout_name == OPTAX else None))
    return Programs(mesh, layout, cfg, run.optimizer, run.graphdef, run.abstract_state(),
                    abstract_tokens(s, mesh, layout), run.loss_fn, run.train_step,
                    jax.jit(opt_step_fn(run.optimizer)))


def compile_layout(s: Setting, layout_name: str, fwd_bwd: bool = False, devices=None,
                   programs: Programs | None = None) -> dict:
    """Compiles ``s``'s train step and optimizer step under one layout (and with
    ``fwd_bwd`` bench_layouts' forward + backward) and returns the measured row,
    the collective lists included (``*_collective_list``: hlo.Collective fields)."""
    import jax
    from jmegatron.analysis import parse_collectives
    from jmegatron.analysis.hlo import period_excess_flops, period_weights
    from jmegatron.optim import trainable_params

    start = time.perf_counter()
    p = programs or build_programs(s, layout_name, devices)
    mesh, cfg, optimizer, state, tokens = p.mesh, p.cfg, p.optimizer, p.state, p.tokens
    train = p.train_step.lower(state, tokens).compile()
    train_s = time.perf_counter() - start
    params = trainable_params(state.params)
    start = time.perf_counter()
    opt = p.opt_step.lower(params, params, state.opt_state).compile()
    opt_s = time.perf_counter() - start
    train_text, opt_text = train.as_text(), opt.as_text()
    train_report = parse_collectives(train_text, mesh)
    opt_report = parse_collectives(opt_text, mesh)
    period = optimizer_period(s, layout_name)
    # MuonBP: each collective at the share of steps it runs in (period_weights: 1/P in a
    # full-step branch, (P-1)/P in a block-step one, 1 elsewhere); every other optimizer
    # runs every collective every step (no weights: the rows stay as they were).
    train_weights = period_weights(train_text, period) if period > 1 else {}
    opt_weights = period_weights(opt_text, period) if period > 1 else {}
    weighted = lambda report, weights: [
        {**dataclasses.asdict(c), "weight": weights.get(c.computation, 1.0)}
        for c in report.collectives]
    opt_flops = float(_flops(opt))
    memory = train.memory_analysis()
    row = {"setting": s.name, "model": s.model, "variant": layout_name, "optim": s.optim,
           "period": period, "base_setting": s.base or s.name,
           "mesh": ",".join(f"{k}{v}" for k, v in mesh.shape.items() if v > 1) or "1",
           "mesh_shape": dict(mesh.shape), "devices": mesh.size,
           "params_b": cfg.param_count() / 1e9, "batch": s.batch, "seq": s.seq,
           "model_flops_per_device": cfg.flops_per_token(s.seq) * s.batch * s.seq / mesh.size,
           **pipeline_work(s, cfg),
           # XLA counts a conditional at its costlier branch: MuonBP's averaged over P.
           "opt_flops_per_device": (opt_flops if period == 1 else
                                    opt_flops - period_excess_flops(opt_text, period)),
           "opt_flops_xla_per_device": opt_flops,
           "opt_flops_analytic_total": float(optimizer.flops_per_step),
           "train_collectives": _launches(train_report, train_weights),
           "train_bytes_per_device": _bytes(train_report, train_weights),
           "opt_collectives": _launches(opt_report, opt_weights),
           "opt_bytes_per_device": _bytes(opt_report, opt_weights),
           "state_bytes_per_device": memory.argument_size_in_bytes,
           "train_temp_bytes_per_device": memory.temp_size_in_bytes,
           "train_compile_s": train_s, "opt_compile_s": opt_s,
           "unknown_trip_counts": train_report.unknown_trip_counts,
           "train_collective_list": weighted(train_report, train_weights),
           "opt_collective_list": weighted(opt_report, opt_weights)}
    row.update(exchange_bytes(s, cfg, mesh.shape, train_report.collectives))
    for program in ("train", "opt"):
        row[f"{program}_gpu_bytes_per_device"] = sum(
            c.bytes_per_device * c.executions for c in collectives_of(row, program))
    if fwd_bwd:
        grad = jax.jit(jax.value_and_grad(lambda params, t: p.loss_fn(params, t)[0]))
        report = parse_collectives(grad.lower(state.params, tokens).compile().as_text(), mesh)
        row["fwd_bwd_bytes_per_device"] = report.bytes_per_device()
    return row


def pipeline_work(s: Setting, cfg) -> dict:
    """What a pipeline adds to the model's FLOPs per device (analytic): the stages,
    microbatches, schedule and bubble, and the FLOPs per device of the step's
    pipelined part (the layers, run 1 / (1 - bubble) as long: every tick computes,
    idle ones on zeros) and of its replicated part (the embedding and head, which
    every stage computes for the whole batch; a schedule that runs its own backward
    keeps what the layers' remat keeps, as JAX's backward does). Without stages: no bubble, the model's FLOPs."""
    from jmegatron.sharding.schedules import make_schedule
    tokens = s.batch * s.seq
    total = cfg.flops_per_token(s.seq) * tokens
    head = 6 * cfg.d_model * cfg.vocab * tokens
    table = make_schedule(s.schedule, s.stages, s.microbatches) if s.stages > 1 else None
    layers = total - head
    return {"stages": s.stages, "microbatches": s.microbatches,
            "schedule": s.schedule if s.stages > 1 else "-",
            "bubble": table.bubble if table else 0.0,
            "layer_flops_per_device": layers / s.devices,
            "head_flops_per_device": head * s.stages / s.devices}


def optimizer_period(s: Setting, layout_name: str) -> int:
    """P: one step in P takes the true branch of the step's conditionals (the registry's
    ``Entry.period``: MuonBP's full steps); 1 for every other optimizer and AdamW."""
    from jmegatron.train.registry import OPTIMIZERS
    entry = OPTIMIZERS.get(s.optim)
    return entry.period(train_config(s, layout_name)) if entry is not None else 1


def _launches(report, weights: dict[str, float]) -> int | float:
    """Collective instructions run per step: per call (an int) without weights, else
    averaged over the period (a float)."""
    if not weights:
        return report.launches()
    return sum(c.executions * weights.get(c.computation, 1.0) for c in report.collectives)


def _bytes(report, weights: dict[str, float]) -> float:
    """Bytes one device sends per step, averaged over the period where weighted."""
    if not weights:
        return report.bytes_per_device()
    return sum(c.bytes_per_device * c.executions * weights.get(c.computation, 1.0)
               for c in report.collectives)


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


# --------------------------------------------------------------------------- projecting


@dataclasses.dataclass(frozen=True)
class _Coll:
    """A collective read back from a row's JSON (what the cost model needs)."""

    kind: str
    axes: tuple[str, ...] | None
    group_size: int
    executions: int | float      # per step: averaged over MuonBP's period (weight) if not 1
    bytes_per_device: float


def exchange_bytes(s: Setting, cfg, mesh_shape: dict, collectives) -> dict:
    """A MoE train step's all-to-all bytes per device and the ideal: each exchange
    (dispatch, combine, their transposes, a remat's recompute) moving only the routed
    rows, tokens x top-k x D in the compute dtype, (P - 1) / P of them off the device."""
    if not cfg.moe.n_experts:
        return {}
    import numpy as np
    batch_ranks = math.prod(mesh_shape.get(a, 1) for a in ("data", "fsdp", "expert"))
    tokens = s.batch * s.seq / (batch_ranks * s.microbatches)
    rows = tokens * cfg.moe.top_k * cfg.d_model * np.dtype(cfg.dtype).itemsize
    exchanges = [c for c in collectives if c.kind.endswith("all-to-all")]
    return {"a2a_bytes_per_device": sum(c.bytes_per_device * c.executions for c in exchanges),
            "a2a_ideal_bytes_per_device": sum(rows * (c.group_size - 1) / c.group_size
                                              * c.executions for c in exchanges)}


def collectives_of(row: dict, program: str) -> list[_Coll]:
    """The ``program`` ("train" or "opt") collectives of a measured row, each at the
    width an accelerator sends and the share of steps it runs in."""
    from jmegatron.analysis.hlo import Collective
    out = []
    for c in row[f"{program}_collective_list"]:
        axes = tuple(c["axes"]) if c["axes"] is not None else None
        fields = {k: v for k, v in c.items() if k not in ("width", "weight")}
        full = Collective(**{**fields, "axes": axes})
        weight = c.get("weight", 1.0)
        runs = c["executions"] if weight == 1.0 else c["executions"] * weight
        # Rows measured before hlo counted widened bf16 buffers at 2 bytes carry a width.
        out.append(_Coll(c["kind"], axes, c["group_size"], runs,
                         full.bytes_per_device * c.get("width", 1.0)))
    return out


def project_row(row: dict, hw_name: str) -> dict:
    """Projected train step and optimizer step (ms) of a measured row on a preset."""
    from jmegatron.analysis import cost_model as cm
    hw = cm.hardware(hw_name)
    shape = row["mesh_shape"]
    opt = cm.project(row["opt_flops_per_device"], collectives_of(row, "opt"), shape, hw)
    train = cm.project(step_flops(row), collectives_of(row, "train"), shape, hw)
    return {f"{hw_name}_step_ms": 1e3 * train.serial,
            # the model's FLOPs (as one device would run them) per second of the step
            f"{hw_name}_tflops_per_gpu": row["model_flops_per_device"] / train.serial / 1e12,
            f"{hw_name}_step_overlap_ms": 1e3 * train.overlapped,
            f"{hw_name}_compute_ms": 1e3 * train.compute,
            f"{hw_name}_comm_ms": 1e3 * train.comm.seconds,
            f"{hw_name}_ib_gb": train.comm.ib_bytes / 1e9,
            f"{hw_name}_opt_ms": 1e3 * opt.serial,
            f"{hw_name}_fits": row["state_bytes_per_device"]
            + row["train_temp_bytes_per_device"] <= hw.hbm_gb * 1e9}


def step_flops(row: dict) -> float:
    """The FLOPs a device's train step takes time for: the model's, with a pipeline its
    layers stretched by the bubble and its head on every stage (``pipeline_work``);
    then the optimizer step (after the pipeline has drained: no bubble hides it)."""
    model = row["model_flops_per_device"]
    if row.get("stages", 1) > 1:
        model = row["layer_flops_per_device"] / (1 - row["bubble"]) + row[
            "head_flops_per_device"]
    return model + row["opt_flops_per_device"]


# --------------------------------------------------------------------------- running


def measure_settings(names: list[str]) -> list[dict]:
    """Compiles every layout of the settings ``names`` in this process (whose JAX
    must have enough devices)."""
    rows = []
    for name in names:
        s = setting(name)
        for layout_name in s.layouts:
            try:
                row = compile_layout(s, layout_name)
            except Exception as e:   # one layout that cannot compile must not hide the rest
                print(f"  {name} {layout_name}: FAILED {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:300]}", flush=True)
                continue
            print(f"  {name} {layout_name}: compiled in {row['train_compile_s']:.0f} s "
                  f"(train) + {row['opt_compile_s']:.0f} s (opt)", flush=True)
            rows.append(row)
    return rows


def measure_in_subprocesses(names: list[str]) -> list[dict]:
    """One subprocess per device count (``jax_num_cpu_devices`` is set once per process)."""
    by_count: dict[int, list[str]] = {}
    for name in names:
        by_count.setdefault(setting(name).devices, []).append(name)
    rows = []
    for count, group in sorted(by_count.items()):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            print(f"{count} devices: {', '.join(group)}", flush=True)
            subprocess.run([sys.executable, "-m", "experiments.project_scale", "--worker",
                            str(count), out, *group], check=True)
            with open(out) as f:
                rows += json.load(f)
    return rows


def worker(count: int, out: str, names: list[str]) -> None:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import jax
    jax.config.update("jax_num_cpu_devices", count)
    with open(out, "w") as f:
        json.dump(measure_settings(names), f, default=float)


def add_projections(rows: list[dict], hardware: list[str]) -> None:
    for r in rows:
        for hw in hardware:
            r.update(project_row(r, hw))
    for r in rows:
        # Muon's layouts of the row's own setting, or of its base (a new optimizer's rows
        # are compared with Muon's on the same model and mesh).
        home = r.get("base_setting", r["setting"])
        same = {x["variant"]: x for x in rows if x["setting"] == home}
        for hw, base in itertools.product(hardware, ("fsdp", OPTAX)):
            if base in same:   # the baseline's time over the row's: above 1 is faster
                for step in ("step", "opt"):
                    r[f"{hw}_{step}_vs_{base}"] = (same[base][f"{hw}_{step}_ms"]
                                                   / r[f"{hw}_{step}_ms"])


def print_model_tables(rows: list[dict], hardware: list[str]) -> None:
    columns = [("setting", "setting", ""), ("variant", "layout", ""), ("batch", "B", "d"),
               ("train_colls_text", "train colls", ""),
               ("train_gb", "train GB/dev", ".2f"),
               ("opt_colls_text", "opt colls", ""), ("opt_gb", "opt GB/dev", ".2f"),
               ("state_gb", "params+state GB/dev", ".1f"), ("temp_gb", "temp GB/dev", ".1f"),
               ("compile_s", "compile s", ".0f")]
    for hw in hardware:
        columns += [(f"{hw}_step_ms", f"{hw} step ms", ".0f"),
                    (f"{hw}_step_overlap_ms", "(overlap)", ".0f"),
                    (f"{hw}_opt_ms", f"{hw} opt ms", ".1f"),
                    (f"{hw}_step_vs_fsdp", "step vs fsdp", ".2f"),
                    (f"{hw}_step_vs_{OPTAX}", f"vs {OPTAX}", ".2f"),
                    (f"{hw}_opt_vs_fsdp", "opt vs fsdp", ".2f"),
                    (f"{hw}_opt_vs_{OPTAX}", f"vs {OPTAX}", ".2f"),
                    (f"{hw}_fits_text", "fits", "")]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [dict(r, train_gb=r["train_bytes_per_device"] / 1e9,
                     train_colls_text=count_text(r["train_collectives"]),
                     opt_colls_text=count_text(r["opt_collectives"]),
                     opt_gb=r["opt_bytes_per_device"] / 1e9,
                     state_gb=r["state_bytes_per_device"] / 1e9,
                     temp_gb=r["train_temp_bytes_per_device"] / 1e9,
                     compile_s=r["train_compile_s"] + r["opt_compile_s"],
                     **{f"{hw}_fits_text": "yes" if r[f"{hw}_fits"] else "no"
                        for hw in hardware})
                for r in rows if r["model"] == model]
        print(f"\n{model} ({mine[0]['params_b']:.2f}B params, T={mine[0]['seq']}):")
        moe = [("a2a_gb", "all-to-all GB/dev", ".2f"), ("a2a_vs_ideal", "vs ideal", ".2f")]
        for r in mine:
            if r.get("a2a_ideal_bytes_per_device"):
                r.update(a2a_gb=r["a2a_bytes_per_device"] / 1e9,
                         a2a_vs_ideal=r["a2a_bytes_per_device"] / r["a2a_ideal_bytes_per_device"])
        print_table(mine, columns[:5] + moe + columns[5:] if "a2a_gb" in mine[0] else columns)
    print("all-to-all GB/dev: the MoE exchanges' share of train GB/dev; vs ideal: over "
          "tokens x top-k x D per exchange (the routed rows only, none padded or dropped).")
    print("GB/dev: the compiled program's bytes, bf16 buffers XLA:CPU widened to f32 at 2 "
          "bytes, as an accelerator sends them (hlo.Collective.widened). fits: params+state "
          "+ temporaries <= the GPU's memory (XLA:CPU's buffer assignment: indicative only).")
    if any(r.get("period", 1) > 1 for r in rows):
        print("MuonBP rows (period P): collectives, their counts and bytes, and the optimizer's "
              "FLOPs are per step averaged over P steps (one full step, P - 1 block steps); "
              "'vs fsdp' compares with Muon's fsdp row of the same mesh.")


def auto_rows(rows: list[dict], hardware: list[str]) -> list[dict]:
    """``--layout auto``'s choice (``optim.auto_layout.estimate``, from the params'
    shapes alone) for every setting with several layouts compiled, next to the
    fastest compiled layout's projected step and the chosen one's."""
    from flax import nnx
    from jmegatron.models import GPT
    from jmegatron.optim.auto_layout import estimate
    from jmegatron.train.registry import OPTIMIZERS
    out = []
    for name in dict.fromkeys(r["setting"] for r in rows):
        s = setting(name)
        compiled = {r["variant"]: r for r in rows if r["setting"] == name
                    and r["variant"] in LAYOUT_NAMES}
        if len(compiled) < 2 or s.stages > 1:
            continue
        cfg = model_config(s.model, s.mesh.get("tensor", 1))
        params = nnx.state(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))
        entry = OPTIMIZERS.get(s.optim)
        for hw in hardware:
            ranked = estimate(params, next(iter(compiled.values()))["mesh_shape"], hw,
                              layouts=list(compiled),
                              cost=entry.matrix_flops(train_config(s, "fsdp")) if entry else None)
            step = {k: r[f"{hw}_step_ms"] for k, r in compiled.items()}
            fastest = min(step, key=step.get)
            out.append({"setting": name, "hw": hw, "auto": ranked[0].layout,
                        "auto_ms": 1e3 * ranked[0].seconds,
                        "runner_up": ranked[1].layout if len(ranked) > 1 else "-",
                        "fastest": fastest, "fastest_ms": step[fastest],
                        "chosen_ms": step[ranked[0].layout],
                        "vs_fastest": step[ranked[0].layout] / step[fastest]})
    return out


def print_auto_table(rows: list[dict]) -> None:
    if not rows:
        return
    print("\n--layout auto (modelled from the params' shapes) against the compiled "
          "projections: its choice, and the compiled step of the choice over the fastest's:")
    print_table(rows, [("setting", "setting", ""), ("hw", "hardware", ""),
                       ("auto", "auto", ""), ("auto_ms", "modelled ms", ".1f"),
                       ("runner_up", "runner-up", ""), ("fastest", "fastest compiled", ""),
                       ("fastest_ms", "its step ms", ".0f"), ("chosen_ms", "auto's step ms", ".0f"),
                       ("vs_fastest", "vs fastest", ".3f")])


def count_text(count: int | float) -> str:
    """A collective count: an int per call, or a period's average to one decimal."""
    return str(round(count)) if float(count).is_integer() else f"{count:.1f}"


def optimizer_rows(rows: list[dict], hardware: list[str]) -> list[dict]:
    """The comparison of the communication-reduced optimizers' fsdp rows with Muon's
    layouts on the same mesh (rows with projections): per mesh, Muon's rows, then each
    optimizer's."""
    reduced = [r for r in rows if r.get("optim", "muon") != "muon"
               and r.get("base_setting", r["setting"]) != r["setting"]]
    out = []
    for home in dict.fromkeys(r["base_setting"] for r in reduced):
        muon = {r["variant"]: r for r in rows if r["setting"] == home}
        base = muon.get("fsdp")
        for r in [muon[v] for v in (*LAYOUT_NAMES, OPTAX) if v in muon] + [
                x for x in reduced if x["base_setting"] == home]:
            out.append({"mesh": r["mesh"], "optim": r.get("optim", "muon"), "variant":
                        r["variant"], "period": r.get("period", 1),
                        "opt_colls_text": count_text(r["opt_collectives"]),
                        "opt_gb": r["opt_gpu_bytes_per_device"] / 1e9,
                        "opt_vs_muon": (r["opt_gpu_bytes_per_device"]
                                        / base["opt_gpu_bytes_per_device"]
                                        if base and base["opt_gpu_bytes_per_device"] else None),
                        "train_gb": r["train_gpu_bytes_per_device"] / 1e9,
                        "opt_tflop": r["opt_flops_per_device"] / 1e12,
                        **{k: r[k] for hw in hardware
                           for k in (f"{hw}_step_ms", f"{hw}_opt_ms") if k in r}})
    return out


def print_optimizer_table(rows: list[dict], hardware: list[str]) -> None:
    if not rows:
        return
    print("\nCommunication-reduced optimizers on fsdp next to Muon's layouts (same model, "
          "mesh and batch); per step, MuonBP averaged over its period P:")
    columns = [("mesh", "mesh", ""), ("optim", "optimizer", ""), ("variant", "layout", ""),
               ("period", "P", "d"), ("opt_colls_text", "opt colls", ""),
               ("opt_gb", "opt GB/dev", ".2f"), ("opt_vs_muon", "vs muon fsdp", ".3f"),
               ("train_gb", "train GB/dev", ".2f"), ("opt_tflop", "opt TFLOP/dev", ".2f")]
    for hw in hardware:
        columns += [(f"{hw}_step_ms", f"{hw} step ms", ".0f"),
                    (f"{hw}_opt_ms", f"{hw} opt ms", ".1f")]
    print_table(rows, columns)
    print("opt GB/dev, train GB/dev: bytes one device sends (bf16 all-reduces at 2 bytes); "
          "vs muon fsdp: opt GB/dev over Muon's on the fsdp layout; opt TFLOP/dev: the "
          "optimizer step's FLOPs (XLA's count; MuonBP's conditionals at the period's "
          "average of their branches' matmuls).")


# Kimi K2's training run as the seed reports it: PP4 DP64 EP64 on 256 GB300, model
# TFLOP/s per GPU.
KIMI_K2_PUBLISHED = {"muon": 1080.0, "adamw": 1051.0}


def print_pipeline_table(rows: list[dict], hardware: list[str]) -> None:
    """The pipeline settings next to the same model without stages: bubble, bytes across
    stages, and the projected step and model TFLOP/s per GPU."""
    mine = [r for r in rows if r["setting"].split("/")[0] in ("llama-70b", "kimi-k2")]
    if not mine:
        return
    out = []
    for r in mine:
        across = [c for c in collectives_of(r, "train")
                  if c.axes is None or "stage" in c.axes]
        out.append({**r, "pipeline": (f"{r['schedule']} S={r['stages']} M={r['microbatches']}"
                                      if r["stages"] > 1 else "none"),
                    "stage_gb": sum(c.bytes_per_device * c.executions for c in across) / 1e9,
                    "train_gb": r["train_gpu_bytes_per_device"] / 1e9,
                    "state_gb": r["state_bytes_per_device"] / 1e9,
                    "published": KIMI_K2_PUBLISHED.get(r["optim"])
                    if r["model"] == "kimi-k2" else None})
    columns = [("setting", "setting", ""), ("optim", "optim", ""), ("variant", "layout", ""),
               ("pipeline", "pipeline", ""), ("bubble", "bubble", ".1%"),
               ("train_gb", "train GB/dev", ".2f"), ("stage_gb", "across stages GB/dev", ".3f"),
               ("state_gb", "params+state GB/dev", ".1f")]
    for hw in hardware:
        columns += [(f"{hw}_step_ms", f"{hw} step ms", ".0f"),
                    (f"{hw}_opt_ms", f"{hw} opt ms", ".0f"),
                    (f"{hw}_tflops_per_gpu", f"{hw} model TFLOP/s/GPU", ".0f")]
    columns.append(("published", "published TFLOP/s/GPU", ".0f"))
    print("\nPipelines (the step: the layers' FLOPs over 1 - bubble, the embedding and head "
          "on every stage, then the optimizer step of each stage's own matrices, which no "
          "bubble hides); model TFLOP/s/GPU = the model's FLOPs per device / the projected "
          "step:")
    print_table(out, columns)


def anchors(rows: list[dict]) -> list[dict]:
    """The published ratios next to what the projection says for the same setting."""
    def ratio(name: str, slow: str, fast: str, hw: str) -> tuple[float, float, float] | None:
        got = {r["variant"]: r for r in rows if r["setting"] == name}
        if slow not in got or fast not in got:
            return None
        ms = lambda r: project_row(r, hw)[f"{hw}_opt_ms"]
        return ms(got[slow]) / ms(got[fast]), ms(got[slow]), ms(got[fast])

    out = []
    for claim, published, name, slow, fast, hw in (
            ("MatrixFSDP, 1 node of 8 A100", "4.2x (747 -> 175 ms)", "llama-7b/fsdp8",
             "fsdp", "owner", "a100"),
            ("MatrixFSDP, 1 node of 8 A100", "4.2x (747 -> 175 ms)", "llama-7b/fsdp8",
             OPTAX, "owner", "a100"),
            ("MatrixFSDP, 8 nodes (64 A100)", "54.6x", "llama-7b/fsdp64", "fsdp", "owner",
             "a100"),
            ("MatrixFSDP, 8 nodes (64 A100)", "54.6x", "llama-7b/fsdp64", OPTAX, "owner",
             "a100"),
            ("Megatron layer-wise Muon, 32 GB300", "4.0x (632 -> 157 ms)", "llama-7b/fsdp32",
             "replicated", "layerwise", "gb300"),
            ("Megatron layer-wise Muon, 32 GB300", "4.0x (632 -> 157 ms)",
             "qwen3-30b-a3b/fsdp4-ep8", "replicated", "layerwise", "gb300")):
        got = ratio(name, slow, fast, hw)
        if got is not None:
            out.append({"variant": claim, "published": published, "setting": name,
                        "compare": f"{slow} / {fast} on {hw}", "slow_ms": got[1],
                        "fast_ms": got[2], "projected": got[0]})
    return out


# The paper's measured weak-scaling efficiencies (Figure 1, model parallel).
MEGATRON_MEASURED = {1: 1.00, 2: 0.95, 4: 0.82, 8: 0.77}
MEGATRON_BASE = "megatron-1.2b/tp1"   # the one-GPU run the efficiencies are relative to


def megatron_rows(rows: list[dict]) -> list[dict]:
    """Projected weak-scaling efficiency of the paper's configurations on v100-dgx2h.

    Two projections of each compiled program, each relative to the one-GPU 1.2B model
    at the paper's 39 TFLOP/s (computed from its config, so it needs no compiled row):
      flops only   the model's FLOPs at 39 TFLOP/s, then the collectives
      calibrated   ``compute_model``: every matmul slowed by its wave quantization
                   on 80 SMs, at the one rate that makes the one-GPU step take
                   F / 39 TFLOP/s; the element-wise work at HBM speed; then the
                   collectives (the same in both, by ``cost_model.NCCL_RING``)
    Nothing is set from the 2, 4 and 8-GPU measurements.
    """
    from jmegatron.analysis import compute_model as cmp
    from jmegatron.analysis import cost_model as cm
    hw = cm.hardware("v100-dgx2h")
    fast = dataclasses.replace(hw, nvlink_gb_s=300.0)   # the paper's 300 GB/s per direction
    base = setting(MEGATRON_BASE)

    def work(s: Setting):
        tensor = s.mesh["tensor"]
        return cmp.dense_step_work(model_config(s.model, tensor), s.batch, s.seq, tensor)

    base_flops = model_config(base.model).flops_per_token(base.seq) * base.batch * base.seq
    base_seconds = base_flops / hw.flops_per_s
    rate = cmp.calibrate(work(base), base_seconds, hw)
    out = []
    for r in rows:
        if not r["setting"].startswith("megatron-"):
            continue
        s, flops = setting(r["setting"]), r["model_flops_per_device"]
        w, colls = work(s), collectives_of(r, "train")
        comm = cm.comm_cost(colls, r["mesh_shape"], hw).seconds
        comm300 = cm.comm_cost(colls, r["mesh_shape"], fast).seconds
        full_waves = cmp.matmul_seconds(w, 1.0, hw.sms)   # at 1 FLOP/s: FLOPs over wave efficiency
        matmul = full_waves / rate
        memory = cmp.memory_seconds(w, hw.hbm_gb_s * 1e9)

        def efficiency(seconds: float) -> float:
            return flops / seconds / (base_flops / base_seconds)

        out.append({"variant": r["setting"], "gpus": r["devices"], "params_b": r["params_b"],
                    "tp_allreduces": r["train_collectives"],
                    "tp_gb": r["train_bytes_per_device"] / 1e9,
                    "wave": w.flops / full_waves,
                    "matmul_ms": 1e3 * matmul, "memory_ms": 1e3 * memory,
                    "comm_ms": 1e3 * comm,
                    "flops_only": efficiency(flops / hw.flops_per_s + comm),
                    "projected": efficiency(matmul + memory + comm),
                    "projected_300": efficiency(matmul + memory + comm300),
                    "measured": MEGATRON_MEASURED.get(r["devices"]),
                    "state_gb": r["state_bytes_per_device"] / 1e9,
                    "temp_gb": r["train_temp_bytes_per_device"] / 1e9})
    return out


MEGATRON_NOTE = """\
How each term was set (nothing from the 2, 4 and 8-GPU measurements): 39 TFLOP/s
on one GPU is the paper's; 256 x 128 GEMM tiles, one per SM, from NVIDIA's
Matrix Multiplication Background guide, on the V100's 80 SMs; element-wise
traffic counted from the layer's code, at 750 of 900 GB/s (Jia et al. 2018, V100
microbenchmarks); collectives by NCCL's own tuning model (src/graph/tuning.cc:
latencies by protocol and ring steps) at 82% of NVLink's line rate (NCCL's
maintainer, nccl-tests issue 212). 'matmul eff': the share of the full-wave
speed the step's matmuls reach (their wave efficiency, FLOP-weighted). Left
out: cuBLAS's choice of smaller tiles or split-K for some shapes, overlap of
the all-reduces (the 2019 code ran them serially, as the projection does), and
the 2019 code's own kernels (its unfused dropout and GeLU; jmegatron's layer
has neither)."""


def print_megatron(rows: list[dict]) -> None:
    if not rows:
        return
    print("\nMegatron-LM weak scaling (Shoeybi et al. 2019, arXiv:1909.08053, Figure 1), "
          "projected on v100-dgx2h (39 TFLOP/s on one GPU, NVSwitch 150 GB/s per "
          "direction; column '300': 300 GB/s per direction); 'flops only' counts FLOPs "
          "and collectives, 'calibrated' adds the matmuls' shapes and the element-wise "
          "work (jmegatron.analysis.compute_model):")
    print_table(rows, [("variant", "config", ""), ("gpus", "GPUs", "d"),
                       ("params_b", "params B", ".2f"), ("tp_allreduces", "colls", "d"),
                       ("tp_gb", "GB/dev", ".1f"), ("wave", "matmul eff", ".1%"),
                       ("matmul_ms", "matmul ms", ".0f"), ("memory_ms", "elementwise ms", ".0f"),
                       ("comm_ms", "comm ms", ".0f"), ("flops_only", "flops only", ".1%"),
                       ("projected", "calibrated", ".1%"), ("projected_300", "(300)", ".1%"),
                       ("measured", "paper eff", ".0%"),
                       ("state_gb", "params+state GB", ".1f"), ("temp_gb", "temp GB", ".1f")])
    print(MEGATRON_NOTE)


def print_assumptions(hardware: list[str]) -> None:
    from jmegatron.analysis import cost_model as cm
    print("\nAssumptions (see the module docstrings of experiments.project_scale and "
          "jmegatron.analysis.cost_model):")
    print("  measured from the compiled programs: collective bytes, counts and device groups; "
          "params+state and temporary bytes per device; the optimizer step's FLOPs")
    print("  analytic: model FLOPs = GPTConfig.flops_per_token(T) * B * T / devices "
          "(XLA's cost analysis counts a scanned layer once)")
    print("  step ms: compute + every collective, nothing overlapped; (overlap): "
          "max(compute, collectives)")
    for name in hardware:
        print(f"  {name}: {cm.hardware(name).source}")


def selected(args) -> list[str]:
    if args.settings:
        return [setting(n).name for n in args.settings]
    if args.small:
        return ["small/fsdp8", "megatron-1.2b/tp1", "megatron-2.5b/tp2"]
    if args.only_optimizers:   # the comparison: each optimizer setting and its Muon base
        reduced = [s for s in SETTINGS if s.group == "optimizers"]
        return list(dict.fromkeys(name for s in reduced for name in (s.base, s.name)))
    if args.only_pipelines:
        return [s.name for s in SETTINGS if s.group == "pipeline" and (args.slow or not s.slow)]
    return [s.name for s in SETTINGS if (args.slow or not s.slow)
            and (s.group != "megatron" or args.megatron) and s.group != "small"
            and (s.group != "optimizers" or args.optimizers)
            and (s.group != "pipeline" or args.pipelines) and s.group != "dropless"]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", help="setting names (default: all not slow)")
    parser.add_argument("--hardware", nargs="+", default=["h100", "gb300"])
    parser.add_argument("--slow", action="store_true", help="also the opt-in settings")
    parser.add_argument("--no-megatron", dest="megatron", action="store_false",
                        help="skip the Megatron-LM paper check")
    parser.add_argument("--small", action="store_true",
                        help="bench_layouts' small model and two Megatron configs only")
    parser.add_argument("--no-optimizers", dest="optimizers", action="store_false",
                        help=f"skip {', '.join(REDUCED_COMM)} on llama-7b's fsdp 8/32/64")
    parser.add_argument("--only-optimizers", action="store_true",
                        help=f"only {', '.join(REDUCED_COMM)} on llama-7b's fsdp 8/32/64 and "
                        "Muon's llama-7b settings of the same meshes (their comparison table)")
    parser.add_argument("--pipelines", action="store_true",
                        help="also the pipeline settings (llama-70b with and without stages; "
                        "with --slow also its 256-GPU pair and the Kimi K2 mesh)")
    parser.add_argument("--only-pipelines", action="store_true",
                        help="only the pipeline settings (with --slow: all of them)")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    from jmegatron.analysis import cost_model as cm
    for name in args.hardware:
        cm.hardware(name)   # fail on a typo before compiling anything
    rows = measure_in_subprocesses(selected(args))
    scale = [r for r in rows if not r["setting"].startswith("megatron-")]
    add_projections(scale, args.hardware)
    print_model_tables(scale, args.hardware)
    optimizers = optimizer_rows(scale, args.hardware)
    print_optimizer_table(optimizers, args.hardware)
    anchor_rows = anchors(scale)
    if anchor_rows:
        print("\nAnchors: published optimizer-step ratios next to the projection "
              "(different software, models and, for MatrixFSDP, hardware: see the docstring):")
        print_table(anchor_rows, [("variant", "claim", ""), ("published", "published", ""),
                                  ("setting", "setting", ""), ("compare", "projected", ""),
                                  ("slow_ms", "ms", ".1f"), ("fast_ms", "ms", ".1f"),
                                  ("projected", "ratio", ".1f")])
    print_pipeline_table(scale, args.hardware)
    chosen = auto_rows(scale, args.hardware)
    print_auto_table(chosen)
    megatron = megatron_rows(rows)
    print_megatron(megatron)
    print_assumptions(sorted({*args.hardware, "a100", "v100-dgx2h"}))
    results = [{k: v for k, v in r.items() if not k.endswith("_list")} for r in scale]
    results += [{**r, "variant": f"optimizers: {r['optim']} {r['variant']}"}
                for r in optimizers]
    results += [{**r, "variant": "anchor: " + r["variant"]} for r in anchor_rows]
    results += [{**r, "variant": "auto: " + r["auto"]} for r in chosen]
    results += [{**r, "variant": "megatron: " + r["variant"]} for r in megatron]
    write_results("project_scale", results, args.out,
                  argv() if args_list is None else args_list)
    return results


def _cli() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
        return
    try:
        main()
    except ValueError as e:   # a bad name: one line, no traceback
        sys.exit(f"project_scale: {e}")


if __name__ == "__main__":
    _cli()
