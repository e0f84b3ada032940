"""Pipeline stages: a stage-split model trains exactly like one device, its train step
runs its schedule's ticks and passes activations between stages by collective-permutes,
its optimizer step communicates nothing across stages, and what it does not support
yet is refused in one line."""

import dataclasses
import itertools
import json
import math
import re
import subprocess
import sys
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import helpers
from cli_runs import SMALL, main
from experiments.train import parse
from jmegatron.analysis import hlo, hlo_collectives
from jmegatron.models import GPTConfig, MoEConfig
from jmegatron.models.gpt import LAYER_INPUT, kept_for_backward, real_layers, ungroup
from jmegatron.optim import trainable_params
from jmegatron.sharding import MeshConfig, make_mesh, nested
from jmegatron.sharding.layouts import make_layout
from jmegatron.sharding.pipeline import PipelineRunner
from jmegatron.sharding.own_backward import Stash
from jmegatron.sharding.schedules import SCHEDULES, make_schedule
from jmegatron.sharding.stacks import stack_of
from jmegatron.train import (AdamWConfig, PipelineConfig, ScheduleConfig, TrainConfig, Trainer,
                             make_loss_fn)
from jmegatron.train.checkpoint import leaf_codecs
from jmegatron.train.programs import build_programs

MODEL = GPTConfig(vocab_size=300, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                  d_ff=64).pad_vocab(2)
PADDED = dataclasses.replace(MODEL, n_layers=5)   # 4 stages of 2 slots: 3 padding layers
# AdamW's eps=1e-4 as in test_layouts: a near-zero gradient (a rare token's embedding
# row) summed in another order may change sign, and eps=1e-8 would turn that into a
# whole step.
TRAIN = TrainConfig(lr=1e-2, steps=3, grad_clip=0.0, schedule=ScheduleConfig(warmup_steps=0),
                    adamw=AdamWConfig(eps=1e-4))
B, T, QK_TAU = 16, 16, 0.1   # 4 microbatches of 4 rows: one per data x fsdp rank


def batches():
    return [jax.random.randint(jax.random.key(i), (B, T + 1), 0, MODEL.vocab_size)
            for i in range(3)]


def programs_of(mesh, layout_name, model, train, microbatches, accumulate=1):
    """(layout, programs): the pipeline runs ``microbatches``; the train step accumulates
    ``accumulate`` (only one of them more than 1: the trainer's --microbatches); with
    QK-clip."""
    layout = helpers.layout_of(mesh, layout_name, train)
    return layout, build_programs(
        dataclasses.replace(train, microbatches=microbatches * accumulate, qk_clip=QK_TAU),
        dataclasses.replace(model, **layout.stack_fields), mesh, layout)


def setup(mesh, layout_name, model, train, microbatches, accumulate=1):
    """(layout, optimizer, state, train step) of ``programs_of``."""
    layout, programs = programs_of(mesh, layout_name, model, train, microbatches, accumulate)
    return layout, programs.optimizer, programs.init(), programs.train_step


def three_steps(mesh_config, layout_name="fsdp", model=MODEL, train=TRAIN, microbatches=4,
                devices=8, keep=False, accumulate=1):
    """Params after three steps with QK-clip, as [L, ...] stacks (``keep``: as stored)."""
    mesh = make_mesh(mesh_config, jax.devices()[:devices])
    _, _, state, step = setup(mesh, layout_name, model, train, microbatches, accumulate)
    for tokens in batches():
        state, _ = step(state, tokens)
    return state.params if keep else ungroup(state.params)


# Every schedule is a table of one interpreter (the tables have tests of their own): the
# equality cases by default cover each schedule on both meshes or both kinds of model, each
# layout, each kind of model (dense, padded, MoE only, dense and MoE in one pipeline) with
# one and with two chunks a stage, and remat; a case whose (model, mesh, layout) another
# default case runs under a schedule of the same chunks a stage is opt-in (8-50 s each on
# 2 cores; the suite runs at most 20 minutes): `pytest -m slow tests/test_pipeline.py`.
PAIRWISE = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    return three_steps(MeshConfig(fsdp=1), devices=1, microbatches=1)


@pytest.mark.parametrize("mesh_config, layout, remat", [
    (MeshConfig(stage=2, fsdp=2, tensor=2), "fsdp", "full"),
    (MeshConfig(stage=4, data=2, fsdp=1), "replicated", "none"),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "layerwise", "dots", marks=PAIRWISE),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "owner", "none", marks=PAIRWISE),
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "owner", "none", marks=PAIRWISE),
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "layerwise", "none", marks=PAIRWISE),
], ids=["stage2_fsdp2_tensor2_remat", "stage4_data2_replicated", "stage4_data2_layerwise_remat",
        "stage4_data2_owner", "stage2_fsdp2_tensor2_owner", "stage2_fsdp2_tensor2_layerwise"])
