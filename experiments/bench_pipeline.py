"""Pipeline schedules side by side: step time, bubble, traffic between stages, memory.

    python -m experiments.bench_pipeline [--small] [--stages 2 4] [--per-stage 1 2 4]
                                         [--schedules gpipe circular 1f1b interleaved-1f1b]
                                         [--repeats 2] [--optim adamw] [--layout fsdp]
                                         [--keep-gathered] [--out PATH]

On 8 devices, a GPT of 8 layers (D = 512; 256 with --small) with AdamW (or
--optim's optimizer; Muon under fsdp orthogonalizes every matrix on every rank,
so its step shrinks with the stages and hides the pipeline's own cost) under
the fsdp layout (or --layout's): the baseline without a pipeline on fsdp 8, then
for each S stages (stage S x fsdp 8/S) and M = k * S microbatches (k of
--per-stage) each schedule (gpipe, 1f1b; circular and interleaved-1f1b with V
chunks a stage for each V of --repeats): the train step's time and its ratio to
the baseline's; the bubble as modelled (``sharding.schedules``: counted on the
schedule's table) and as compiled (from the collective-permutes' trip counts: a
tick sends once if it has forwards and once if it has backwards, 2 V M of the
sends work); the bytes per
device the collective-permutes across ``stage`` move per step, and everything
else that crosses it; the bytes per device of the sums over the batch axes (the
gradients', once a step where ``Layout.pipeline_batch_axes`` names them, else
each microbatch's: they grow with M) and of its all-gathers over them (fsdp's and
owner's weights; with --keep-gathered, a stage's weights are gathered once a step
and their gradients reduce-scattered once: the baseline row keeps the layout's
default); and the train step's temporaries per device (XLA's memory analysis).
An idle stage's tick computes on zeros, so the devices' work together is
1 / (1 - bubble) of the unpipelined step's ("work vs none"; a pipeline's forward
keeps what ``--remat`` keeps, as JAX's backward does); on 8 virtual
devices sharing 2 cores that work adds up and nothing overlaps: read the times
against it, not as a GPU's speed. A second table compiles each schedule with M
microbatches of a fixed size, so the batch grows with M: the temporaries per
device, also in units of one microbatch's activations.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from experiments.bench_common import argv, best_time, print_table, write_results
from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPTConfig
from jmegatron.models.config import REMAT_POLICIES
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import LAYOUTS, make_layout
from jmegatron.sharding.schedules import SCHEDULES, make_schedule
from jmegatron.train import TrainConfig
from jmegatron.train.programs import build_programs
from jmegatron.train.registry import optimizer_names

BATCH, SEQ = 32, 128
MICRO_ROWS = 8   # rows of a microbatch in the memory table (one per fsdp rank at S = 1)


def model_config(small: bool) -> GPTConfig:
    d = 256 if small else 512
    return GPTConfig(vocab_size=259, d_model=d, n_layers=8, n_heads=8, n_kv_heads=8,
                     d_ff=3 * d).pad_vocab(1)


def build(model: GPTConfig, stages: int, microbatches: int, repeats: int, schedule: str,
          optim: str, layout_name: str, batch: int = BATCH):
    """(train step, state, tokens) of ``model`` on stage S x fsdp 8/S (S = 1: no
    pipeline, and ``keep_gathered`` off) under ``schedule`` (circular: ``repeats``
    chunks a stage)."""
    mesh = make_mesh(MeshConfig(stage=stages, data=1, fsdp=8 // stages))
    model = model if stages > 1 else dataclasses.replace(model, keep_gathered=False)
    layout = make_layout(layout_name, mesh.shape, repeats=repeats,
                         schedule=schedule if stages > 1 else None)
    programs = build_programs(TrainConfig(optim=optim, microbatches=microbatches),
                              dataclasses.replace(model, **layout.stack_fields), mesh, layout)
    step, state = programs.train_step, programs.init()
    tokens = jax.device_put(jax.random.randint(jax.random.key(0), (batch, SEQ + 1), 0,
                                               model.vocab_size),
                            jax.NamedSharding(mesh, jax.P(("data", "fsdp", "expert"))))
    return step, state, tokens


def measure(model: GPTConfig, stages: int, microbatches: int, repeats: int, schedule: str,
            optim: str, layout_name: str) -> dict:
    """One row of the schedule table: the batch of BATCH rows in M microbatches."""
    step, state, tokens = build(model, stages, microbatches, repeats, schedule, optim,
                                layout_name)
    report = hlo_collectives(step, state, tokens)
    crossing = [c for c in report.collectives if c.axes is None or "stage" in c.axes]
    over_batch = [c for c in report.collectives
                  if c.axes and set(c.axes) <= {"data", "fsdp", "expert"}]
    sums = [c for c in over_batch if c.kind in ("all-reduce", "reduce-scatter")]
    permutes = [c for c in crossing if c.kind == "collective-permute"]
    table = make_schedule(schedule, stages, microbatches, repeats) if stages > 1 else None
    # A tick sends once if it has forwards and once if it has backwards.
    slots = sum(c.executions for c in permutes)
    moved = lambda cs: sum(c.bytes_per_device * c.executions for c in cs)
    temp = step.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes
    holder = [jax.tree.map(jnp.copy, state)]

    def one_step():
        holder[0], metrics = step(holder[0], tokens)
        return metrics["loss"]

    work = 2 * repeats * microbatches
    return {"schedule": "none" if stages == 1 else label(schedule, repeats),
            "stages": stages, "microbatches": microbatches,
            "step_ms": 1e3 * best_time(one_step, 2),
            "bubble_model": table.bubble if table else 0.0,
            "ticks": table.ticks if table else 0,
            "bubble_hlo": (slots - work) / slots if slots else 0.0,
            "permute_bytes_per_device": moved(permutes),
            "other_stage_bytes_per_device": moved([c for c in crossing if c not in permutes]),
            "batch_sum_bytes_per_device": moved(sums),
            "batch_gather_bytes_per_device": moved([c for c in over_batch
                                                    if c.kind == "all-gather"]),
            "temp_bytes_per_device": temp}


def temporaries(model: GPTConfig, stages: int, microbatches: int, repeats: int, schedule: str,
                optim: str, layout_name: str) -> dict:
    """One row of the memory table: M microbatches of MICRO_ROWS rows each (the batch
    grows with M), compiled only."""
    step, state, tokens = build(model, stages, microbatches, repeats, schedule, optim,
                                layout_name, MICRO_ROWS * microbatches)
    temp = step.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes
    activations = MICRO_ROWS // (8 // stages) * SEQ * model.d_model * 4
    return {"schedule": label(schedule, repeats),
            "stages": stages, "microbatches": microbatches, "temp_bytes_per_device": temp,
            "temp_in_microbatches": temp / activations}


def label(schedule: str, repeats: int) -> str:
    """A schedule's name in the tables, with its chunks a stage where it takes them."""
    return f"{schedule} V={repeats}" if repeats > 1 else schedule


