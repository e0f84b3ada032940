"""Mixture of experts side by side: dispatch modes, and Muon on expert weights.

    python -m experiments.bench_moe [--small] [--out PATH]

1. One MoE layer's forward + backward (E = 16 experts, top-2, D = 256,
   F = 512, 4096 tokens; E = 8, D = 128, F = 256, 2048 tokens with --small)
   on one device and with the experts split over 8 devices (expert = 8):
   dropless (sort by expert, grouped matmul, padded all-to-all) against
   capacity dispatch with capacity factors 1.0, 1.25 and 2.0. Columns: step
   time and its ratio to dropless on the same mesh, all-to-all bytes per
   device (read from the compiled HLO), rows the experts compute per
   device, and the share of assignments dropped.
2. Muon's update of the stacked expert weights [L=2, E, ...] on 8 devices:
   experts split over `expert` (each device orthogonalizes E/8 experts, no
   collective) against experts replicated (every device orthogonalizes all
   E). Columns: time, ratio, collectives, Newton-Schulz FLOPs per device.

On CPU, ``jax.lax.ragged_dot`` runs as a dense matmul per group over all
rows (masked), so dropless pays about E/P times the expert FLOPs there; GPU
and TPU have grouped-matmul kernels. Eight virtual CPU devices share the
host's cores: read ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPTConfig, MoE, MoEConfig, create_sharded, state_shardings
from jmegatron.models.dispatch import capacity_slots
from jmegatron.optim import PlanSpec, muon_flops, scale_by_muon
from jmegatron.sharding import (DEFAULT_RULES, MeshConfig, activation_sharding, logical_to_spec,
                                make_mesh, with_rules)

DISPATCHES = (("dropless", None), ("capacity", 1.0), ("capacity", 1.25), ("capacity", 2.0))


def model_config(small: bool) -> GPTConfig:
    d, f, e = (128, 256, 8) if small else (256, 512, 16)
    return GPTConfig(d_model=d, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=f,
                     moe=MoEConfig(n_experts=e, top_k=2, d_ff=f))


def layer_row(cfg: GPTConfig, dispatch: str, factor: float | None, mesh, params,
              x: jax.Array) -> dict:
    moe = dataclasses.replace(cfg.moe, dispatch=dispatch, capacity_factor=factor or 1.0)
    cfg = dataclasses.replace(cfg, moe=moe)
    graphdef = nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(0))))[0]
    params = jax.device_put(params, state_shardings(params, mesh))
    x = jax.device_put(x, NamedSharding(mesh, logical_to_spec(("batch", "seq", "act_embed"),
                                                              DEFAULT_RULES)))

    def loss(params, x):
        with activation_sharding(mesh):
            y, stats = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * y) + stats["aux_loss"], stats["dropped"]

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    report = hlo_collectives(step, params, x)
    (_, dropped), _ = step(params, x)
    ep = mesh.shape["expert"]
    e_loc, tokens = moe.n_experts // ep, x.shape[0] * x.shape[1] // mesh.size
    if dispatch == "dropless":   # padded worst case per rank, or every routed row on one device
        rows = ep * tokens * min(moe.top_k, e_loc) if ep > 1 else tokens * moe.top_k
    else:
        rows = e_loc * ep * capacity_slots(tokens, moe.top_k, moe.n_experts, moe.capacity_factor)
    return {"variant": f"expert={ep} {dispatch}" + (f" cf={factor}" if factor else ""),
            "mesh_expert": ep, "step_ms": 1e3 * best_time(lambda: step(params, x), 3),
            "all_to_all_bytes_per_device": report.bytes_per_device("all-to-all"),
            "expert_rows_per_device": rows, "dropped_share": float(dropped)}


def muon_row(name: str, mesh, experts, rules) -> dict:
    experts = jax.device_put(experts, state_shardings(experts, mesh, rules))
    tx = scale_by_muon(plan=PlanSpec(mesh=mesh, rules=rules))
    state = tx.init(experts)
    update = jax.jit(lambda g, s: tx.update(g, s)[0])
    report = hlo_collectives(update, experts, state)
    split = mesh.shape["expert"] if dict(rules)["experts"] else 1
    return {"variant": name, "opt_step_ms": 1e3 * best_time(lambda: update(experts, state), 3),
            "collectives": report.count(), "bytes_per_device": report.bytes_per_device(),
            "ns_flops_per_device": muon_flops(experts) / split}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="E = 8, D = 128 (about a minute)")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    jax.config.update("jax_num_cpu_devices", 8)
    cfg = model_config(args.small)
    tokens = 2048 if args.small else 4096
    x = jax.random.normal(jax.random.key(0), (8, tokens // 8, cfg.d_model))
    model = create_sharded(lambda: MoE(cfg, nnx.Rngs(0)), None)
    params = nnx.split(model)[1]
    meshes = {1: make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]),
              8: make_mesh(MeshConfig(fsdp=1, expert=8))}
    layer_rows = [layer_row(cfg, d, f, meshes[ep], params, x) for ep in (1, 8)
                  for d, f in DISPATCHES]
    for r in layer_rows:
        base = next(b for b in layer_rows if b["mesh_expert"] == r["mesh_expert"])
        r["ratio_vs_dropless"] = r["step_ms"] / base["step_ms"]
    print(f"MoE layer forward + backward: E={cfg.moe.n_experts}, top-{cfg.moe.top_k}, "
          f"D={cfg.d_model}, F={cfg.moe.d_ff}, {tokens} tokens")
    print_table(layer_rows, [("variant", "dispatch", ""), ("step_ms", "step ms", ".1f"),
                             ("ratio_vs_dropless", "vs dropless", ".2f"),
                             ("all_to_all_bytes_per_device", "all-to-all bytes/dev", ",.0f"),
                             ("expert_rows_per_device", "expert rows/dev", ",d"),
                             ("dropped_share", "dropped", ".3f")])

    def stacked(key, shape, axes):
        return nnx.Param(jax.random.normal(jax.random.key(key), shape), out_sharding=axes,
                         eager_sharding=False)
    e, d, f = cfg.moe.n_experts, cfg.d_model, cfg.moe.d_ff
    experts = {"gate_up": stacked(0, (2, e, d, 2, f), ("layers", "experts", "embed", "glu", "mlp")),
               "down": stacked(1, (2, e, f, d), ("layers", "experts", "mlp", "embed"))}
    replicated = with_rules(DEFAULT_RULES, experts=None)
    muon_rows = [muon_row("muon, experts split over expert=8", meshes[8], experts, DEFAULT_RULES),
                 muon_row("muon, experts replicated on 8", meshes[8], experts, replicated)]
    for r in muon_rows:
        r["ratio_vs_replicated"] = r["opt_step_ms"] / muon_rows[1]["opt_step_ms"]
    print(f"\nMuon on stacked expert weights [2, {e}, ...] (gate, up, down of each expert)")
    print_table(muon_rows, [("variant", "layout", ""), ("opt_step_ms", "step ms", ".1f"),
                            ("ratio_vs_replicated", "vs replicated", ".2f"),
                            ("collectives", "collectives", "d"),
                            ("ns_flops_per_device", "NS FLOPs/dev", ",.0f")])
    rows = layer_rows + muon_rows
    write_results("bench_moe", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