def test_three_steps_equal_one_device(mesh_config, layout, remat, reference):
    model = dataclasses.replace(MODEL, remat=remat)
    chex.assert_trees_all_close(three_steps(mesh_config, layout, model=model), reference,
                                rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def padded_reference():
    return three_steps(MeshConfig(fsdp=1), model=PADDED, devices=1, microbatches=1)


def optimizer_report(mesh, train, state=None, layout="fsdp"):
    """The collectives of one optimizer step (on ``state``'s params, or new ones)."""
    _, optimizer, _, new_state = helpers.build(mesh, layout, MODEL, train)
    state = state or new_state
    opt = jax.jit(helpers.optimizer_step(optimizer.tx))
    return hlo_collectives(opt, state.params, state.opt_state, helpers.grads_of(state.params, 0))


@pytest.fixture(scope="module")
def stage2_temporaries():
    """{(schedule, M): (the train step's temporaries per device, its collectives)} at
    stage 2 x data 2 x fsdp 2 for M microbatches of 4 rows (one a batch rank)."""
    mesh = make_mesh(MeshConfig(stage=2, data=2, fsdp=2))
    out = {}
    for schedule, m in [("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8),
                        ("interleaved-1f1b", 4), ("interleaved-1f1b", 8)]:
        train = dataclasses.replace(TRAIN, pipeline=PipelineConfig(
            schedule, repeats=2 if SCHEDULES[schedule].chunked else 1))
        _, _, state, step = setup(mesh, "fsdp", MODEL, train, m)
        tokens = jax.device_put(jax.random.randint(jax.random.key(m), (4 * m, T + 1), 0,
                                                   MODEL.vocab_size))
        compiled = step.lower(state, tokens).compile()
        out[schedule, m] = (compiled.memory_analysis().temp_size_in_bytes,
                            hlo.parse_collectives(compiled.as_text(), mesh))
    return out


@pytest.fixture(scope="module")
def stage2_programs():
    """The Muon and SOAP optimizer steps of stage 2 x data 2 x fsdp 2."""
    mesh = make_mesh(MeshConfig(stage=2, data=2, fsdp=2))
    return (optimizer_report(mesh, TRAIN),
            optimizer_report(mesh, dataclasses.replace(TRAIN, optim="soap")))


def assert_only_activations_cross_stages(report, sends: int, loops: int, fsdp: int = 2):
    """At S = 2, one microbatch's activations [B/M/batch ranks, T, D] sent on at each
    tick with forwards and its gradient back at each tick with backwards: ``sends`` of
    them (XLA drops the last tick's send, which nothing receives, where it unrolls a
    one-tick phase), ``loops`` of them in each of the two loops of ticks (the phases of
    forwards only and of backwards only; 1f1b's loop of both); outside the loops, once
    a step, only the embedding and head gradients (summed from the first and last
    stage), the layers' stats and scalars cross ``stage``: no weight and no weight
    gradient moves between stages."""
    rows, d = B // 4 // 4, MODEL.d_model
    crossing = [c for c in report.collectives if c.axes is None or "stage" in c.axes]
    permutes = [c for c in crossing if c.kind == "collective-permute"]
    # (Where XLA unrolls a one-tick phase it may send only what the receiver reads.)
    assert all(c.axes == ("stage",) and c.buffer_bytes <= rows * T * d * 4 for c in permutes)
    assert all(c.shape.startswith(f"f32[{rows},{T},{d}]") for c in permutes
               if c.executions > 1), report.table()
    assert sends - 1 <= sum(c.executions for c in permutes) <= sends, report.table()
    assert sorted(c.executions for c in permutes if c.executions > 1) == [loops] * 2, \
        report.table()
    # embedding + head per device ([V, D] and [D, V] split over fsdp), norm, stats
    weights = 2 * MODEL.vocab * d // fsdp * 4 + d * 4
    once = sum(c.bytes_per_device for c in crossing
               if c.executions == 1 and c.kind != "collective-permute")
    assert weights <= once < weights + rows * T * d * 4, report.table()


def test_the_optimizer_step_sends_nothing_across_stages(stage2_programs):
    """Each stage's matrices and their Muon or SOAP state live on that stage."""
    for opt in stage2_programs:
        assert opt.collectives, "the fsdp layout gathers the matrices over fsdp"
        assert not [c for c in opt.collectives if c.axes is None or "stage" in c.axes], \
            opt.table()


# One dense layer, then 5 MoE layers with auxiliary-loss-free balancing: two stacks, each
# padded on the stages (the dense one on every stage but the first).
MOE_MODEL = dataclasses.replace(MODEL, n_layers=6, moe=MoEConfig(
    n_experts=4, top_k=2, d_ff=16, first_dense=1, bias_rate=0.01))


@pytest.fixture(scope="module")
def moe_reference():
    """One device accumulating the 4 microbatches the pipelines run: the MoE losses are
    per microbatch in both (the load-balancing loss of a batch is not the mean of its
    microbatches')."""
    return three_steps(MeshConfig(fsdp=1), model=MOE_MODEL, devices=1, microbatches=1,
                       accumulate=4)


def assert_padding_is_zero(params):
    """Every padding slot of every stacked weight and expert bias is still zero."""
    stacked = [v for v in jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
               if isinstance(v, nnx.Variable) and real_layers(v) is not None]
    assert stacked
    for var in stacked:
        shape = stack_of(var)
        assert not shape.real().all() and not np.any(np.asarray(var[...])[~shape.real()])


@pytest.mark.parametrize("mesh_config, layout, remat", [
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "owner", "none", marks=PAIRWISE),
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "layerwise", "full", marks=PAIRWISE),
    (MeshConfig(stage=4, data=2, fsdp=1), "layerwise", "dots"),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "owner", "none", marks=PAIRWISE),
    (MeshConfig(stage=2, data=2, fsdp=1, expert=2), "fsdp", "none"),
], ids=["stage2_fsdp2_tensor2_owner", "stage2_fsdp2_tensor2_layerwise_remat",
        "stage4_data2_layerwise_remat", "stage4_data2_owner", "stage2_data2_expert2"])
def test_moe_three_steps_equal_one_device(mesh_config, layout, remat, moe_reference):
    """Each MoE layer maps over the stage's other axes (experts, tensor, batch) inside
    the pipeline's map (sharding.nested); the expert biases move with the stage's
    loads; padding layers, their biases included, stay zero."""
    model = dataclasses.replace(MOE_MODEL, remat=remat)
    got = three_steps(mesh_config, layout, model=model, keep=True)
    chex.assert_trees_all_close(ungroup(got), moe_reference, rtol=1e-5, atol=1e-6)
    assert_padding_is_zero(got)


def test_moe_experts_exchange_within_each_stage():
    """Stage 2 x data 2 x expert 2: the MoE all-to-alls run inside the tick loops over
    ``expert`` only; across stages, still only the activations of the one pipeline of
    the dense and the MoE stack (two chunks a stage: 2 M + S - 1 ticks each way)."""
    mesh = make_mesh(MeshConfig(stage=2, data=2, fsdp=1, expert=2))
    _, _, state, step = setup(mesh, "fsdp", MOE_MODEL, TRAIN, 4)
    report = hlo_collectives(step, state, jax.device_put(batches()[0]))
    assert any(c.kind == "all-to-all" and c.axes == ("expert",) and c.executions > 1
               for c in report.collectives), report.table()
    assert_only_activations_cross_stages(report, 2 * (2 * 4 + 2 - 1), 2 * 4, fsdp=1)


