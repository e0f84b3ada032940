"""``--layout auto`` (``jmegatron.optim.auto_layout``): its choice against what
``experiments.bench_layouts`` measured, its memory limit, the layouts a mesh
allows, ``make_plan(..., layout="auto")`` and the trainer's choice. (Its bytes
against the compiled programs: ``tests/test_project_scale.py``, which compiles them.)

Nothing here compiles: the model reads abstract params.
"""

import dataclasses
import itertools
import re

import jax
import pytest
from flax import nnx

from experiments.bench_layouts import model_config as bench_model
from experiments.presets import qwen3_moe_tiny, tiny
from experiments.project_scale import model_config as scale_model
from jmegatron.analysis.cost_model import preset_for
from jmegatron.models import GPT
from jmegatron.optim import make_plan
from jmegatron.optim.auto_layout import MEMORY_SHARE, candidates, estimate
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import LAYOUTS, make_layout
from jmegatron.sharding.traffic import LeafTraffic, RunOptions
from jmegatron.train.config import TrainConfig
from jmegatron.train.planning import plan_run
from jmegatron.train.registry import OPTIMIZERS

MUON = OPTIMIZERS["muon"].matrix_flops(TrainConfig())
MESH = dict(stage=1, data=1, fsdp=1, tensor=1, expert=1)

# Train-step milliseconds per layout that bench_layouts measured on the 2-core CPU
# (docs/benchmarks.md): the dense model at 1dd852f (2026-12-02, "Optimizer
# layouts"), 12 layers on 8 owners at 6f0f57e ("padded layer counts"), the MoE
# model at f0d751b (2026-12-03, "mixture of experts", the --keep-gathered run).
MEASURED = {
    "dense": (bench_model(False), dict(fsdp=8),
              dict(replicated=13048, layerwise=2839, fsdp=11223, owner=3210)),
    "padded": (bench_model(True, 12), dict(fsdp=8),
               dict(replicated=4756, layerwise=1596, fsdp=4447, owner=1838)),
    "moe": (bench_model(True, 8, 8), dict(fsdp=4, expert=2),
            dict(replicated=5784, layerwise=2352, fsdp=5119, owner=2619)),
    # bench_layouts --small --data 2 at a77ef83 (2026-12-05): both owner groups.
    "hybrid": (bench_model(True), dict(data=2, fsdp=4),
               {"replicated": 3123, "layerwise": 1126, "fsdp": 2935, "owner": 1343,
                "owner over data+fsdp": 1081}),
}
# Two layouts whose measured times are closer than this are a tie: the ratios of
# owner and layerwise moved by up to 1.15x between days on these shared cores
# (docs/benchmarks.md, "Optimizer layouts").
NOISE = 1.25


def abstract(model):
    return nnx.state(nnx.eval_shape(lambda: GPT(model, nnx.Rngs(0))))


@pytest.mark.parametrize("setting", MEASURED)
def test_the_choice_follows_the_measured_bench_layouts_order(setting):
    model, mesh, measured = MEASURED[setting]
    ranked = estimate(abstract(model), {**MESH, **mesh}, "cpu", cost=MUON)
    modelled = {e.label: e.seconds for e in ranked}
    assert set(modelled) == set(measured)
    fastest = min(measured.values())
    assert measured[ranked[0].label] <= NOISE * fastest, (ranked[0].label, measured)
    for a, b in itertools.permutations(measured, 2):
        if measured[a] * NOISE < measured[b]:   # measured clearly faster
            assert modelled[a] < modelled[b], (a, b, modelled)


def test_a_model_too_large_to_replicate_is_not_replicated():
    params = abstract(scale_model("llama-7b"))
    by_name = {e.layout: e for e in estimate(params, {**MESH, "data": 8}, "h100", cost=MUON)}
    assert not by_name["replicated"].fits   # 7B: fp32 params, gradients and state
    assert by_name["replicated"].memory_bytes > MEMORY_SHARE * 80e9
    ranked = estimate(params, {**MESH, "fsdp": 8}, "h100", cost=MUON)
    assert ranked[0].layout in ("owner", "layerwise"), [e.describe() for e in ranked]
    assert {e.layout for e in ranked[2:]} == {"fsdp", "replicated"}


def test_fp32_gradient_sums_are_priced_in_fp32():
    """Gradient sums are priced in the gradients' dtype (``GPTConfig.grad_reduce_dtype``):
    a bf16 7B model at fsdp 8 sends more under every layout with fp32 sums, and its
    layerwise masters stay replicated (more memory: ``Layout.masters_on_owners``)."""
    bf16 = dataclasses.replace(scale_model("llama-7b"), dtype="bfloat16")
    modelled = lambda model: {e.layout: e for e in estimate(
        abstract(model), {**MESH, "fsdp": 8}, "h100", cost=MUON)}
    narrow, wide = modelled(bf16), modelled(dataclasses.replace(bf16, grad_reduce_dtype="float32"))
    sent = lambda e: e.comm.nvlink_bytes + e.comm.ib_bytes
    for name in narrow:
        assert sent(wide[name]) > sent(narrow[name]), name
    assert wide["layerwise"].memory_bytes > narrow["layerwise"].memory_bytes
    assert wide["owner"].memory_bytes == narrow["owner"].memory_bytes


