"""Training throughput per model and optimizer on one device: step time, tokens/s,
model and optimizer TFLOP/s, MFU and peak memory, side by side.

    python -m experiments.bench_train_speed [--small] [--models M,...] [--rows R,...]
        [--steps N] [--batch B] [--seq-len T] [--out PATH]

Models are presets (``experiments.presets``): gpt2-small, dense-1b and
qwen3-moe-small by default, in bf16 compute with fp32 masters. Rows:

  adamw           AdamW on every parameter;
  muon            Muon, standard Newton-Schulz (the default, 5 quintic steps);
  muon-gram       Muon with Gram Newton-Schulz where it saves FLOPs;
  muon-syrk       Muon with the SYRK kernel for the symmetric products;
  soap            SOAP's regular step (its eigenbases not refreshed in the timed steps);
  soap-refresh    SOAP's refresh step alone (power iteration + QR every step).

Each row compiles one train step (the trainer's own: loss, gradients, clipping,
optimizer, skip on non-finite) on a one-device mesh, runs two steps to warm up,
then times ``--steps`` (default 10) steps on fixed random tokens and reports the
median. Columns: ms per step; tokens/s; model TFLOP/s (``flops_per_token`` x
tokens/s, causal half counted as PaLM does) and its MFU against the bf16 matmul
rate measured on the same device (N^3 with random inputs, N = 8192; 512 with
--small); the optimizer's matmul TFLOP/s (``flops_per_step`` / step time) and
the total MFU (model + optimizer FLOPs, as NVIDIA reports Muon's); Muon's model
throughput relative to AdamW's; peak device memory (where the backend reports
it). ``--profile DIR`` also traces a few steps of each model's Muon row and
prints the ops with the most device time. ``experiments/gpu_train.sh`` runs it
on a GPU; on CPU use ``--small`` (tiny shapes: it shows the script works, not
how fast anything is).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax

from experiments.bench_common import (argv, bf16_matmul_rate, median_ms, print_table,
                                      write_results)
from experiments.presets import PRESETS
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.train import TrainConfig
from jmegatron.train.config import MuonConfig, SoapConfig
from jmegatron.train.planning import resolve_layout
from jmegatron.train.programs import build_programs

MODELS = ("gpt2-small", "dense-1b", "qwen3-moe-small")
ROWS = {
    "adamw": dict(optim="adamw"),
    "muon": dict(optim="muon"),
    "muon-gram": dict(optim="muon", muon=MuonConfig(ns_method="auto")),
    "muon-syrk": dict(optim="muon", muon=MuonConfig(syrk=True)),
    "soap": dict(optim="soap", soap=SoapConfig(precondition_frequency=10 ** 6)),
    "soap-refresh": dict(optim="soap", soap=SoapConfig(precondition_frequency=1)),
}
# --small: every model shrunk to this (a CPU shows the script works, nothing more).
SMALL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=512)


def run_config(model: str, row: str, small: bool, batch: int, seq_len: int) -> TrainConfig:
    """The preset ``model`` with the row's optimizer, one device, bf16 compute."""
    cfg = PRESETS[model]()
    shape = SMALL if small else {}
    moe = (dataclasses.replace(cfg.model.moe, d_ff=32) if small and cfg.model.moe.n_experts
           else cfg.model.moe)
    model_cfg = dataclasses.replace(cfg.model, dtype="bfloat16", moe=moe, **shape)
    return dataclasses.replace(cfg, model=model_cfg, mesh=MeshConfig(1, 1, 1, 1),
                               batch_size=batch, seq_len=seq_len, microbatches=1, **ROWS[row])


def build_step(cfg: TrainConfig):
    """(the jitted train step, its first state, fixed random tokens, the model config,
    the optimizer) of ``cfg`` on one device, as the trainer builds them."""
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    layout, model_cfg, _ = resolve_layout(cfg, cfg.mesh)   # as the trainer resolves it
    programs = build_programs(cfg, model_cfg, mesh, layout)   # as the trainer builds them
    step, state, optimizer = programs.train_step, programs.init(), programs.optimizer
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch_size, cfg.seq_len + 1), 0,
                                model_cfg.vocab_size)
    return step, state, tokens, model_cfg, optimizer


def measure(cfg: TrainConfig, steps: int, trace: str | None = None) -> dict:
    """Median step time of ``cfg``'s train step, its FLOPs and peak memory; with
    ``trace`` (a folder), also the ops that took the most device time in 3 more
    steps of the same compiled step (``top_ops``)."""
    step, state, tokens, model_cfg, optimizer = build_step(cfg)
    box = [state]

    def one_step(tokens):
        box[0], metrics = step(box[0], tokens)   # the state is donated: carry it on
        return metrics["loss"]

    seconds = median_ms(one_step, [tokens], steps, warmup=2) / 1e3
    stats = jax.devices()[0].memory_stats() or {}
    ops = None
    if trace:
        with jax.profiler.trace(trace):
            jax.block_until_ready([one_step(tokens) for _ in range(3)])
        ops = top_ops(trace, 3, 15)
    return {"ms": 1e3 * seconds, "params": model_cfg.param_count(),
            "model_flops": model_cfg.flops_per_token(cfg.seq_len) * cfg.batch_size * cfg.seq_len,
            "optimizer_flops": optimizer.flops_per_step, "top_ops": ops,
            "peak_gib": stats["peak_bytes_in_use"] / 2 ** 30
            if "peak_bytes_in_use" in stats else None}