def test_soap_layerwise_stages_step_like_one_device(tmp_path):
    """SOAP under layerwise x stages: three optimizer steps on the same gradients equal
    one device's (MoE stacks place their state as dense ones do), and the state's
    checkpoint restores on one device (each stage's one layer dealt to 2 data owners:
    the factors' stack axis follows the stages'). (Trained end to end, SOAP under any sharding differs from one device
    by up to 2e-2 after three steps, stages or not: its first eigenbases come from
    nearly degenerate factors, so the order of the gradient sum over ranks rotates
    them; docs/troubleshooting.md.)"""
    train = dataclasses.replace(TRAIN, optim="soap")

    def steps(mesh, layout, grads=None):
        _, optimizer, _, state = helpers.build(mesh, layout, MODEL, train)
        step = jax.jit(helpers.optimizer_step(optimizer.tx))
        params, opt_state = state.params, state.opt_state
        grads = grads or [helpers.grads_of(params, i) for i in range(3)]
        for g in grads:
            params, opt_state = step(params, opt_state, live_like(g, params))
        state = state._replace(params=params, opt_state=opt_state)
        return ungroup(params), grads, (state, leaf_codecs(state, optimizer.plan))

    want, grads, one = steps(make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]), "fsdp")
    got, _, staged = steps(make_mesh(MeshConfig(stage=4, data=2, fsdp=1)), "layerwise", grads)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
    helpers.assert_restores(tmp_path, *staged, *one)


def live_like(canonical, params):
    """Gradients [L, ...] in the stacked form and shardings of ``params``' leaves."""
    variables = jax.tree.leaves(trainable_params(params),
                                is_leaf=lambda v: isinstance(v, nnx.Variable))
    leaves = [g if stack_of(v) is None else stack_of(v).to_live(g)
              for g, v in zip(jax.tree.leaves(canonical), variables)]
    return jax.tree.unflatten(jax.tree.structure(trainable_params(params)),
                              [jax.device_put(g, v[...].sharding)
                               for g, v in zip(leaves, variables)])


def test_layerwise_stages_move_matrices_only_within_a_stage():
    """Layerwise: the updated matrices return from their owners within each stage's
    data x fsdp group; nothing crosses the stage axis."""
    report = optimizer_report(make_mesh(MeshConfig(stage=2, data=2, fsdp=2)), TRAIN,
                              layout="layerwise")
    assert report.collectives and all(c.axes is not None and set(c.axes) <= {"data", "fsdp"}
                                      for c in report.collectives), report.table()


@pytest.mark.parametrize("optim, pipeline", [
    ("muon", PipelineConfig()), ("soap", PipelineConfig()),
    ("muon", PipelineConfig("circular", repeats=2))], ids=["muon", "soap", "muon_circular"])
def test_owner_stages_optimizer_step_has_no_collective(optim, pipeline):
    """Under owner each stage's matrices are whole on the ranks of that stage's own
    fsdp group (circular: each of its chunks in groups of its own): Muon's and SOAP's
    step communicate nothing at all."""
    mesh = make_mesh(MeshConfig(stage=2, fsdp=4))
    train = dataclasses.replace(TRAIN, optim=optim, pipeline=pipeline)
    report = optimizer_report(mesh, train, layout="owner")
    assert report.collectives == (), report.table()


CIRCULAR = dataclasses.replace(TRAIN, pipeline=PipelineConfig("circular", repeats=2))


def assert_equals_one_device(mesh_config, layout, model, train, reference):
    """Three steps of ``train``'s pipeline equal ``reference``'s one device, and the
    stacks' padding layers stay zero."""
    got = three_steps(mesh_config, layout, model=model, train=train, keep=True)
    chex.assert_trees_all_close(ungroup(got), reference, rtol=1e-5, atol=1e-6)
    if model is not MODEL:
        assert_padding_is_zero(got)


NINE = dataclasses.replace(MODEL, n_layers=9)   # 4 stages x 2 chunks of 2 slots: 7 padding


@pytest.fixture(scope="module")
def nine_layer_reference():
    return three_steps(MeshConfig(fsdp=1), model=NINE, devices=1, microbatches=1)


# 1 dense + 9 MoE layers: 4 stages x 2 chunks need 8 layers of the MoE stack.
MOE_TEN = dataclasses.replace(MOE_MODEL, n_layers=10)


@pytest.fixture(scope="module")
def moe_ten_reference():
    return three_steps(MeshConfig(fsdp=1), model=MOE_TEN, devices=1, microbatches=1,
                       accumulate=4)


@pytest.mark.parametrize("mesh_config, layout, model, want", [
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "owner", PADDED, "padded_reference",
                 marks=PAIRWISE),
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "layerwise", MODEL, "reference",
                 marks=PAIRWISE),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "layerwise", NINE,
                 "nine_layer_reference", marks=PAIRWISE),
    (MeshConfig(stage=4, data=2, fsdp=1), "owner", NINE, "nine_layer_reference"),
    (MeshConfig(stage=2, fsdp=2, tensor=2), "owner", MOE_MODEL, "moe_reference"),
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "layerwise",
                 dataclasses.replace(MOE_MODEL, remat="full"), "moe_reference", marks=PAIRWISE),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "owner", MOE_TEN, "moe_ten_reference",
                 marks=PAIRWISE),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "layerwise", MOE_TEN, "moe_ten_reference",
                 marks=PAIRWISE),
], ids=["stage2_fsdp2_tensor2_owner_padded", "stage2_fsdp2_tensor2_layerwise",
        "stage4_data2_layerwise_padded", "stage4_data2_owner_padded",
        "moe_stage2_fsdp2_tensor2_owner", "moe_stage2_fsdp2_tensor2_layerwise_remat",
        "moe_stage4_data2_owner", "moe_stage4_data2_layerwise"])
def test_circular_three_steps_equal_one_device(mesh_config, layout, model, want, request):
    """Two chunks a stage, interleaved (stage s holds chunks s and S + s; under owner
    each chunk in its own groups), the last chunks padded where S x 2 does not divide
    a stack: the microbatches go around the stages twice, and the run equals one
    device."""
    assert_equals_one_device(mesh_config, layout, model, CIRCULAR,
                             request.getfixturevalue(want))


def test_circular_runs_its_ticks_and_only_activations_cross_stages():
    """Circular over S=2 stages, V=2 chunks, M=4 microbatches: V M + S - 1 = 9 ticks
    with forwards, the last stage's output wrapping around to stage 0, and as many
    with backwards."""
    mesh = make_mesh(MeshConfig(stage=2, data=2, fsdp=2))
    _, _, state, step = setup(mesh, "fsdp", MODEL, CIRCULAR, 4)
    report = hlo_collectives(step, state, jax.device_put(batches()[0]))
    assert_only_activations_cross_stages(report, 2 * (2 * 4 + 2 - 1), 2 * 4)