@pytest.mark.parametrize("mesh, allowed", [
    (dict(), ("replicated",)),
    (dict(tensor=8), ("replicated",)),
    (dict(data=8), ("replicated", "layerwise", "owner over data+fsdp")),
    (dict(data=2, fsdp=2, tensor=2),
     ("replicated", "layerwise", "fsdp", "owner", "owner over data+fsdp")),
])
def test_the_layouts_a_mesh_allows(mesh, allowed):
    assert tuple(c.label for c in candidates({**MESH, **mesh})) == allowed
    # Prefetch runs manual over the batch axes: not with tensor parallelism.
    fetched = [c.label for c in candidates({**MESH, **mesh}, prefetch=True) if c.prefetch]
    assert fetched == ([] if mesh.get("tensor", 1) > 1 else
                       [f"{c}+prefetch" for c in allowed if c.startswith("owner")])


BF16_7B = dataclasses.replace(scale_model("llama-7b"), dtype="bfloat16")


def test_the_owner_group_stays_in_a_node_and_spans_it():
    """The owner group (``--owner-group``): over data x fsdp where both fit in one
    node (half the memory, half the optimizer's layers per rank), over fsdp alone
    where data crosses nodes (its gathers would go over InfiniBand)."""
    params = abstract(BF16_7B)
    one_node = {e.label: e for e in estimate(params, {**MESH, "data": 2, "fsdp": 4}, "h100",
                                             cost=MUON)}
    assert one_node["owner over data+fsdp"].seconds < one_node["owner"].seconds
    assert one_node["owner over data+fsdp"].memory_bytes < one_node["owner"].memory_bytes
    two_nodes = {e.label: e for e in estimate(params, {**MESH, "data": 2, "fsdp": 8}, "h100",
                                              cost=MUON)}
    assert two_nodes["owner"].seconds < two_nodes["owner over data+fsdp"].seconds
    # Over fsdp only each shard's gradient sum crosses nodes (hybrid sharding).
    assert two_nodes["owner over data+fsdp"].comm.ib_bytes > 10 * two_nodes["owner"].comm.ib_bytes


def test_prefetch_is_chosen_where_a_gpu_hides_the_gathers():
    """7B at fsdp 8 (4 groups of 8 layers), 16K tokens a device: on a GPU prefetch
    hides 3/4 of each pass's group collectives behind the layers' compute; XLA:CPU
    overlaps nothing; without tokens nothing hides."""
    params, mesh = abstract(BF16_7B), {**MESH, "fsdp": 8}
    ranked = estimate(params, mesh, "h100", cost=MUON, prefetch=True, tokens=16384)
    by_label = {e.label: e for e in ranked}
    assert ranked[0].label == "owner+prefetch", [e.describe() for e in ranked]
    fetched, plain = by_label["owner+prefetch"], by_label["owner"]
    assert 0 < fetched.hidden_s < fetched.comm.seconds
    assert fetched.comm.seconds == pytest.approx(plain.comm.seconds, rel=1e-6)  # 4 groups
    assert fetched.memory_bytes > plain.memory_bytes   # one group more whole
    fewer = {e.label: e for e in estimate(params, mesh, "h100", cost=MUON, prefetch=True,
                                          tokens=16)}["owner+prefetch"]
    assert fewer.hidden_s < fetched.hidden_s   # compute-bound: only what 16 tokens take
    on_cpu = {e.label: e for e in estimate(params, mesh, "cpu", cost=MUON, prefetch=True,
                                           tokens=16384)}
    assert on_cpu["owner+prefetch"].hidden_s == 0
    none = {e.label: e for e in estimate(params, mesh, "h100", cost=MUON, prefetch=True)}
    assert none["owner+prefetch"].hidden_s == 0


def test_the_trainer_keeps_an_owner_group_it_is_given(tmp_path):
    cfg = dataclasses.replace(tiny(), out_dir=str(tmp_path))
    assert "owner over data+fsdp" in plan_run(cfg).choice
    fixed = plan_run(dataclasses.replace(cfg, owner_group="fsdp")).choice
    assert "owner" in fixed and "data+fsdp" not in fixed
    with pytest.raises(ValueError, match="--owner-group data\\+fsdp applies to --layout owner"):
        plan_run(dataclasses.replace(cfg, layout="fsdp", owner_group="data+fsdp"))
    # --model.prefetch given: every owner candidate is prefetched (tensor 1 only).
    fetched = dataclasses.replace(cfg, mesh=MeshConfig(data=2, fsdp=4, tensor=1), fit_mesh=False,
                                  model=dataclasses.replace(cfg.model, prefetch=True))
    line = plan_run(fetched).choice
    assert line.count("owner") == line.count("+prefetch") == 2, line
    assert not re.search(r"(replicated|layerwise|; fsdp) ", line), line   # owner's option