def variants(args) -> list[tuple[int, str]]:
    """(repeats, schedule) of each pipeline schedule asked for."""
    out = []
    for name in args.schedules:
        out += ([(v, name) for v in args.repeats if v > 1] if SCHEDULES[name].chunked
                else [(1, name)])
    return out


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true",
                        help="D = 256, and by default S = 2 and k = 1 only (about a minute)")
    parser.add_argument("--stages", type=int, nargs="+", default=None, choices=[2, 4, 8],
                        help="pipeline stages S (default 2 4)")
    parser.add_argument("--per-stage", type=int, nargs="+", default=None,
                        help="microbatches per stage k: M = k * S (default 1 2 4)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES),
                        choices=tuple(SCHEDULES))
    parser.add_argument("--repeats", type=int, nargs="+", default=[2],
                        help="chunks a stage V of the chunked schedules (2 and more)")
    parser.add_argument("--optim", default="adamw", choices=optimizer_names())
    parser.add_argument("--layout", default="fsdp", choices=LAYOUTS)
    parser.add_argument("--keep-gathered", action="store_true",
                        help="fsdp and owner: gather each stage's weights once a step")
    parser.add_argument("--remat", default="none", choices=REMAT_POLICIES,
                        help="every row's --model.remat")
    parser.add_argument("--out", default=None)
    return parser


def main(args_list: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(args_list)
    args.stages = args.stages or ([2] if args.small else [2, 4])
    args.per_stage = args.per_stage or ([1] if args.small else [1, 2, 4])
    jax.config.update("jax_num_cpu_devices", 8)
    model = dataclasses.replace(model_config(args.small), keep_gathered=args.keep_gathered,
                                remat=args.remat)
    rows = [measure(model, 1, 1, 1, "gpipe", args.optim, args.layout)]
    rows += [measure(model, s, k * s, v, name, args.optim, args.layout)
             for v, name in variants(args) for s in args.stages for k in args.per_stage]
    for r in rows:
        r["step_vs_none"] = r["step_ms"] / rows[0]["step_ms"]
        # Every stage computes on every tick, idle ones on zeros: the devices' work
        # together is 1 / (1 - bubble) of the unpipelined step's (XLA's cost analysis
        # counts a loop's body once, whatever its trip count, so it cannot say).
        r["work_vs_none"] = 1 / (1 - r["bubble_model"])
    print(f"model: {model.n_layers} layers, D={model.d_model}, F={model.d_ff}, "
          f"{model.param_count() / 1e6:.1f}M params; batch {BATCH} x {SEQ}; {args.layout} layout"
          f"{' kept gathered' if args.keep_gathered else ''}, {args.optim}, remat {args.remat}; "
          "stage S x fsdp 8/S")
    print_table(rows, [("schedule", "schedule", ""), ("stages", "S", "d"),
                       ("microbatches", "M", "d"), ("step_ms", "train step ms", ".0f"),
                       ("step_vs_none", "vs none", ".2f"),
                       ("work_vs_none", "work vs none", ".2f"),
                       ("bubble_model", "bubble model", ".1%"), ("ticks", "ticks", "d"),
                       ("bubble_hlo", "bubble compiled", ".1%"),
                       ("permute_bytes_per_device", "permute bytes/dev", ",.0f"),
                       ("other_stage_bytes_per_device", "other bytes across stage/dev", ",.0f"),
                       ("batch_sum_bytes_per_device", "batch-axis sums bytes/dev", ",.0f"),
                       ("batch_gather_bytes_per_device", "batch-axis gathers bytes/dev", ",.0f"),
                       ("temp_bytes_per_device", "temp/dev", ",.0f")])
    memory = [temporaries(model, s, k * s, v, name, args.optim, args.layout)
              for v, name in variants(args) for s in args.stages for k in args.per_stage]
    print(f"\ntemporaries with M microbatches of {MICRO_ROWS} rows (the batch grows with M); "
          f"one microbatch's activations [{MICRO_ROWS}/fsdp, {SEQ}, {model.d_model}] fp32 "
          "per device as the unit")
    print_table(memory, [("schedule", "schedule", ""), ("stages", "S", "d"),
                         ("microbatches", "M", "d"),
                         ("temp_bytes_per_device", "temp/dev", ",.0f"),
                         ("temp_in_microbatches", "in microbatch activations", ".1f")])
    write_results("bench_pipeline", rows + memory, args.out,
                  argv() if args_list is None else args_list)
    return rows + memory


if __name__ == "__main__":
    main()
