"""Optimizer layouts side by side (the MatrixFSDP table).

    python -m experiments.bench_layouts [--small] [--layers L] [--experts E [--expert P]]
                                        [--data D]
                                        [--optim muon soap adamw] [--keep-gathered]
                                        [--dtype bfloat16 [--grad-reduce-dtype float32]]
                                        [--out PATH]

On 8 devices (fsdp = 8), a GPT of 8 layers (or L: 12 puts owner's padding
to the test) with D = 512 (D = 256 with --small), every MLP a mixture of E
experts with --experts (split over P expert ranks, fsdp = 8 / P), and Muon
(or each --optim given) for its hidden matrices, for each layout: the optimizer
step's time and collective bytes per device (read from the compiled HLO),
the full train step's time, forward + backward collective bytes per device,
the bytes of params + optimizer state one device holds, and the train step's
peak temporary bytes per device (XLA's memory analysis). Ratios are
against `fsdp` (stock FSDP-Muon: gather each whole matrix, orthogonalize
everything on every rank) with the same optimizer, and for Muon against the
`optax` row: `optax.contrib.muon` on the same params placed as `fsdp` places
them, with dimension numbers from jmegatron's routing, where XLA partitions
Newton-Schulz itself (what a user of optax would run; see ``optax_muon``).
MuonBP (--optim muon_bp) alternates P - 1 block steps with one full step in one
program: its step time is P consecutive steps over P, its bytes the full branch's
over P (``hlo.periodic_bytes_per_device``), its collective count both branches'.
With --dtype bfloat16 the model computes in bf16 (the bytes count bf16 buffers at
2 bytes, as an accelerator sends them: ``hlo.Collective.widened``), and with
--grad-reduce-dtype float32 sums its weight gradients in fp32
(``GPTConfig.grad_reduce_dtype``).
With --data D (fsdp = 8 / D), a row `owner/data+fsdp`: owner with one group over
data x fsdp (``--owner-group data+fsdp``) beside `owner`'s group over fsdp.
With --keep-gathered, a row `owner+kept`: owner with ``GPTConfig.keep_gathered``
(the backward keeps each group's gathered weights, FSDP's
reshard_after_forward=False).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.analysis import hlo_collectives
from jmegatron.analysis.hlo import periodic_bytes_per_device
from jmegatron.models import GPT, GPTConfig, MoEConfig
from jmegatron.optim import ShardingPlan, make_plan, trainable_params
from jmegatron.optim.coefficients import coefficient_set
from jmegatron.optim.muon import MOONLIGHT_RMS
from jmegatron.optim.owners import tail_owner_bytes
from jmegatron.optim.routing import MatrixSpec
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import LAYOUTS, make_layout
from jmegatron.train import ScheduleConfig, TrainConfig
from jmegatron.train.optimizer import MATRIX_OPTIMIZERS, Optimizer, make_schedule
from jmegatron.train.programs import build_programs
from jmegatron.train.registry import OPTIMIZERS

OPTAX = "optax"   # the row of optax.contrib.muon on fsdp-placed params
KEPT = "owner+kept"   # owner with GPTConfig.keep_gathered (--keep-gathered)


def model_config(small: bool, layers: int = 8, experts: int = 0) -> GPTConfig:
    d = 256 if small else 512
    return GPTConfig(vocab_size=259, d_model=d, n_layers=layers, n_heads=8, n_kv_heads=8,
                     d_ff=3 * d, moe=MoEConfig(n_experts=experts, d_ff=d)).pad_vocab(1)


def optax_dimension_numbers(plan: ShardingPlan):
    """``optax.contrib.muon``'s ``muon_weight_dimension_numbers`` read from the plan's
    routes: a MuonDimensionNumbers for every matrix leaf, None (its AdamW) for
    every other; a tree shaped like the trained params (a prefix: one entry per
    variable)."""
    plan = plan.for_optimizer()
    return plan.join(_dimension_numbers(leaf.path, leaf.route.spec) if leaf.is_matrix
                     else None for leaf in plan.leaves)


def _dimension_numbers(path: str, spec: MatrixSpec) -> optax.contrib.MuonDimensionNumbers:
    """The spec's fan-in (reduction) and fan-out (output) axes; the rest are batch
    axes, as in jmegatron. A split into blocks of size 1 along ``split_axis``
    (Q, K, V with as many query as kv heads; gate, up) is that axis made a batch
    axis; other splits (grouped-query Q of several heads per kv head) optax
    cannot express: one leaf is one batch of equal matrices there."""
    in_axes, out_axes = spec.in_axes, spec.out_axes
    if spec.split_axis is not None:
        if set(spec.split_sizes) != {1}:
            raise ValueError(f"{path}: blocks {dict(zip(spec.split_names, spec.split_sizes))} "
                             f"along axis {spec.split_axis} are not equal; optax.contrib.muon "
                             "orthogonalizes one leaf as a batch of equal matrices (use "
                             "n_kv_heads = n_heads, or split_qkv=False on both sides)")
        in_axes = tuple(a for a in in_axes if a != spec.split_axis)
        out_axes = tuple(a for a in out_axes if a != spec.split_axis)
    return optax.contrib.MuonDimensionNumbers(in_axes, out_axes)


def optax_muon(train: TrainConfig, optimizer: Optimizer) -> Optimizer:
    """``optimizer`` (jmegatron's Muon of ``train``) with its transformation
    replaced by ``optax.contrib.muon`` with the same settings where optax has
    them: coefficients and steps, momentum (Nesterov EMA), spectral x rms_factor
    scale (optax's ``consistent_rms``) or the shape scale, decoupled weight decay
    of the matrices, AdamW's b1, b2, eps, learning rate and weight decay for the
    other leaves. Where they differ by construction: optax bias-corrects Muon's
    momentum (equal on the first step), its AdamW is Nesterov (optax ties it to
    Muon's flag) and decays norm scales too (no mask), and it adds eps to the
    Frobenius norm where jmegatron first divides by the largest entry. The plan
    stays (the fsdp layout's), so params and state are placed alike."""
    missing = _missing_in_optax(train)
    if missing:
        raise ValueError(f"optax.contrib.muon has no {', '.join(missing)}")
    a, m = train.adamw, train.muon
    cset = coefficient_set(m.ns_coefficients)
    schedule = cset.schedule(cset.default_steps if m.ns_steps is None else m.ns_steps)
    rms = ((MOONLIGHT_RMS if m.rms_factor is None else m.rms_factor) if m.scale == "spectral"
           else None)   # None: optax's width scale sqrt(max(1, fan_out / fan_in)), "shape"
    adam_lr = optimizer.schedule if a.lr is None else make_schedule(train.schedule, a.lr,
                                                                       train.steps)
    # One triple for a constant schedule: optax's own form (an unrolled loop, whose
    # FLOPs XLA's cost analysis counts whole), the same matmuls as the per-step form.
    coeffs = schedule[0] if len(set(schedule)) == 1 else tuple(schedule)
    tx = optax.contrib.muon(
        optimizer.schedule, ns_coeffs=tuple(coeffs), ns_steps=len(schedule),
        beta=m.momentum, eps=a.eps, weight_decay=train.weight_decay, nesterov=True,
        adam_b1=a.b1, adam_b2=a.b2, adam_weight_decay=train.weight_decay,
        adam_learning_rate=adam_lr, consistent_rms=rms,
        muon_weight_dimension_numbers=optax_dimension_numbers(optimizer.plan))
    clip = optax.clip_by_global_norm(train.grad_clip) if train.grad_clip > 0 else optax.identity()
    return dataclasses.replace(optimizer, tx=optax.chain(clip, tx),
                               routing_table="optax.contrib.muon\n" + optimizer.routing_table)


def _missing_in_optax(train: TrainConfig) -> list[str]:
    """The Muon settings of ``train`` that optax.contrib.muon cannot express."""
    m = train.muon
    checks = {"AOL normalization": coefficient_set(m.ns_coefficients).normalization != "frobenius",
              f"scale {m.scale!r}": m.scale not in ("spectral", "shape"),
              "shape scale times an rms_factor": m.scale == "shape"
              and m.rms_factor not in (None, 1.0),
              "bf16 Newton-Schulz": m.ns_dtype != "float32",
              f"{train.weight_decay_method} weight decay": train.weight_decay_method != "decoupled"}
    return [name for name, missing in checks.items() if missing]


def measure(variant: str, mesh, model: GPTConfig, tokens, optim: str = "muon") -> dict:
    # "layerwise/balanced": an assignment; "owner/data+fsdp": an owner group.
    layout_name, _, option = variant.partition("/")
    assignment = option if layout_name == "layerwise" and option else "round_robin"
    owner_group = option if layout_name == "owner" and option else "fsdp"
    keep = variant == KEPT
    layout = make_layout("fsdp" if variant == OPTAX else "owner" if keep else layout_name,
                         mesh.shape, assignment=assignment, owner_group=owner_group)
    cfg = dataclasses.replace(model, **layout.stack_fields, keep_gathered=keep)
    train = TrainConfig(steps=10, grad_clip=0.0, schedule=ScheduleConfig(warmup_steps=0),
                        optim=optim)
    programs = build_programs(train, cfg, mesh, layout, swap_optimizer=(
        functools.partial(optax_muon, train) if variant == OPTAX else None))
    optimizer, loss_fn, state = programs.optimizer, programs.loss_fn, programs.init()
    params = trainable_params(state.params)   # what the optimizer gets
    grads = jax.jit(jax.grad(lambda p, rest, t: loss_fn(nnx.merge_state(rest, p), t)[0]))(
        params, state.params, tokens)

    def opt_step(params, grads, opt_state):
        updates, opt_state = optimizer.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_jit = jax.jit(opt_step)
    # Time a regular step: SOAP's first step only builds its eigenbases (eigh).
    opt_state = opt_jit(params, grads, state.opt_state)[1]
    # As the train step does: the gradients of the weights the model computes with
    # (layerwise gathers a bf16 model's masters once, in bf16: ShardingPlan.model_weights).
    fwd_bwd = jax.jit(lambda p, t: jax.value_and_grad(lambda w: loss_fn(w, t)[0])(
        optimizer.plan.model_weights(p)))
    train_step = programs.train_step
    opt_report = hlo_collectives(opt_jit, params, grads, state.opt_state)
    fb_report = hlo_collectives(fwd_bwd, state.params, tokens)
    held = sum(x.addressable_shards[0].data.nbytes
               for x in jax.tree.leaves((state.params, state.opt_state)))
    # MuonBP: P steps (one full, P - 1 block) timed together, bytes averaged over them.
    period = OPTIMIZERS[optim].period(train) if optim in OPTIMIZERS else 1
    opt_text = opt_jit.lower(params, grads, state.opt_state).compile().as_text()

    def period_of_steps():
        state_now = opt_state
        for _ in range(period):
            _, state_now = opt_jit(params, grads, state_now)
        return state_now

    row = {"optim": optim, "variant": variant,
           "opt_gflop": optimizer.flops_per_step / 1e9,
           "opt_step_ms": 1e3 * best_time(period_of_steps, 2) / period,
           "opt_collectives": opt_report.count(),
           "opt_bytes_per_device": periodic_bytes_per_device(opt_text, mesh, period),
           "fwd_bwd_bytes_per_device": fb_report.bytes_per_device()}
    state = jax.tree.map(jnp.copy, state)
    holder = [state]

    def one_train_step():
        holder[0], metrics = train_step(holder[0], tokens)
        return metrics["loss"]

    temp = train_step.lower(holder[0], tokens).compile().memory_analysis().temp_size_in_bytes
    row.update(train_step_ms=1e3 * best_time(one_train_step, 2), state_bytes_per_device=held,
               train_temp_bytes_per_device=temp)
    return row


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="D = 256 (about a minute)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=0, help="MoE MLPs of E experts")
    parser.add_argument("--expert", type=int, default=1, help="expert-parallel ranks P")
    parser.add_argument("--data", type=int, default=1,
                        help="data ranks (fsdp = 8 / (data x P)); above 1, a row "
                             "'owner/data+fsdp': one owner group over both axes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's compute dtype (params stay fp32)")
    parser.add_argument("--grad-reduce-dtype", default="compute", choices=["compute", "float32"],
                        help="the dtype its weight gradients are summed in")
    parser.add_argument("--optim", nargs="+", default=["muon"],
                        choices=[*MATRIX_OPTIMIZERS, "adamw"])
    parser.add_argument("--keep-gathered", action="store_true",
                        help=f"a row {KEPT!r}: owner keeping the gathered groups for the backward")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    jax.config.update("jax_num_cpu_devices", 8)
    mesh = make_mesh(MeshConfig(data=args.data, fsdp=8 // args.expert // args.data,
                                expert=args.expert))
    model = dataclasses.replace(model_config(args.small, args.layers, args.experts),
                                dtype=args.dtype, grad_reduce_dtype=args.grad_reduce_dtype)
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(0), (8, 129), 0, model.vocab_size),
        jax.NamedSharding(mesh, jax.P(("data", "fsdp", "expert"))))
    # Where the owners do not divide the layers, the balanced layerwise assignment too.
    variants = (LAYOUTS + (("layerwise/balanced",) if args.layers % 8 else ())
                + ((KEPT,) if args.keep_gathered else ())
                + (("owner/data+fsdp",) if args.data > 1 else ()))
    # optax.contrib.muon is the baseline of Muon only (optax has no SOAP; AdamW is optax's).
    rows = [measure(name, mesh, model, tokens, optim) for optim in args.optim
            for name in variants + ((OPTAX,) if optim == "muon" else ())]
    add_ratios(rows)
    moe = f", {args.experts} experts of F={model.moe.d_ff}" if args.experts else ""
    print(f"model: {model.n_layers} layers, D={model.d_model}, F={model.d_ff}{moe}, "
          f"{model.param_count() / 1e6:.1f}M params; mesh {MeshConfig(**mesh.shape)}")
    print_table(rows, [("optim", "optimizer", ""), ("variant", "layout", ""),
                       ("opt_gflop", "opt GFLOP", ".2f"), ("opt_step_ms", "opt step ms", ".0f"),
                       ("opt_step_speedup_vs_fsdp", "vs fsdp", ".1f"),
                       ("opt_step_speedup_vs_optax", "vs optax", ".2f"),
                       ("opt_step_vs_replicated_over_8", "vs repl/8", ".2f"),
                       ("opt_collectives", "opt colls", "d"),
                       ("opt_bytes_per_device", "opt bytes/dev", ",.0f"),
                       ("train_step_ms", "train step ms", ".0f"),
                       ("train_step_speedup_vs_fsdp", "vs fsdp", ".2f"),
                       ("train_step_speedup_vs_optax", "vs optax", ".2f"),
                       ("fwd_bwd_bytes_per_device", "fwd+bwd bytes/dev", ",.0f"),
                       ("state_bytes_per_device", "params+state/dev", ",.0f"),
                       ("train_temp_bytes_per_device", "train temp/dev", ",.0f")])
    print_tail_owners(model, mesh)
    write_results("bench_layouts", rows, args.out, argv() if args_list is None else args_list)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Speedups against ``fsdp`` and (Muon rows) ``optax`` of the same optimizer (the
    baseline's time over the row's: above 1 is faster), and the optimizer step
    against a perfect eighth of ``replicated``'s."""
    for r in rows:
        same = {x["variant"]: x for x in rows if x["optim"] == r["optim"]}
        for base in ("fsdp", OPTAX):
            for step in ("opt_step", "train_step"):
                r[f"{step}_speedup_vs_{base}"] = (same[base][f"{step}_ms"] / r[f"{step}_ms"]
                                                  if base in same else None)
        r["opt_step_vs_replicated_over_8"] = r["opt_step_ms"] / (
            same["replicated"]["opt_step_ms"] / 8)


def print_tail_owners(model: GPTConfig, mesh) -> None:
    """The owner layout's non-matrix params (AdamW's: embedding, head, norms)
    element-wise ZeRO-3, as built, against whole on LPT-balanced tail owners."""
    plan = make_plan(nnx.split(nnx.eval_shape(lambda: GPT(model, nnx.Rngs(0))))[1])
    sizes = [4 * math.prod(leaf.shape) for leaf in plan.for_optimizer().leaves
             if not leaf.is_matrix]
    cost = tail_owner_bytes(sizes, mesh.shape["fsdp"])
    print(f"\nnon-matrix params under owner ({len(sizes)} leaves, {sum(sizes):,} bytes; "
          "AdamW, so neither placement communicates in the optimizer step):")
    print_table([{"variant": name, "held": cost[f"{key}_held"],
                  "received": cost[f"{key}_received"]}
                 for name, key in (("element-wise ZeRO-3 (kept)", "zero3"),
                                   ("whole on tail owners (LPT)", "tail"))],
                [("variant", "placement", ""), ("held", "heaviest rank holds", ",.0f"),
                 ("received", "most received for the forward", ",.0f")])


if __name__ == "__main__":
    main()