def top_ops(folder: str, steps: int, top: int) -> list[dict]:
    """Per op name, its time per step summed over the newest trace in ``folder``: the
    GPU's "XLA Ops" lines, or on CPU the ops XLA's threads ran (their executor and
    loop events left out, which contain the others)."""
    trace = max(Path(folder).rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    data = jax.profiler.ProfileData.from_file(str(trace))
    gpu = [line for p in data.planes if p.name.startswith("/device:GPU")
           for line in p.lines if line.name == "XLA Ops"]
    cpu = [line for p in data.planes if p.name == "/host:CPU"
           for line in p.lines if line.name.startswith("tf_XLA")]
    totals: dict[str, float] = {}
    for line in gpu or cpu:
        for event in line.events:
            if not event.name.startswith(("ThunkExecutor", "while")):
                totals[event.name] = totals.get(event.name, 0) + event.duration_ns
    everything = sum(totals.values()) or 1
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:top]
    return [{"op": name[:70], "ms_per_step": ns / steps / 1e6, "share": ns / everything}
            for name, ns in ranked]


def table(model: str, rows: list[str], args, rate: float, failed: list[str]) -> list[dict]:
    """The rows of ``model`` that ran; each that failed is printed and added to ``failed``."""
    out = []
    profiled = "muon" if "muon" in rows else rows[0]
    for row in rows:
        cfg = run_config(model, row, args.small, args.batch, args.seq_len)
        trace = f"{args.profile}/{model}-{row}" if args.profile and row == profiled else None
        try:
            m = measure(cfg, args.steps, trace)
        except Exception as err:   # one row failing (a kernel, memory) leaves the others
            failed.append(f"{model} {row}: failed: {type(err).__name__}: "
                          f"{str(err).splitlines()[0]}")
            print(failed[-1])
            continue
        seconds = m["ms"] / 1e3
        model_rate, opt_rate = m["model_flops"] / seconds, m["optimizer_flops"] / seconds
        out.append({"model": model, "variant": row, "ms": m["ms"],
                    "tokens_per_s": cfg.batch_size * cfg.seq_len / seconds,
                    "model_tflops": model_rate / 1e12, "mfu": model_rate / rate,
                    "optimizer_tflops": opt_rate / 1e12,
                    "total_mfu": (model_rate + opt_rate) / rate, "peak_gib": m["peak_gib"],
                    "params_m": m["params"] / 1e6, "matmul_tflops": rate / 1e12,
                    "top_ops": m["top_ops"]})
    adamw = next((r for r in out if r["variant"] == "adamw"), None)
    for r in out:
        r["model_tflops_vs_adamw"] = r["model_tflops"] / adamw["model_tflops"] if adamw else None
    return out


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU, a few minutes)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of presets")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {tuple(ROWS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (median)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences per step (default 8; 2 with --small)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default 2048; 64 with --small)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="also trace 3 steps of each model's muon row (or its first) into "
                             "DIR and print the ops that took the most device time")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    cli = parser()
    args = cli.parse_args(args_list)
    models, rows = args.models.split(","), args.rows.split(",")
    if unknown := [m for m in models if m not in PRESETS]:
        cli.error(f"unknown models {unknown}; presets: {sorted(PRESETS)}")
    if unknown := [r for r in rows if r not in ROWS]:
        cli.error(f"unknown rows {unknown}; choose from {tuple(ROWS)}")
    if args.steps < 1:
        cli.error(f"--steps {args.steps}: must be >= 1")
    args.batch = args.batch or (2 if args.small else 8)
    args.seq_len = args.seq_len or (64 if args.small else 2048)
    rate = bf16_matmul_rate(512 if args.small else 8192)
    print(f"{jax.devices()[0].device_kind}: bf16 matmul {rate / 1e12:.1f} TFLOP/s; batch "
          f"{args.batch} x {args.seq_len} tokens, median of {args.steps} steps")
    results, failed = [], []
    for model in models:
        part = table(model, rows, args, rate, failed)
        if not part:
            continue
        print(f"\n{model} ({part[0]['params_m']:,.1f}M params)")
        print_table(part, [("variant", "optimizer", ""), ("ms", "ms/step", ".1f"),
                           ("tokens_per_s", "tok/s", ",.0f"),
                           ("model_tflops", "model TFLOP/s", ".1f"), ("mfu", "MFU", ".1%"),
                           ("optimizer_tflops", "opt TFLOP/s", ".2f"),
                           ("total_mfu", "total MFU", ".1%"),
                           ("model_tflops_vs_adamw", "model vs AdamW", ".3f"),
                           ("peak_gib", "peak GiB", ".1f")])
        results += part
        for r in part:
            if r["top_ops"] is not None:
                print(f"\n{model} {r['variant']}: the ops with the most device time"
                      f"{'' if r['top_ops'] else ': none found in the trace'}")
                if r["top_ops"]:
                    print_table(r["top_ops"], [("op", "op", ""),
                                               ("ms_per_step", "ms/step", ".2f"),
                                               ("share", "share", ".1%")])
    write_results("bench_train_speed", results, args.out,
                  argv() if args_list is None else args_list)
    if failed:   # after the rows that ran are written: exit 1, naming what failed
        raise SystemExit(f"{len(failed)} of {len(models) * len(rows)} rows failed: "
                         + "; ".join(failed))
    return results


if __name__ == "__main__":
    main()
