"""Attention over a sequence split across a context axis: per-device memory and time of
the `ring` and `all_gather` strategies against one device, alone and in a model's
train step, and the causal balance of the two orders:
`python -m experiments.bench_context [--small]`.

For each sequence length T and context size C, the forward + backward of one attention
call (B 1, N 8 query and K 4 key/value heads of 64: the bench preset's widths) is
compiled on C devices (``jmegatron.models.context``, the sequence dealt zigzag), and
XLA's temporaries per device are read off the compiled program (nothing is allocated,
so long sequences compile here too); up to ``--time-up-to`` tokens it also runs. C = 1
is the model's own ``causal_attention`` on one device. The model table does the same for
the loss and gradients of a small GPT (``MODEL``: 2 layers of those widths, batch 1)
trained on a mesh of C context ranks (``--mesh.context C``, replicated layout):
its temporaries per device times C over one device's say how closely its
activations follow 1/C (1.0: exactly); up to ``--time-up-to`` it runs, and
tokens/s is the step's. The balance table counts the
(query chunk, key chunk) pairs each rank's ring computes: its share of the FLOPs.
On the CPU machine the C devices share 2 cores: times compare strategies, not C.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.models import GPT, GPTConfig, create_sharded
from jmegatron.models.attention import causal_attention
from jmegatron.models.context import (CONTEXT_ATTENTION, ORDERS, pairs_computed,
                                       split_sequence_attention)
from jmegatron.sharding import DEFAULT_RULES, MeshConfig, make_mesh
from jmegatron.sharding.layouts import make_layout
from jmegatron.train import make_loss_fn

B, N, K, H = 1, 8, 4, 64
MODEL = GPTConfig(d_model=N * H, n_layers=2, n_heads=N, n_kv_heads=K, d_ff=3 * N * H)


def strategies(size: int) -> list[str | None]:
    """What runs at context ``size``: one device's attention (None) at 1, else each
    strategy."""
    return [None] if size == 1 else list(CONTEXT_ATTENTION)


def program(strategy: str | None, size: int):
    """(jitted forward + backward of the summed output, its mesh or None)."""
    def summed(attention):
        def loss(q, k, v):
            y, peak = attention(q, k, v)
            return y.astype(jnp.float32).sum(), peak
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))

    if strategy is None:
        return summed(causal_attention), None
    mesh = make_mesh(MeshConfig(context=size, fsdp=1), jax.devices()[:size])
    return summed(split_sequence_attention(strategy, mesh, DEFAULT_RULES, "zigzag")), mesh


def inputs(t: int, mesh):
    keys = jax.random.split(jax.random.key(0), 3)
    arrays = [jax.random.normal(key, (B, t, n, H)) for key, n in zip(keys, (N, K, K))]
    if mesh is None:
        return arrays
    return [jax.device_put(a, NamedSharding(mesh, P(None, "context"))) for a in arrays]


def memory_rows(lengths, sizes, time_up_to: int, repeats: int) -> list[dict]:
    rows = []
    for t in lengths:
        one = None
        for size in sizes:
            for strategy in strategies(size):
                fn, mesh = program(strategy, size)
                args = inputs(t, mesh) if t <= time_up_to else [
                    jax.ShapeDtypeStruct((B, t, n, H), jnp.float32,
                                         sharding=mesh and NamedSharding(mesh, P(None, "context")))
                    for n in (N, K, K)]
                mb = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
                one = one or mb
                ms = best_time(lambda: fn(*args), repeats) * 1e3 if t <= time_up_to else None
                rows.append({"T": t, "C": size, "strategy": strategy or "one device",
                             "mb": mb, "vs_one": mb / one, "ms": ms})
    return rows


def model_program(strategy: str | None, size: int):
    """(jitted loss and gradients of ``MODEL`` on ``size`` context ranks, its params)."""
    mesh = make_mesh(MeshConfig(context=size, fsdp=1), jax.devices()[:size])
    layout = make_layout("replicated", mesh.shape)
    cfg = layout.model_for(dataclasses.replace(MODEL, context_attention=strategy or "ring"),
                           mesh.shape)
    graphdef, params = nnx.split(create_sharded(lambda: GPT(cfg, nnx.Rngs(0)), mesh,
                                                layout.rules))
    return jax.jit(jax.value_and_grad(make_loss_fn(graphdef, cfg, mesh, layout),
                                      has_aux=True)), params


def model_rows(lengths, sizes, time_up_to: int, repeats: int) -> list[dict]:
    rows = []
    for t in lengths:
        one = None
        for size in sizes:
            for strategy in strategies(size):
                step, params = model_program(strategy, size)
                tokens = jax.ShapeDtypeStruct((B, t + 1), jnp.int32)
                mb = step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
                mb /= 2**20
                one = one or mb
                seconds = None
                if t <= time_up_to:
                    batch = jnp.zeros((B, t + 1), jnp.int32)
                    seconds = best_time(lambda: step(params, batch), repeats)
                rows.append({"T": t, "C": size, "strategy": strategy or "one device",
                             "mb": mb, "times_c": mb * size / one,
                             "tok_s": seconds and B * t / seconds})
    return rows


def balance_rows(sizes) -> list[dict]:
    rows = []
    for size in sizes:
        for order in ORDERS:
            work = pairs_computed(size, order)
            rows.append({"C": size, "order": order, "slowest": int(work.max()),
                         "mean": float(work.mean()), "ratio": work.max() / work.mean()})
    return rows


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--lengths", default="4096,16384,65536")
    cli.add_argument("--sizes", default="1,2,4,8")
    cli.add_argument("--time-up-to", type=int, default=4096,
                     help="run (not only compile) sequences up to this length")
    cli.add_argument("--repeats", type=int, default=3)
    cli.add_argument("--small", action="store_true", help="T 256 and 512, C 1 and 2")
    cli.add_argument("--out", help="JSON path (default bench_results/bench_context.json)")
    return cli


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    jax.config.update("jax_num_cpu_devices", 8)   # the CPU machine's context ranks
    lengths, sizes = (("256,512", "1,2") if args.small else (args.lengths, args.sizes))
    lengths, sizes = ([int(a) for a in text.split(",")] for text in (lengths, sizes))
    memory = memory_rows(lengths, sizes, args.time_up_to, 2 if args.small else args.repeats)
    print_table(memory, [("T", "T", "d"), ("C", "C", "d"), ("strategy", "strategy", "s"),
                         ("mb", "temporaries MB/device", ".1f"), ("vs_one", "vs one device",
                                                                  ".3f"),
                         ("ms", "fwd+bwd ms", ".1f")])
    model = model_rows(lengths, sizes, args.time_up_to, 2 if args.small else args.repeats)
    print_table(model, [("T", "T", "d"), ("C", "C", "d"), ("strategy", "strategy", "s"),
                        ("mb", "train step temporaries MB/device", ".1f"),
                        ("times_c", "x C / one device", ".2f"), ("tok_s", "tokens/s", ".0f")])
    balance = balance_rows([s for s in sizes if s > 1] or [2])
    print_table(balance, [("C", "C", "d"), ("order", "order", "s"),
                          ("slowest", "slowest rank's pairs", "d"), ("mean", "mean", ".1f"),
                          ("ratio", "slowest / mean", ".3f")])
    rows = ([{"table": "memory", **r} for r in memory] + [{"table": "model", **r} for r in model]
            + [{"table": "balance", **r} for r in balance])
    write_results("bench_context", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