ONE_F_ONE_B = dataclasses.replace(TRAIN, pipeline=PipelineConfig("1f1b"))
# 1f1b runs one stack: MoE layers only (5 of them: padded on 2 and on 4 stages).
MOE_ONLY = dataclasses.replace(MOE_MODEL, n_layers=5,
                               moe=dataclasses.replace(MOE_MODEL.moe, first_dense=0))


@pytest.fixture(scope="module")
def moe_only_reference():
    return three_steps(MeshConfig(fsdp=1), model=MOE_ONLY, devices=1, microbatches=1,
                       accumulate=4)


@pytest.mark.parametrize("mesh_config, layout, model, want", [
    (MeshConfig(stage=2, fsdp=2, tensor=2), "owner", PADDED, "padded_reference"),
    (MeshConfig(stage=2, fsdp=2, tensor=2), "layerwise", MODEL, "reference"),
    (MeshConfig(stage=4, data=2, fsdp=1), "owner", MODEL, "reference"),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "layerwise", PADDED, "padded_reference",
                 marks=PAIRWISE),
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "owner", MOE_ONLY, "moe_only_reference",
                 marks=PAIRWISE),
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "layerwise",
                 dataclasses.replace(MOE_ONLY, remat="full"), "moe_only_reference",
                 marks=PAIRWISE),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "owner", MOE_ONLY, "moe_only_reference",
                 marks=PAIRWISE),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "layerwise", MOE_ONLY,
                 "moe_only_reference", marks=PAIRWISE),
    (MeshConfig(stage=2, fsdp=2, tensor=2), "layerwise",
     dataclasses.replace(MOE_MODEL, remat="full"), "moe_reference"),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "owner", MOE_MODEL, "moe_reference",
                 marks=PAIRWISE),
], ids=["stage2_fsdp2_tensor2_owner_padded", "stage2_fsdp2_tensor2_layerwise",
        "stage4_data2_owner", "stage4_data2_layerwise_padded",
        "moe_stage2_fsdp2_tensor2_owner", "moe_stage2_fsdp2_tensor2_layerwise_remat",
        "moe_stage4_data2_owner", "moe_stage4_data2_layerwise",
        "dense_and_moe_stage2_fsdp2_tensor2_layerwise_remat", "dense_and_moe_stage4_data2_owner"])
def test_1f1b_three_steps_equal_one_device(mesh_config, layout, model, want, request):
    """1f1b's own backward (sharding.own_backward): each stage's backward rebuilds its
    chunk's vjp from what the forward kept, the head's gradient starts each microbatch's backward, the
    MoE losses' constant cotangents reach every layer's router, and the embedding and
    head gradients of the first and last stage are summed once; a dense and an MoE
    stack run as two chunks a stage of one pipeline (a stage picks its chunk's stack
    by ``lax.switch``); three steps equal one device's (accumulating the same 4
    microbatches for MoE)."""
    assert_equals_one_device(mesh_config, layout, model, ONE_F_ONE_B,
                             request.getfixturevalue(want))


INTERLEAVED = dataclasses.replace(TRAIN, pipeline=PipelineConfig("interleaved-1f1b",
                                                                  repeats=2))


@pytest.mark.parametrize("mesh_config, layout, model, want", [
    (MeshConfig(stage=2, fsdp=2, tensor=2), "layerwise", MODEL, "reference"),
    (MeshConfig(stage=4, data=2, fsdp=1), "owner", NINE, "nine_layer_reference"),
    pytest.param(MeshConfig(stage=2, fsdp=2, tensor=2), "owner", MOE_ONLY, "moe_only_reference",
                 marks=PAIRWISE),
    pytest.param(MeshConfig(stage=4, data=2, fsdp=1), "layerwise", MOE_TEN, "moe_ten_reference",
                 marks=PAIRWISE),
], ids=["stage2_fsdp2_tensor2_layerwise", "stage4_data2_owner_padded",
        "moe_stage2_fsdp2_tensor2_owner_padded", "dense_and_moe_stage4_data2_layerwise_padded"])
def test_interleaved_1f1b_three_steps_equal_one_device(mesh_config, layout, model, want,
                                                       request):
    """interleaved-1f1b, two chunks a stage run by the same interpreter as 1f1b: inputs
    kept from their arrival, stage 0's second chunk fed around the ring from the last
    stage, input gradients kept until their backward; a dense and an MoE stack as four
    chunks a stage of one pipeline; three steps equal one device."""
    assert_equals_one_device(mesh_config, layout, model, INTERLEAVED,
                             request.getfixturevalue(want))


def test_1f1b_temporaries_do_not_grow_with_the_microbatches(stage2_temporaries):
    """Twice the microbatches (of the same size) at the same S: gpipe keeps what each
    one's forward keeps (more than 4 microbatches' activations more), 1f1b what the
    forwards of at most 2S - 1 microbatches keep whatever M (less than one
    microbatch's activations apart), and its interleaved form those of 2S - 1 +
    (V - 1) S chunks. (At these sizes a tick's own temporaries outweigh what the
    forwards keep, and gpipe's ticks run a forward or a backward, 1f1b's both: the
    totals of M = 4 do not order the schedules.)"""
    activations = B // 4 // 4 * T * MODEL.d_model * 4   # one microbatch, per device
    temp = {key: value[0] for key, value in stage2_temporaries.items()}
    assert temp["gpipe", 8] - temp["gpipe", 4] > 4 * activations, temp
    for schedule in ("1f1b", "interleaved-1f1b"):
        assert abs(temp[schedule, 8] - temp[schedule, 4]) < activations, temp