def test_auto_skips_what_a_layout_refuses_and_says_why(tmp_path):
    """The MoE preset alternates dense and MoE layers, which owner cannot group (over
    data+fsdp: its fsdp axis is 1, where owner groups nothing and runs them): auto
    ranks the others and names what it skipped (``Layout.check``, the refusal
    --layout owner gives). Where no layout can run the model, one line says why."""
    cfg = dataclasses.replace(qwen3_moe_tiny(), out_dir=str(tmp_path))
    plan = plan_run(cfg)
    assert plan.layout.name != "owner"
    owner_refusal = "the MoE layers alternate with dense ones (--model.moe.every 2)"
    assert f"skipped owner over data+fsdp: the owner layout gathers" in plan.choice
    assert owner_refusal in plan.choice and "\n" not in plan.choice
    with pytest.raises(ValueError, match=re.escape(owner_refusal)):
        plan_run(dataclasses.replace(cfg, layout="owner", owner_group="data+fsdp"))
    staged = dataclasses.replace(cfg, mesh=MeshConfig(stage=2, data=2, fsdp=1, expert=2),
                                 fit_mesh=False, microbatches=2)
    with pytest.raises(ValueError, match=r"^pipeline stages run each kind of layer as one "
                                         r"stack.*: set --model.moe.every 1"):
        plan_run(staged)   # every layout refuses it alike: said once
    wide = dataclasses.replace(tiny(), out_dir=str(tmp_path),
                               mesh=MeshConfig(data=1, fsdp=2, tensor=4), fit_mesh=False)
    with pytest.raises(ValueError, match=r"^kv_heads=2 is not divisible by tensor=4"):
        plan_run(wide)


def test_presets_by_device_kind():
    assert preset_for("cpu", "cpu") == ("cpu", True)
    assert preset_for("gpu", "NVIDIA H100 80GB HBM3") == ("h100", True)
    assert preset_for("gpu", "NVIDIA H200") == ("h200", True)
    assert preset_for("gpu", "Tesla T4") == ("h100", False)


def test_make_plan_chooses_among_the_layouts_the_params_are_stacked_for():
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    model = tiny().model
    ranked = [e.layout for e in estimate(abstract(model), mesh.shape, "cpu")]
    flat = make_plan(abstract(model), mesh, "auto")
    assert flat.layout.name == next(name for name in ranked if name != "owner")
    grouped = abstract(dataclasses.replace(model, layer_group=8))
    assert make_plan(grouped, mesh, "auto").layout.name == estimate(
        grouped, mesh.shape, "cpu")[0].layout
    # On data 2 x fsdp 4 the owner group must match the model's groups of layers.
    hybrid = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    for group, axes in ((4, ("fsdp",)), (8, ("data", "fsdp"))):
        params = abstract(dataclasses.replace(model, layer_group=group))
        layout = make_plan(params, hybrid, "auto").layout
        assert (layout.name, layout.owner_axes) == ("owner", axes)


def test_the_default_run_chooses_the_layout_it_measured_fastest(tmp_path):
    """``python -m experiments.train`` (data 2 x fsdp 2 x tensor 2) with each layout,
    2026-12-05: 300 steps in 86 s (layerwise), 101 s (owner), 103 s (replicated),
    104 s (fsdp), every one to val loss 1.539."""
    plan = plan_run(dataclasses.replace(tiny(), out_dir=str(tmp_path)))
    assert plan.layout.name == "layerwise"
    assert plan.choice.startswith("layout auto: layerwise "), plan.choice
    assert "runner-up owner" in plan.choice and "(modelled on cpu" in plan.choice
    assert jax.device_count() == 8


def test_every_layout_models_its_own_traffic():
    """``Layout.traffic`` is each layout's (the base class has none): a leaf of two
    layers split over fsdp 2 with copies over data 2 sends something under each."""
    sizes = {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "tensor": 1}
    leaf = LeafTraffic(elements=64, local=32, gathered=("fsdp",), reduced=("data",),
                       sizes=sizes, master=4, wire=2, summed=2, layers=2, matrix_flops=1.0,
                       owners=2)
    for name in LAYOUTS:
        sent = make_layout(name, sizes).traffic(leaf, RunOptions())
        assert sent and all(t.bytes_per_device > 0 for t in sent), name
