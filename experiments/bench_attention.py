"""What reporting the largest attention logit costs: `python -m experiments.bench_attention`.

Times forward + backward of the model's ``causal_attention`` (which also returns
each head's largest pre-softmax logit, QK-clip's S) against
``jax.nn.dot_product_attention`` (XLA's, no logits out) on one device, at the
shapes of the ``tiny`` and ``bench`` presets and a longer sequence, and counts
both programs' FLOPs and bytes from XLA's cost analysis.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.models.layers import causal_attention

# (name, B, T, N, K, H): the widths of the tiny and bench presets, and a longer sequence.
SHAPES = [("tiny", 8, 128, 4, 2, 32), ("bench", 8, 256, 8, 4, 32),
          ("long", 2, 1024, 8, 4, 64)]


def programs(b, t, n, k, h):
    """(inputs, {variant: jitted value-and-grad of the summed output})."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, h))
    kv = [jax.random.normal(key, (b, t, k, h)) for key in keys[1:]]

    def reference(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).sum()

    def ours(q, k, v):
        y, peak = causal_attention(q, k, v)
        return y.sum(), peak

    return (q, *kv), {
        "jax.nn.dot_product_attention": jax.jit(jax.value_and_grad(reference, (0, 1, 2))),
        "causal_attention (+ max logit)": jax.jit(
            jax.value_and_grad(ours, (0, 1, 2), has_aux=True))}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="JSON path (default bench_results/bench_attention.json)")
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    rows = []
    for name, *shape in SHAPES:
        inputs, variants = programs(*shape)
        base = None
        for variant, fn in variants.items():
            cost = fn.lower(*inputs).compile().cost_analysis()
            seconds = best_time(lambda: fn(*inputs), args.repeats)
            base = base or seconds
            rows.append({"shape": f"{name} B{shape[0]} T{shape[1]} N{shape[2]}/K{shape[3]}",
                         "variant": variant, "ms": seconds * 1e3, "vs_xla": seconds / base,
                         "gflop": cost.get("flops", 0) / 1e9,
                         "mb": cost.get("bytes accessed", 0) / 1e6})
    print_table(rows, [("shape", "shape", "s"), ("variant", "variant", "s"),
                       ("ms", "fwd+bwd ms", ".2f"), ("vs_xla", "time vs XLA's", ".2f"),
                       ("gflop", "GFLOP", ".3f"), ("mb", "MB accessed", ".1f")])
    write_results("bench_attention", rows, args.out, argv() if args_list is None else args_list)
    return rows


if __name__ == "__main__":
    main()