@pytest.mark.parametrize("remat, want", [("none", ["inputs", "activations"]), ("full", ["inputs"])])
def test_a_chunk_keeps_for_its_backward_what_remat_keeps_never_weights(remat, want):
    """What an own-backward schedule keeps from a chunk's forward to its backward
    (``own_backward.Stash``): under remat "none" the products (the weights' casts to
    the compute dtype are recomputed, not kept a microbatch each), under "full" only
    each layer's input; the vjp rebuilt from them equals JAX's."""
    layers, b, d = 3, 4, 8
    keys = jax.random.split(jax.random.key(0), 3)
    w = [jax.random.normal(keys[0], (layers, d, 2 * d)),
         jax.random.normal(keys[1], (layers, 2 * d, d))]
    x = jax.random.normal(keys[2], (b, d))

    def chunk(w, x):
        def layer(x, w):
            x = checkpoint_name(x, LAYER_INPUT)
            h = jax.nn.gelu(x.astype(jnp.bfloat16) @ w[0].astype(jnp.bfloat16))
            return x + (h @ w[1].astype(jnp.bfloat16)).astype(x.dtype), None
        return jax.lax.scan(layer, x, w)[0]

    backward_of = lambda x, r: jax.vjp(
        jax.checkpoint(chunk, policy=kept_for_backward(remat)), w, x)[1]
    stash = Stash.of(backward_of, lambda: (x, 0), w)
    kinds = ["inputs" if a.shape == (layers, b, d) else "activations" if a.shape[:2] == (
        layers, b) else a.shape for a in stash.shapes]
    assert kinds == want, stash.shapes
    dy = jax.random.normal(keys[0], (b, d))
    rebuilt = stash.rebuild(stash.keep(backward_of(x, 0)), x)(dy)
    chex.assert_trees_all_close(rebuilt, jax.vjp(chunk, w, x)[1](dy), rtol=1e-6)


@pytest.mark.parametrize("m", [4, 8])
def test_interleaved_1f1b_sends_once_a_tick_of_its_table(m, stage2_temporaries):
    """interleaved-1f1b over S = 2 stages and V = 2 chunks: one send of a microbatch's
    activations for each tick of the table that runs forwards, one of its gradient for
    each that runs backwards (around the ring: the last stage feeds stage 0's second
    chunk, and stage 0 sends the last stage its gradient), and no other permute."""
    table = make_schedule("interleaved-1f1b", 2, m, 2)
    report = stage2_temporaries["interleaved-1f1b", m][1]
    rows, d = B // 4 // 4, MODEL.d_model
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    assert all(c.axes == ("stage",) and c.shape.startswith(f"f32[{rows},{T},{d}]")
               for c in permutes), report.table()
    ticks = sum((end - start) * (f + b) for start, end, f, b in table.phases)
    assert sum(c.executions for c in permutes) == ticks, report.table()


