"""Context parallelism in the model: a ``context`` mesh axis splits each sequence, the
loss deals its tokens and targets over it (``models.context.sequence_order``) and the
attention runs across it. The loss, every gradient and the largest attention logit
equal one device's, for both strategies and both orders, dense and MoE, beside the
tensor, fsdp, data and expert axes; what the attention sends over the axis, read from
the same compiled programs; the CLI trains and resumes across context sizes; bad runs
are refused in one line before compiling."""

import dataclasses
import json

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from jmegatron.analysis.hlo import parse_collectives
from jmegatron.models import GPTConfig, MoEConfig
from jmegatron.models.gpt import ungroup
from jmegatron.sharding import MeshConfig
from jmegatron.train import TrainConfig, make_loss_fn
from jmegatron.train.programs import sharing_programs
from tests import helpers
from tests.cli_runs import SMALL, main

DENSE = GPTConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=128).pad_vocab(2)
MOE = dataclasses.replace(DENSE, moe=MoEConfig(n_experts=4, top_k=2, d_ff=64))
MODELS = {"dense": DENSE, "moe": MOE}
B, T = 8, 32   # T: 2 chunks for each of up to 4 context ranks, of 4 tokens
TRAIN = TrainConfig()

# Each strategy and each order once with each kind of model, beside every other axis.
CASES = {
    "ring-zigzag-dense-tensor": ("ring", "zigzag", "dense", "replicated",
                                 MeshConfig(context=4, fsdp=1, tensor=2)),
    "all_gather-contiguous-dense-owner-tensor": ("all_gather", "contiguous", "dense", "owner",
                                                 MeshConfig(context=2, fsdp=2, tensor=2)),
    "ring-contiguous-moe-expert": ("ring", "contiguous", "moe", "layerwise",
                                   MeshConfig(context=2, data=2, expert=2, fsdp=1)),
    "all_gather-zigzag-moe-fsdp": ("all_gather", "zigzag", "moe", "fsdp",
                                   MeshConfig(context=4, fsdp=2)),
}


def tokens():
    return jax.random.randint(jax.random.key(1), (B, T + 1), 0, DENSE.vocab_size)


def loss_and_grads(model, mesh_config, layout_name):
    """(loss, the largest attention logit [L, N], gradients, the compiled program) of
    ``model`` under a layout on a mesh of ``mesh_config``."""
    mesh = helpers.mesh_of(mesh_config)
    layout, _, graphdef, state = helpers.build(mesh, layout_name, model, TRAIN)
    loss_fn = make_loss_fn(graphdef, dataclasses.replace(model, **layout.stack_fields), mesh,
                           layout)
    compiled = jax.jit(jax.value_and_grad(loss_fn, has_aux=True)).lower(
        state.params, tokens()).compile()
    (loss, aux), grads = compiled(state.params, tokens())
    return (loss, aux["max_attention_logit"], nnx.to_pure_dict(ungroup(grads)), compiled,
            mesh)


@pytest.fixture(scope="module")
def one_device():
    return {kind: loss_and_grads(model, MeshConfig(fsdp=1), "replicated")[:3]
            for kind, model in MODELS.items()}


@pytest.mark.parametrize("case", CASES)
def test_a_split_sequence_equals_one_device(case, one_device):
    """The loss, the largest logit and every gradient (rtol 1e-5); and what the attention
    sends over the context axis: ring only K/V blocks by collective-permute (2 (C - 1)
    a layer forward, 4 (C - 1) + 2 backward), no gather of K or V over it; all_gather
    one gather of K and one of V a layer. (Under fsdp, XLA also reshards the plain
    embedding lookup's output through a gather over another batch-like axis, with or
    without a context axis: not attention's.)"""
    strategy, order, kind, layout, mesh_config = CASES[case]
    model = dataclasses.replace(MODELS[kind], context_attention=strategy, context_order=order)
    loss, peak, grads, compiled, mesh = loss_and_grads(model, mesh_config, layout)
    want_loss, want_peak, want_grads = one_device[kind]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(peak, want_peak, rtol=1e-5)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-6)
    report = parse_collectives(compiled.as_text(), mesh)
    c, layers = mesh_config.context, model.n_layers
    # K or V gathered whole along T: [B / batch ranks, T, K / tensor, H].
    rows = B // (mesh_config.data * mesh_config.fsdp * mesh_config.expert)
    whole_kv = f"f32[{rows},{T},{model.n_kv_heads // mesh_config.tensor},{model.resolved_head_dim}]"
    sent = {"collective-permute": report.count("collective-permute", ("context",)),
            "all-gather": sum(g.buffers * g.executions
                              for g in report.select("all-gather", ("context",))
                              if g.shape.startswith(whole_kv + "{"))}
    want = ({"collective-permute": layers * (6 * (c - 1) + 2), "all-gather": 0}
            if strategy == "ring" else {"collective-permute": 0, "all-gather": 2 * layers})
    assert sent == want, report.table()


def metrics(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_the_cli_trains_and_resumes_across_context_sizes(tmp_path):
    """Three steps at context 4 (layerwise, beside data, dealt contiguous) equal context
    1 (owner; losses within 2e-4 relative), and a run saved at context 1 resumes at
    context 4 (checkpoints hold no context dimension). (Owner at context 2: the
    equality test's owner case.)"""
    # One padded vocabulary (512) at tensor 1 and 2, so every run starts from the same
    # weights (the padding changes the initial draws).
    small = (*SMALL, "--steps", "3", "--eval-every", "3", "--out-dir", str(tmp_path),
             "--model.vocab-multiple", "256")
    run = lambda name, *flags: main(*small, "--name", name, *flags)
    assert run("one", "--layout", "owner", "--checkpoint.every", "2") is None
    context4 = ("--layout", "layerwise", "--mesh.context", "4", "--mesh.data", "2",
                "--mesh.fsdp", "1", "--mesh.tensor", "1", "--model.context-order", "contiguous")
    with sharing_programs():   # the resume runs the programs of the run before it
        assert run("context4", *context4) is None
        assert run("resumed", "--resume-from", str(tmp_path / "one" / "checkpoints" / "2"),
                   *context4) is None
    want = metrics(tmp_path / "one")
    assert sorted(want) == [1, 2, 3]
    got = metrics(tmp_path / "context4")
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=2e-4)
    np.testing.assert_allclose(metrics(tmp_path / "resumed")[3], want[3], rtol=2e-4)


@pytest.mark.parametrize("flags, message", [
    (["--mesh.context", "4", "--seq-len", "36"],
     "--seq-len 36 must be divisible by 2 x --mesh.context = 8"),
    (["--mesh.context", "2", "--model.attention", "flash"],
     "--model.attention flash cannot run a sequence split over --mesh.context 2"),
    (["--mesh.context", "2", "--mesh.stage", "2", "--microbatches", "2"],
     "--mesh.stage 2 cannot yet run a sequence split over context=2"),
])
def test_a_run_the_context_axis_cannot_take_is_refused_in_one_line(flags, message):
    error = main(*SMALL, "--mesh.data", "1", "--mesh.fsdp", "-1", "--mesh.tensor", "2",
                 *flags)
    assert error is not None and error.startswith("error: ") and "\n" not in error, error
    assert message in error, error
