"""What reporting the largest attention logit costs, and the fused kernel against the
einsum path: `python -m experiments.bench_attention [--gpu] [--dtype D] [--small]`.

Times forward + backward of the model's two attention paths, which both return
each head's largest pre-softmax logit (QK-clip's S): ``causal_attention`` (the
einsums, [B, N, T, T] logits formed; ``--model.attention einsum``) and
``flash_attention`` (``jax.nn.dot_product_attention`` plus a blockwise pass for
S; ``--model.attention flash``), against ``jax.nn.dot_product_attention`` alone
(no logits out: cuDNN's fused kernel on GPU, XLA's elsewhere), on one device.
Shapes: the widths of the ``tiny`` and ``bench`` presets and a longer sequence;
with ``--gpu``, the dense-1b preset's heads at T = 2048 and 4096. FLOPs and
bytes come from XLA's cost analysis (a fused custom call counts none).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.models.attention import causal_attention, flash_attention

# (name, B, T, N, K, H): the widths of the tiny and bench presets, and a longer sequence.
SHAPES = [("tiny", 8, 128, 4, 2, 32), ("bench", 8, 256, 8, 4, 32),
          ("long", 2, 1024, 8, 4, 64)]
# --gpu: the dense-1b preset's attention (N 16, K 8, H 128) at its sequence and twice it.
GPU_SHAPES = [("dense-1b", 8, 2048, 16, 8, 128), ("dense-1b T4096", 4, 4096, 16, 8, 128)]


def programs(b, t, n, k, h, dtype=jnp.float32):
    """(inputs, {variant: jitted value-and-grad of the summed output})."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kv = [jax.random.normal(key, (b, t, k, h), dtype) for key in keys[1:]]

    def reference(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32).sum()

    def ours(attention):
        def summed(q, k, v):
            y, peak = attention(q, k, v)
            return y.astype(jnp.float32).sum(), peak
        return jax.jit(jax.value_and_grad(summed, (0, 1, 2), has_aux=True))

    return (q, *kv), {
        "jax.nn.dot_product_attention": jax.jit(jax.value_and_grad(reference, (0, 1, 2))),
        "causal_attention (+ max logit)": ours(causal_attention),
        "flash_attention (+ max logit)": ours(flash_attention)}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gpu", action="store_true",
                        help="the dense-1b preset's attention at T 2048 and 4096")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--small", action="store_true",
                        help="the tiny preset's shape only, 2 repeats (shows the script runs)")
    parser.add_argument("--out", help="JSON path (default bench_results/bench_attention.json)")
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    rows = []
    shapes = GPU_SHAPES if args.gpu else SHAPES[:1] if args.small else SHAPES
    repeats = 2 if args.small else args.repeats
    for name, *shape in shapes:
        inputs, variants = programs(*shape, dtype=jnp.dtype(args.dtype))
        base = None
        for variant, fn in variants.items():
            try:
                cost = fn.lower(*inputs).compile().cost_analysis()
                seconds = best_time(lambda: fn(*inputs), repeats)
            except Exception as err:   # e.g. no fused kernel for this shape: the rest run
                print(f"{name} {variant}: failed: {type(err).__name__}: "
                      f"{str(err).splitlines()[0][:200]}")
                continue
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
