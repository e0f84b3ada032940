"""Optimizer layouts side by side (the MatrixFSDP table).

    python -m experiments.bench_layouts [--small] [--layers L] [--experts E [--expert P]]
                                        [--optim muon soap adamw] [--out PATH]

On 8 devices (fsdp = 8), a GPT of 8 layers (or L: 12 puts owner's padding
to the test) with D = 512 (D = 256 with --small), every MLP a mixture of E
experts with --experts (split over P expert ranks, fsdp = 8 / P), and Muon
(or each --optim given) for its hidden matrices, for each layout: the optimizer
step's time and collective bytes per device (read from the compiled HLO),
the full train step's time, forward + backward collective bytes per device,
the bytes of params + optimizer state one device holds, and the train step's
peak temporary bytes per device (XLA's memory analysis). Ratios are
against `fsdp` (stock FSDP-Muon: gather each whole matrix, orthogonalize
everything on every rank) with the same optimizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.models import GPT, GPTConfig, MoEConfig
from jmegatron.optim import make_plan, trainable_params
from jmegatron.optim.owners import tail_owner_bytes
from jmegatron.sharding import MeshConfig, hlo_collectives, make_mesh
from jmegatron.sharding.layouts import LAYOUTS, make_layout
from jmegatron.train import ScheduleConfig, TrainConfig, create_train_state
from jmegatron.train.optimizer import MATRIX_OPTIMIZERS, make_optimizer
from jmegatron.train.step import make_loss_fn, make_train_step


def model_config(small: bool, layers: int = 8, experts: int = 0) -> GPTConfig:
    d = 256 if small else 512
    return GPTConfig(vocab_size=259, d_model=d, n_layers=layers, n_heads=8, n_kv_heads=8,
                     d_ff=3 * d, moe=MoEConfig(n_experts=experts, d_ff=d)).pad_vocab(1)


def measure(variant: str, mesh, model: GPTConfig, tokens, optim: str = "muon") -> dict:
    layout_name, _, assignment = variant.partition("/")   # "layerwise/balanced"
    assignment = assignment or "round_robin"
    layout = make_layout(layout_name, mesh.shape, assignment=assignment)
    cfg = dataclasses.replace(model, layer_group=layout.layer_group)
    train = TrainConfig(steps=10, grad_clip=0.0, schedule=ScheduleConfig(warmup_steps=0),
                        optim=optim)
    make_model = lambda: GPT(cfg, nnx.Rngs(0))
    optimizer = make_optimizer(train, nnx.split(nnx.eval_shape(make_model))[1], mesh, layout)
    graphdef, state = create_train_state(make_model, optimizer.tx, optimizer.plan)
    loss_fn = make_loss_fn(graphdef, cfg, mesh, layout.rules)
    params = trainable_params(state.params)   # what the optimizer gets
    grads = jax.jit(jax.grad(lambda p, rest, t: loss_fn(nnx.merge_state(rest, p), t)[0]))(
        params, state.params, tokens)

    def opt_step(params, grads, opt_state):
        updates, opt_state = optimizer.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_jit = jax.jit(opt_step)
    # Time a regular step: SOAP's first step only builds its eigenbases (eigh).
    opt_state = opt_jit(params, grads, state.opt_state)[1]
    fwd_bwd = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(p, t)[0]))
    train_step = make_train_step(loss_fn, optimizer, 1, mesh, layout.rules)
    opt_report = hlo_collectives(opt_jit, params, grads, state.opt_state)
    fb_report = hlo_collectives(fwd_bwd, state.params, tokens)
    held = sum(x.addressable_shards[0].data.nbytes
               for x in jax.tree.leaves((state.params, state.opt_state)))
    row = {"optim": optim, "variant": variant,
           "opt_gflop": optimizer.flops_per_step / 1e9,
           "opt_step_ms": 1e3 * best_time(lambda: opt_jit(params, grads, opt_state), 2),
           "opt_collectives": opt_report.count(),
           "opt_bytes_per_device": opt_report.bytes_per_device(),
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


def main(args_list: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="D = 256 (about a minute)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=0, help="MoE MLPs of E experts")
    parser.add_argument("--expert", type=int, default=1, help="expert-parallel ranks P")
    parser.add_argument("--optim", nargs="+", default=["muon"],
                        choices=[*MATRIX_OPTIMIZERS, "adamw"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(args_list)
    jax.config.update("jax_num_cpu_devices", 8)
    mesh = make_mesh(MeshConfig(fsdp=8 // args.expert, expert=args.expert))
    model = model_config(args.small, args.layers, args.experts)
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(0), (8, 129), 0, model.vocab_size),
        jax.NamedSharding(mesh, jax.P(("data", "fsdp", "expert"))))
    # Where the owners do not divide the layers, the balanced layerwise assignment too.
    variants = LAYOUTS + (("layerwise/balanced",) if args.layers % 8 else ())
    rows = [measure(name, mesh, model, tokens, optim) for optim in args.optim for name in variants]
    for r in rows:
        same = {x["variant"]: x for x in rows if x["optim"] == r["optim"]}
        r["opt_step_speedup_vs_fsdp"] = same["fsdp"]["opt_step_ms"] / r["opt_step_ms"]
        r["train_step_speedup_vs_fsdp"] = same["fsdp"]["train_step_ms"] / r["train_step_ms"]
        r["opt_step_vs_replicated_over_8"] = r["opt_step_ms"] / (
            same["replicated"]["opt_step_ms"] / 8)
    moe = f", {args.experts} experts of F={model.moe.d_ff}" if args.experts else ""
    print(f"model: {model.n_layers} layers, D={model.d_model}, F={model.d_ff}{moe}, "
          f"{model.param_count() / 1e6:.1f}M params; mesh {MeshConfig(**mesh.shape)}")
    print_table(rows, [("optim", "optimizer", ""), ("variant", "layout", ""),
                       ("opt_gflop", "opt GFLOP", ".2f"), ("opt_step_ms", "opt step ms", ".0f"),
                       ("opt_step_speedup_vs_fsdp", "vs fsdp", ".1f"),
                       ("opt_step_vs_replicated_over_8", "vs repl/8", ".2f"),
                       ("opt_collectives", "opt colls", "d"),
                       ("opt_bytes_per_device", "opt bytes/dev", ",.0f"),
                       ("train_step_ms", "train step ms", ".0f"),
                       ("train_step_speedup_vs_fsdp", "vs fsdp", ".2f"),
                       ("fwd_bwd_bytes_per_device", "fwd+bwd bytes/dev", ",.0f"),
                       ("state_bytes_per_device", "params+state/dev", ",.0f"),
                       ("train_temp_bytes_per_device", "train temp/dev", ",.0f")])
    print_tail_owners(model, mesh)
    write_results("bench_layouts", rows, args.out, argv() if args_list is None else args_list)
    return rows


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