@pytest.mark.parametrize("schedule, m", [("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8)])
def test_the_schedules_run_their_ticks_and_only_activations_cross_stages(schedule, m,
                                                                          stage2_temporaries):
    """M + S - 1 ticks with a forward and as many with a backward: gpipe's phases are
    M + S - 2 ticks of forwards, one of both (the last stage's last forward and first
    backward), M + S - 2 of backwards; 1f1b's S - 1 of forwards only, M of both, S - 1
    of backwards only."""
    assert_only_activations_cross_stages(stage2_temporaries[schedule, m][1],
                                         2 * (m + 2 - 1), m)


@pytest.fixture(scope="module")
def moe_gpipe():
    """{M: (programs, tokens)}: MOE_MODEL's dense and MoE stacks in one gpipe pipeline
    (two chunks a stage) under layerwise at stage 2 x data 2 x fsdp 2, M microbatches
    of 4 rows (one a batch rank: each stage runs manual over the batch axes)."""
    mesh = make_mesh(MeshConfig(stage=2, data=2, fsdp=2))
    return {m: (programs_of(mesh, "layerwise", MOE_MODEL, TRAIN, m)[1], jax.device_put(
        jax.random.randint(jax.random.key(m), (4 * m, T + 1), 0, MODEL.vocab_size)))
        for m in (4, 8)}


def test_an_undifferentiated_loss_runs_the_forward_ticks_only(moe_gpipe):
    """The eval step's loss (the pipeline's loss not differentiated) runs only the ticks
    with forwards, sending only activations on (V M + S - 1 sends, XLA dropping the last
    one, which nothing receives, where it unrolls a one-tick phase: no gradients come
    back), and equals the loss and aux the train step's differentiated pass computes;
    gpipe's dense and MoE stacks, two chunks a stage."""
    programs, tokens = moe_gpipe[4]
    evaluate = jax.jit(programs.loss_fn)
    loss, aux = evaluate(programs.init().params, tokens)
    _, metrics = programs.train_step(programs.init(), tokens)
    # The step reports the largest logits by layer (train.step.watch_logits).
    logits = aux.pop("max_attention_logit").max(axis=-1)
    chex.assert_trees_all_close(
        (loss, aux, logits),
        (metrics["loss"], {k: metrics[k] for k in aux}, metrics["max_attention_logit_per_layer"]),
        rtol=1e-6)
    report = hlo_collectives(evaluate, programs.init().params, tokens)
    train, model = TRAIN, MOE_MODEL
    stacks = len([kind for kind, _ in itertools.groupby(model.moe_layers)])
    v = make_schedule(train.pipeline.schedule, 2, 4, train.pipeline.repeats, stacks).repeats
    permutes = report.select("collective-permute", ("stage",))
    assert v * 4 + 2 - 2 <= sum(c.executions for c in permutes) <= v * 4 + 2 - 1, \
        report.table()


# Layerwise at stage 2 x data 2 x fsdp 2 with 8 layers: each stage's 4 layers are shared
# out one per data x fsdp rank, so their gradients can be reduce-scattered onto the owners.
DEEP = dataclasses.replace(MODEL, n_layers=8)
SUMMED_ONCE = {"layerwise": DEEP, "fsdp": dataclasses.replace(MODEL, keep_gathered=True),
               "owner": dataclasses.replace(MODEL, keep_gathered=True)}


@pytest.fixture(scope="module")
def batch_sums():
    """{layout: 1f1b's train step's sums over data and fsdp (all-reduces and
    reduce-scatters, their bytes per device and executions), and the params after
    three steps} at stage 2 x data 2 x fsdp 2, 4 microbatches of 4 rows, for each
    layout's model of SUMMED_ONCE; {layout: that model's params on one device}.
    Every schedule is a table of one interpreter, and the sums run at the transposes
    of ``over_stages``' gathers and casts, outside its ticks: 1f1b's table stands for
    the others (the MoE test below runs gpipe's)."""
    mesh = make_mesh(MeshConfig(stage=2, data=2, fsdp=2))
    out = {}
    for layout, model in SUMMED_ONCE.items():
        _, _, state, step = setup(mesh, layout, model, ONE_F_ONE_B, 4)
        report = hlo_collectives(step, state, batches()[0])
        sums = [c for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter")
                and c.axes and set(c.axes) <= {"data", "fsdp"}]
        for tokens in batches():   # B = 16: the reference's batches
            state, _ = step(state, tokens)
        out[layout] = (sums, ungroup(state.params))
    deep = three_steps(MeshConfig(fsdp=1), model=DEEP, devices=1, microbatches=1)
    return out, {"layerwise": deep}


def moved(collectives) -> float:
    return sum(c.bytes_per_device * c.executions for c in collectives)


@pytest.mark.parametrize("layout", list(SUMMED_ONCE))
def test_gradients_are_summed_over_the_batch_once_a_step(layout, batch_sums, reference):
    """Where a stage's weights are whole on every batch rank for the step (layerwise;
    fsdp and owner with keep_gathered: gathered once), it runs manual over the batch
    axes and sums its weights' gradients over them once, after the last microbatch
    (Layout.pipeline_batch_axes), by one reduce-scatter to the shards or owners: no
    sum over them runs inside a tick loop, so more microbatches send no more bytes
    (each tick summed its gradients before: layerwise gpipe sent 1.55x the bytes at M
    = 8 as at 4, and 1f1b 3.4x today's at M = 4; fsdp and owner without keep_gathered
    still do, 1.7x; the MoE test below doubles M); three steps still equal one
    device's."""
    runs, references = batch_sums
    sums, params = runs[layout]
    assert sums and max(c.executions for c in sums) == 1, runs
    chex.assert_trees_all_close(params, references.get(layout, reference), rtol=1e-5,
                                atol=1e-6)


def test_layerwise_stages_reduce_scatter_their_gradients_to_the_owners(batch_sums):
    """Layerwise's stage weights reach their owners by one reduce-scatter
    (Layerwise.pipeline_gradient_spec), not an all-reduce: the all-reduces over the
    batch axes carry only the params outside the stages (embedding, head, final norm),
    whose state is replicated."""
    sums, params = batch_sums[0]["layerwise"]
    outside = sum(a.size * a.dtype.itemsize for key in params if key != "blocks"
                  for a in jax.tree.leaves(params[key]))
    reduced = moved([c for c in sums if c.kind == "all-reduce"])
    scattered = moved([c for c in sums if c.kind == "reduce-scatter"])
    assert scattered > 0 and reduced <= 2 * 3 / 4 * outside * 1.01, (reduced, scattered, outside)


def test_moe_stages_sum_their_gradients_once_a_step(moe_gpipe):
    """MoE layers inside a stage manual over the batch axes sum their routing
    statistics over the batch ranks themselves, once a tick (a few dozen bytes); the
    weights' gradients are summed once a step: the batch-axis bytes do not grow with
    M (before: 1.67x from M = 4 to 8 under gpipe). A dense and an MoE stack under
    gpipe, one pipeline: the interpreter's path for every schedule. (Equal to one
    device: gpipe's MoE equality test at stage 4 x data 2 under layerwise runs so.)"""
    sums = {}
    for m, (programs, tokens) in moe_gpipe.items():
        report = hlo_collectives(programs.train_step, programs.init(), tokens)
        sums[m] = [c for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter")
                   and c.axes and set(c.axes) <= {"data", "fsdp"}]
    assert moved(sums[8]) <= 1.1 * moved(sums[4]), sums
    largest = max(c.bytes_per_device for c in sums[8])
    assert all(c.bytes_per_device < 0.01 * largest for c in sums[8] if c.executions > 1), sums


KEPT = dataclasses.replace(MODEL, keep_gathered=True)


@pytest.mark.parametrize("layout, mesh_shape, model, want", [
    ("replicated", {"stage": 2, "data": 2, "fsdp": 2}, MODEL, ("data", "fsdp")),
    ("layerwise", {"stage": 4, "data": 2}, MODEL, ("data",)),
    ("owner", {"stage": 4, "data": 2}, MODEL, ("data",)),   # an owner group of one rank
    ("owner", {"stage": 2, "data": 2, "fsdp": 2}, MODEL, ()),
    ("owner", {"stage": 2, "data": 2, "fsdp": 2}, KEPT, ("data", "fsdp")),
    ("fsdp", {"stage": 2, "data": 2, "fsdp": 2}, MODEL, ()),
    ("fsdp", {"stage": 2, "data": 2, "fsdp": 2}, KEPT, ("data", "fsdp")),
    ("fsdp", {"stage": 2, "fsdp": 2, "tensor": 2}, KEPT, ()),
    ("layerwise", {"stage": 2, "fsdp": 2, "tensor": 2}, MODEL, ()),
    ("layerwise", {"stage": 4, "data": 2}, MOE_MODEL, ("data",)),
    ("layerwise", {"stage": 2, "data": 2, "expert": 2}, MOE_MODEL, ()),
    ("layerwise", {"data": 2, "fsdp": 4}, MODEL, ()),
], ids=["replicated", "layerwise", "owner_of_one", "owner", "owner_kept", "fsdp", "fsdp_kept",
        "fsdp_kept_tensor", "tensor", "moe", "moe_experts", "no_stages"])
def test_which_stages_sum_their_gradients_once(layout, mesh_shape, model, want):
    """Only the stage and batch axes live, no param split over a batch axis unless
    keep_gathered keeps the stage's weights gathered for the step (without it, ZeRO-3
    reduce-scatters each microbatch's gradients), and MoE layers only where their
    experts are whole (they sum their routing statistics over the batch ranks inside
    the layer: gpipe's MoE equality test at stage 4 x data 2 runs so)."""
    shape = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "tensor": 1, **mesh_shape}
    assert make_layout(layout, shape).pipeline_batch_axes(model, shape) == want


def test_bf16_pipelines_compile_and_agree():
    """bf16 at stage 2 x fsdp 4: XLA:CPU aborted compiling GPipe's bf16 sums over the
    stages (sharding.rules.sum_dtype); GPipe's first step and 1f1b's, two
    orders of the same bf16 computation, agree to bf16's precision."""
    mesh = make_mesh(MeshConfig(stage=2, data=1, fsdp=4))
    model = dataclasses.replace(MODEL, dtype="bfloat16")
    metrics = {}
    for schedule in ("gpipe", "1f1b"):
        train = dataclasses.replace(TRAIN, pipeline=PipelineConfig(schedule))
        _, _, state, step = setup(mesh, "fsdp", model, train, 4)
        metrics[schedule] = step(state, batches()[0])[1]
    for key in ("loss", "grad_norm"):
        a, b = (float(metrics[s][key]) for s in ("gpipe", "1f1b"))
        assert np.isfinite(a) and a == pytest.approx(b, rel=1e-2), (key, a, b)


def test_importing_the_trainer_leaves_jax_unpatched():
    """The fix to JAX's residual specs is applied when a pipeline builds its map
    (pipeline.over_stages), so a run without stages uses JAX as installed."""
    code = ("import experiments.train, jmegatron.models, jmegatron.train\n"
            "from jax._src.core import ShapedArray\n"
            "print(ShapedArray.nospec.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "jax._src.core", out.stdout


def test_a_nested_map_differentiates_inside_a_scan_of_a_stage():
    """sharding.nested: a map over fsdp x tensor inside one over stage, in a scan (whose
    loop-invariant hoisting splits it), has the gradients of the same computation
    left to XLA; without the fix to JAX's residual specs it does not compile."""
    mesh = make_mesh(MeshConfig(stage=2, fsdp=2, tensor=2))
    assert nested.nested_maps_differentiate()

    def layer(x, w):   # x [b, D] over fsdp, w [D, F] over tensor
        y = jax.lax.psum(jnp.tanh(x @ w) @ w.T, "tensor")
        return y, jax.lax.psum(jnp.sum(y), "fsdp") + jnp.arange(3.0).sum()

    def mapped(x, w):
        return nested.shard_map(layer, jax.sharding.get_abstract_mesh(),
                                (jax.P("fsdp"), jax.P(None, "tensor")), (jax.P("fsdp"), jax.P()))(x, w)

    def plain(x, w):
        y = jnp.tanh(x @ w) @ w.T
        return y, jnp.sum(y) + 3.0

    def loss(inner):
        def stage(x, w):
            def tick(x, _):
                y, total = inner(x, w[0])
                return jax.lax.ppermute(y * (1 + 0.1 * total), "stage", [(0, 1), (1, 0)]), None
            return jax.lax.scan(tick, jax.lax.pcast(x, ("stage",), to="varying"),
                                jnp.arange(2))[0]
        return lambda x, w: jnp.sum(jax.shard_map(
            stage, mesh=mesh, in_specs=(jax.P(), jax.P("stage")), out_specs=jax.P("stage"),
            axis_names={"stage"})(x, w) ** 2)

    x = 0.3 * jax.random.normal(jax.random.key(0), (8, 4))
    w = 0.3 * jax.random.normal(jax.random.key(1), (2, 4, 6))
    grad = lambda inner: jax.jit(jax.grad(loss(inner), argnums=(0, 1)))(x, w)
    chex.assert_trees_all_close(grad(mapped), grad(plain), rtol=1e-5, atol=1e-6)


def test_the_schedules_tables_give_their_ticks_and_bubble():
    """The tables the interpreter reads: GPipe's diagonals of forwards, then of
    backwards, circular's over V M items, 1f1b's forward and backward waves (the simulated orders give the paper's
    diagonals); the bubbles counted on them, over the phases' work slots, are the
    schedules' formulas: Megatron's (S-1)/(M+S-1) for 1f1b, (S-1)/(V M+S-1) for its
    interleaved form."""
    cli = typing.get_args(typing.get_type_hints(PipelineConfig)["schedule"])
    assert set(cli) == set(SCHEDULES)   # --pipeline.schedule offers every registered one
    gpipe = make_schedule("gpipe", 2, 3)   # the backwards from the last forward's tick
    np.testing.assert_array_equal(gpipe.forward, [[0, -1], [1, 0], [2, 1], [-1, 2]] +
                                  [[-1, -1]] * 3)
    np.testing.assert_array_equal(gpipe.backward, [[-1, -1]] * 3 + [[-1, 0], [0, 1], [1, 2],
                                                                     [2, -1]])
    for s, m in [(4, 4), (2, 8), (4, 16)]:
        gpipe = make_schedule("gpipe", s, m)
        assert (gpipe.ticks, gpipe.bubble) == (2 * (m + s) - 3, pytest.approx((s - 1) / (m + s - 1)))
    circular = make_schedule("circular", 4, 4, 2)
    assert (circular.ticks, circular.bubble) == (2 * (8 + 4) - 3, pytest.approx(3 / 11))
    assert sorted(circular.forward[:, 3][circular.forward[:, 3] >= 0]) == list(range(8))
    # each stage's backwards: the last chunk first, every microbatch of a chunk in turn
    done = circular.backward[:, 0][circular.backward[:, 0] >= 0]
    np.testing.assert_array_equal(done, [4, 5, 6, 7, 0, 1, 2, 3])
    for s, m in [(2, 2), (2, 3), (4, 4), (4, 5), (4, 16)]:
        one = make_schedule("1f1b", s, m)
        t, stage = np.meshgrid(np.arange(m + 2 * s - 2), np.arange(s), indexing="ij")
        diagonal = lambda k: np.where((k >= 0) & (k < m), k, -1)
        np.testing.assert_array_equal(one.forward, diagonal(t - stage))
        np.testing.assert_array_equal(one.backward, diagonal(t - (2 * s - 2 - stage)))
        assert one.bubble == pytest.approx((s - 1) / (m + s - 1))
        assert [p[2:] for p in one.phases] == [(True, False), (True, True), (False, True)]
    for s, m, v in [(2, 2, 2), (2, 4, 3), (4, 8, 2), (4, 16, 2), (4, 8, 4)]:
        table = make_schedule("interleaved-1f1b", s, m, v)
        assert table.bubble == pytest.approx((s - 1) / (v * m + s - 1)), (s, m, v)


@pytest.mark.parametrize("name, s, m, v, most", [
    ("1f1b", 2, 2, 1, 2), ("1f1b", 4, 4, 1, 4), ("1f1b", 4, 16, 1, 7),
    ("interleaved-1f1b", 2, 4, 2, 5), ("interleaved-1f1b", 4, 8, 2, 11),
    ("interleaved-1f1b", 4, 16, 2, 11), ("interleaved-1f1b", 2, 4, 3, 7)])
def test_own_backward_buffers_hold_each_input_until_its_backward(name, s, m, v, most):
    """The slots of ``Schedule.buffers``, replayed on labels as the interpreter uses
    them (the forward reads, then the backward, then what was sent arrives): every
    forward and backward finds its own item's input and gradient, never another's;
    a stage keeps at most 2(S-s)-1 + (V-1)S chunk inputs (1f1b: 2S-1 whatever M)."""
    table = make_schedule(name, s, m, v)
    buf, last = table.buffers, s - 1
    assert buf.inputs == most
    assert buf.grads == 1   # the tables run each backward as soon as its gradient arrives
    held = {(kind, stage): {} for kind in ("inputs", "grads") for stage in range(s)}
    for t in range(table.ticks):
        for stage in range(s):
            inputs, grads = held["inputs", stage], held["grads", stage]
            f, b = table.forward[t, stage], table.backward[t, stage]
            if f >= 0:
                if stage == 0 and f < m:   # a microbatch's first chunk: embedded here
                    inputs[buf.forward_slot[t, stage]] = f
                assert inputs.get(buf.forward_slot[t, stage]) == f, (t, stage)
            if b >= 0:
                assert inputs[buf.backward_slot[t, stage]] == b, (t, stage)
                if not (stage == last and b >= (v - 1) * m):   # else: from the loss
                    assert grads[buf.grad_slot[t, stage]] == b, (t, stage)
        for stage in range(s):   # what each stage sent at t arrives at t + 1
            for kind, table_, step, slots in (("inputs", table.forward, -1, buf.arrive),
                                              ("grads", table.backward, 1, buf.grad_arrive)):
                sender = stage + (1 if step > 0 else -1)   # around the ring with chunks
                sender = sender % s if v > 1 or 0 <= sender < s else None
                item = -1 if sender is None else table_[t, sender]
                wraps = stage == (0 if step < 0 else last)
                item = item - step * m * wraps if item >= 0 else -1
                if not 0 <= item < v * m:   # the last chunk's output goes to the loss
                    item = -1
                slot = slots[t + 1, stage] if t + 1 < table.ticks else -1
                assert (slot >= 0) == (item >= 0), (kind, t, stage)
                if slot >= 0:
                    held[kind, stage][slot] = item


@pytest.mark.parametrize("make, words", [
    (lambda: dataclasses.replace(MODEL, stages=5), "5 pipeline stages for 4 layers"),
    (lambda: PipelineRunner(stages=4, microbatches=2), "2 microbatches for 4 pipeline stages"),
    (lambda: GPTConfig(n_layers=4, stages=2, moe=MoEConfig(n_experts=4, every=2)),
     "pipeline stages (2) run each layer stack whole"),
    (lambda: dataclasses.replace(MODEL, stages=2, repeats=3), "2 pipeline stages of 3 chunks"),
    (lambda: PipelineConfig("circular"), "--pipeline.repeats 1: must be >= 2 with"),
    (lambda: PipelineConfig("1f1b", repeats=2), "1 with gpipe and 1f1b"),
    (lambda: make_schedule("interleaved-1f1b", 4, 6, 2),
     "--microbatches 6 must be a multiple of 4"),
], ids=["more_stages_than_layers", "fewer_microbatches", "interleaved_moe",
        "more_chunks_than_layers", "circular_without_repeats", "1f1b_with_repeats",
        "interleaved_microbatches_not_in_groups"])
def test_unsupported_settings_are_refused_in_one_line(make, words):
    with pytest.raises(Exception, match=None) as err:
        make()
    message = str(err.value)
    assert words in message and "\n" not in message, message


def losses(run_dir) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_a_pipeline_run_from_the_cli_flags_stops_and_resumes_exactly(tmp_path):
    """A dense first layer and 3 MoE layers (expert biases included) over 2 stages of
    data 2 x expert 2, stopped and resumed from its checkpoint (the three runs share
    one set of programs: ``Trainer(programs=...)``)."""
    moe = ["--model.n-layers", "4", "--model.moe.n-experts", "4", "--model.moe.d-ff", "16",
           "--model.moe.first-dense", "1", "--model.moe.bias-rate", "0.01"]
    args = [*SMALL, *moe, "--mesh.stage", "2", "--mesh.data", "2", "--mesh.fsdp", "1",
            "--mesh.expert", "2", "--mesh.tensor", "1", "--microbatches", "2", "--steps", "4",
            "--out-dir", str(tmp_path)]
    lines = []
    straight = Trainer(parse([*args, "--name", "straight"]), log=lines.append)
    straight.run()
    assert ("pipeline: 2 stages of 1 dense + 2 MoE layers (one pipeline), gpipe over "
            "2 microbatches: 9 ticks, bubble counted on its 2 chunks a stage = 20.0%") in lines
    for more in (["--stop-after", "2"], ["--resume"]):
        Trainer(parse([*args, "--name", "halves", *more]), programs=straight.programs).run()
    assert len(losses(tmp_path / "straight")) == 4
    assert losses(tmp_path / "straight") == losses(tmp_path / "halves")


def test_programs_of_other_settings_are_refused_in_one_line(tmp_path):
    """Programs built for another learning rate or mesh are not run."""
    args = [*SMALL, "--steps", "1", "--out-dir", str(tmp_path)]
    first = Trainer(parse([*args, "--name", "a", "--mesh.stage", "2", "--mesh.data", "1",
                           "--mesh.fsdp", "4", "--mesh.tensor", "1", "--microbatches", "2"]))
    first.close()
    with pytest.raises(ValueError, match="^the programs given were built for other settings: "
                                         "mesh, fit_mesh, lr, microbatches, model, layout$"):
        Trainer(parse([*args, "--name", "b", "--lr", "1e-3"]), programs=first.programs)


def test_the_cli_refuses_fewer_microbatches_than_stages(tmp_path):
    error = main(*SMALL, "--mesh.stage", "2", "--mesh.data", "1", "--mesh.fsdp", "4",
                 "--mesh.tensor", "1", "--microbatches", "1", "--out-dir", str(tmp_path))
    assert error == ("error: --mesh.stage 2 needs --microbatches >= 2 (got 1): every stage "
                     "would idle"), error
    assert not any(tmp_path.iterdir())
