"""experiments.project_scale: abstract (AOT) programs measure what the allocated ones
do, the cost model's arithmetic, and one-line errors."""

import subprocess
import sys

import jax
import pytest
from flax import nnx

from experiments import project_scale as ps
from jmegatron.analysis import cost_model as cm
from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPT
from jmegatron.optim import trainable_params
from jmegatron.train import create_train_state
from jmegatron.train.config import MuonBPConfig

SMALL = ps.setting("small/fsdp8")   # bench_layouts --small's model on fsdp = 8
SMALL_BP = ps.setting("small/fsdp8/muon_bp")   # MuonBP on the fsdp layout of the same


@pytest.fixture(scope="module")
def measured():
    """project_scale's programs and rows of the small setting, every layout (compiled
    from abstract inputs)."""
    out = {}
    for name in SMALL.layouts:
        programs = ps.build_programs(SMALL, name)
        out[name] = programs, ps.compile_layout(SMALL, name, fwd_bwd=(name == "owner"),
                                                programs=programs)
    return out


@pytest.fixture(scope="module")
def rows(measured):
    return {name: row for name, (_, row) in measured.items()}


def test_auto_layouts_model_sends_what_the_compiled_train_steps_send(rows):
    """``--layout auto``'s model (``optim.auto_layout``) against the compiled train
    steps (forward, backward and update) of the small setting, from the params'
    shapes alone. fsdp is left out: XLA:CPU sums its gradients by all-reduce (2x a
    reduce-scatter's bytes), which the model does not copy (accelerators
    reduce-scatter)."""
    from jmegatron.optim.auto_layout import estimate
    from jmegatron.train import TrainConfig
    from jmegatron.train.registry import OPTIMIZERS
    cfg = ps.model_config(SMALL.model)
    params = nnx.state(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))
    modelled = {e.layout: e.comm.nvlink_bytes + e.comm.ib_bytes for e in estimate(
        params, rows["owner"]["mesh_shape"], "h100",
        cost=OPTIMIZERS["muon"].matrix_flops(TrainConfig()))}
    for name in ("replicated", "layerwise", "owner"):
        assert modelled[name] == pytest.approx(rows[name]["train_bytes_per_device"], rel=0.02), \
            (name, modelled[name], rows[name]["train_bytes_per_device"])


def test_project_scale_prints_autos_choice_next_to_the_compiled_fastest(rows):
    """auto's choice for the small setting against its compiled programs projected on
    the cpu preset (measured by bench_layouts --small: layerwise 659, owner 672 ms).
    Not on h100: there this model's step takes 0.4 ms, launch latencies decide, and
    the model's launch counts are rough (it picks owner at 1.18x layerwise's step)."""
    projected = [dict(r) for r in rows.values()]
    ps.add_projections(projected, ["cpu"])
    (row,) = ps.auto_rows(projected, ["cpu"])
    steps = {r["variant"]: r["cpu_step_ms"] for r in projected if r["variant"] in ps.LAYOUT_NAMES}
    assert row["fastest"] == min(steps, key=steps.get)
    assert row["chosen_ms"] == steps[row["auto"]]
    assert row["vs_fastest"] <= 1.10, row   # the choice is (nearly) the compiled fastest


@pytest.fixture(scope="module")
def muon_bp_row():
    return ps.compile_layout(SMALL_BP, "fsdp")


@pytest.mark.parametrize("layout_name", SMALL.layouts)
def test_abstract_bytes_equal_the_allocated_programs(measured, layout_name):
    """The same jitted steps on allocated state and tokens (bench_layouts' inputs):
    JAX reuses the compiled program only where the abstract inputs' shapes and
    shardings equal the real ones, and otherwise compiles again; either way the
    reports must agree."""
    p, row = measured[layout_name]
    _, state = create_train_state(lambda: GPT(p.cfg, nnx.Rngs(0)), p.optimizer.tx,
                                  p.optimizer.plan)
    tokens = jax.device_put(jax.random.randint(jax.random.key(0), p.tokens.shape, 0,
                                               p.cfg.vocab_size), p.tokens.sharding)
    params = trainable_params(state.params)
    train = hlo_collectives(p.train_step, state, tokens)
    # Gradients shaped and placed like the params (bench_layouts' jitted gradients
    # come out so; checked once by hand, kept out of the test for its compile time).
    opt = hlo_collectives(p.opt_step, params, params, state.opt_state)
    assert row["train_bytes_per_device"] == train.bytes_per_device() > 0
    assert row["train_collectives"] == train.launches()
    assert row["opt_bytes_per_device"] == opt.bytes_per_device()
    if layout_name == "owner":   # bench_layouts' forward + backward bytes
        fwd_bwd = hlo_collectives(
            jax.jit(jax.value_and_grad(lambda q, t: p.loss_fn(q, t)[0])), state.params, tokens)
        assert row["fwd_bwd_bytes_per_device"] == fwd_bwd.bytes_per_device() > 0
        assert row["opt_bytes_per_device"] == 0   # MatrixFSDP's claim, at any size
    held = sum(x.addressable_shards[0].data.nbytes
               for x in jax.tree.leaves((state.params, state.opt_state)))
    # The train step's arguments: params + state (bench_layouts' number), the batch
    # shard and the two int32 counters.
    assert row["state_bytes_per_device"] == held + tokens.addressable_shards[0].data.nbytes + 8


def _nccl_by_hand(c, bus_bytes_per_s: float) -> float:
    """One NVLink node: NCCL's ring over the group, the faster of LL (6.6 us + 0.6 us a
    step, half the bandwidth) and Simple (8.4 us + 3.4 us a step)."""
    steps = {"all-reduce": 2 * (c.group_size - 1), "collective-permute": 1}.get(
        c.kind, c.group_size - 1)
    simple = 8.4e-6 + steps * 3.4e-6 + c.bytes_per_device / bus_bytes_per_s
    ll = 6.6e-6 + steps * 0.6e-6 + c.bytes_per_device / (bus_bytes_per_s / 2)
    return c.executions * min(simple, ll)


def test_projection_by_hand_for_the_owner_layout(rows):
    """The owner train step on h100 (8 GPUs, one node: every collective on NVLink)."""
    row = rows["owner"]
    colls = ps.collectives_of(row, "train")
    assert all(cm.within_node(c.axes, row["mesh_shape"], 8) for c in colls)
    # Every collective by NCCL's ring at 370 of NVLink's 450 GB/s; none is widened on
    # this fp32 model, so its bytes are hlo's.
    comm = sum(_nccl_by_hand(c, 370e9) for c in colls)
    assert sum(c.bytes_per_device * c.executions for c in colls) == row[
        "train_bytes_per_device"]
    # FLOPs at 40% of 989 TFLOP/s: the model's 6N-style count of 8 x 128 tokens over 8
    # devices plus the owner's share of Newton-Schulz (from the compiled program).
    cfg = ps.model_config("small")
    flops = cfg.flops_per_token(128) * 8 * 128 / 8 + row["opt_flops_per_device"]
    compute = flops / (0.40 * 989e12)
    got = ps.project_row(row, "h100")
    assert got["h100_step_ms"] == pytest.approx(1e3 * (compute + comm), rel=1e-12)
    assert got["h100_step_overlap_ms"] == pytest.approx(1e3 * max(compute, comm), rel=1e-12)
    assert got["h100_opt_ms"] == pytest.approx(1e3 * row["opt_flops_per_device"]
                                                / (0.40 * 989e12), rel=1e-12)
    # Owner's Newton-Schulz FLOPs are replicated's over the 8 owners (8 layers, 1 each).
    assert row["opt_flops_per_device"] == pytest.approx(
        rows["replicated"]["opt_flops_per_device"] / 8, rel=0.02)


def test_links_and_latency_by_hand():
    """A 2-node mesh (data=2 x fsdp=8 on h100): an fsdp group stays in its node, a data
    group crosses nodes; NCCL's latencies grow with the ring's steps, and a small
    message takes the low-latency protocol."""
    shape = {"data": 2, "fsdp": 8, "expert": 1, "tensor": 1}
    hw = cm.hardware("h100")
    inside = ps._Coll("all-gather", ("fsdp",), 8, 3, 7 / 8 * 80e6)     # 70 MB sent, 3 times
    across = ps._Coll("all-reduce", ("data",), 2, 2, 2 * 1 / 2 * 40e6)  # 40 MB sent, twice
    tiny = ps._Coll("all-reduce", ("fsdp",), 8, 1, 2 * 7 / 8 * 4096)
    cost = cm.comm_cost([inside, across, tiny], shape, hw)
    # Simple on NVLink: 8.4 us + 7 steps x 3.4 us, 370 GB/s; Simple over InfiniBand:
    # 8.4 us + 2 network steps x 14 us, 0.96 x 50 GB/s; LL for 4 KB: 6.6 us + 14 x 0.6 us.
    assert cost.seconds == pytest.approx(3 * (32.2e-6 + 70e6 / 370e9)
                                         + 2 * (36.4e-6 + 40e6 / 48e9)
                                         + 15.0e-6 + 7168 / 185e9)
    assert (cost.nvlink_bytes, cost.ib_bytes, cost.launches) == (210e6 + 7168, 80e6, 6)
    assert not cm.within_node(("data", "fsdp"), shape, 8)
    assert cm.within_node(("data",), shape, 16)   # one NVLink domain of 16 holds both
    assert cm.nodes_spanned(("data", "fsdp"), 16, shape, 8) == 2
    # The measured CPU preset: one latency per collective, whatever its group.
    cpu = cm.hardware("cpu")
    assert cm.comm_cost([inside], shape, cpu).seconds == pytest.approx(
        3 * (250e-6 + 70e6 / 0.5e9))


def test_bad_names_fail_in_one_line():
    for call, word in ((lambda: cm.hardware("tpu9"), "hardware"),
                       (lambda: ps.model_config("gpt5"), "model"),
                       (lambda: ps.setting("nope"), "setting")):
        with pytest.raises(ValueError, match=f"unknown {word}") as err:
            call()
        assert "\n" not in str(err.value)
    out = subprocess.run([sys.executable, "-m", "experiments.project_scale", "--hardware",
                          "tpu9"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "project_scale: unknown hardware 'tpu9'; choose one of "
        f"{tuple(cm.HARDWARE)}"]


def test_muon_bp_collectives_count_at_the_share_of_steps_they_run_in(rows, muon_bp_row):
    """MuonBP on fsdp 8 (period 5): only its full-step branches communicate in the
    optimizer step, each collective weighted 1/P, so the optimizer step sends Muon's
    fsdp bytes / P per step and the train step Muon's less (P-1)/P of them. The Muon
    rows (period 1) carry no weight and integer counts, as before."""
    period = MuonBPConfig().period
    muon, bp = rows["fsdp"], muon_bp_row
    assert bp["period"] == ps.optimizer_period(SMALL_BP, "fsdp") == period == 5
    for row in rows.values():
        assert row["period"] == 1 and type(row["train_collectives"]) is int
        assert {c["weight"] for c in row["train_collective_list"] + row["opt_collective_list"]
                } <= {1.0}
    # No block-branch ((P-1)/P) collective and none outside the conditionals.
    assert {c["weight"] for c in bp["opt_collective_list"]} == {1 / period}
    assert bp["opt_bytes_per_device"] == pytest.approx(muon["opt_bytes_per_device"] / period,
                                                       rel=1e-12)
    assert bp["opt_gpu_bytes_per_device"] == pytest.approx(bp["opt_bytes_per_device"], rel=1e-12)
    assert bp["train_bytes_per_device"] == pytest.approx(
        muon["train_bytes_per_device"] - (period - 1) / period * muon["opt_bytes_per_device"],
        rel=1e-9)
    assert {c["weight"] for c in bp["train_collective_list"]} == {1.0, 1 / period}
    assert bp["opt_collectives"] == pytest.approx(
        sum(c["executions"] for c in bp["opt_collective_list"]) / period)
    # The projection reads the weighted executions.
    colls = ps.collectives_of(bp, "opt")
    assert {c.executions for c in colls} == {1 / period}
    assert sum(c.bytes_per_device * c.executions for c in colls) == pytest.approx(
        bp["opt_bytes_per_device"], rel=1e-12)
    # FLOPs: XLA charges each conditional its full branch (Muon's step); averaged over
    # the period, one full step and P - 1 block steps on 1/8 blocks.
    assert bp["opt_flops_xla_per_device"] == pytest.approx(muon["opt_flops_per_device"],
                                                           rel=1e-3)
    assert muon["opt_flops_per_device"] / period < bp["opt_flops_per_device"] < (
        muon["opt_flops_per_device"] / period * 1.2)


def test_optimizer_table_compares_with_muons_fsdp_row(rows, muon_bp_row):
    scale = [dict(r) for r in (*rows.values(), muon_bp_row)]   # the fixtures stay as built
    ps.add_projections(scale, ["h100"])
    table = ps.optimizer_rows(scale, ["h100"])
    assert [(r["optim"], r["variant"]) for r in table] == [
        *(("muon", v) for v in SMALL.layouts), ("muon_bp", "fsdp")]
    by = {(r["optim"], r["variant"]): r for r in table}
    assert by["muon", "fsdp"]["opt_vs_muon"] == 1.0
    assert by["muon_bp", "fsdp"]["opt_vs_muon"] == pytest.approx(0.2, rel=1e-12)
    assert by["muon_bp", "fsdp"]["h100_opt_ms"] < by["muon", "fsdp"]["h100_opt_ms"]
    # The model table's "vs fsdp" of the MuonBP row is against Muon's fsdp row.
    bp = scale[-1]
    assert bp["h100_opt_vs_fsdp"] == pytest.approx(by["muon", "fsdp"]["h100_opt_ms"]
                                                   / by["muon_bp", "fsdp"]["h100_opt_ms"])
    assert (ps.count_text(87), ps.count_text(81.4), ps.count_text(7.0)) == ("87", "81.4", "7")


def test_optimizer_settings_selection():
    chosen = lambda *argv: ps.selected(ps.parser().parse_args(list(argv)))
    reduced = [s.name for s in ps.SETTINGS if s.group == "optimizers"]
    assert len(reduced) == 6 and all(ps.setting(n).layouts == ("fsdp",) for n in reduced)
    assert set(reduced) <= set(chosen()) and not set(reduced) & set(chosen("--no-optimizers"))
    assert chosen("--only-optimizers") == [
        name for n in (8, 32, 64) for name in (f"llama-7b/fsdp{n}", f"llama-7b/fsdp{n}/muon_bp",
                                               f"llama-7b/fsdp{n}/dion2")]
    assert "small/fsdp8/muon_bp" not in chosen()


def test_a_pipelined_setting_projects_its_bubble_and_ticks():
    """bench_layouts' small model on stage 2 x fsdp 4, M = 2 (layerwise): the compiled
    train step sends the activations and their gradients across the stages 2 (M + S - 1)
    times; the projection stretches the layers' FLOPs by 1 / (1 - bubble), runs the head
    on both stages, and adds the optimizer step after the pipeline."""
    s = ps.setting("small/pp2-fsdp4")
    row = ps.compile_layout(s, "layerwise")
    assert (row["stages"], row["microbatches"], row["schedule"]) == (2, 2, "gpipe")
    assert row["bubble"] == pytest.approx(1 / 3)
    permutes = [c for c in ps.collectives_of(row, "train") if c.kind == "collective-permute"]
    assert permutes and all(c.axes == ("stage",) for c in permutes)
    # (XLA drops a send nothing receives where it unrolls gpipe's one tick of both.)
    assert 2 * (2 + 2 - 1) - 1 <= sum(c.executions for c in permutes) <= 2 * (2 + 2 - 1)
    # The pipeline's split of the model's FLOPs: the head counted once a stage.
    cfg = ps.model_config("small")
    head = 6 * cfg.d_model * cfg.vocab * 8 * 128 / 8
    assert row["layer_flops_per_device"] + row["head_flops_per_device"] / 2 == pytest.approx(
        row["model_flops_per_device"], rel=1e-12)
    flops = (row["layer_flops_per_device"] * 3 / 2 + 2 * head + row["opt_flops_per_device"])
    assert ps.step_flops(row) == pytest.approx(flops, rel=1e-12)
    got = ps.project_row(row, "h100")
    assert got["h100_tflops_per_gpu"] == pytest.approx(
        row["model_flops_per_device"] / got["h100_step_ms"] / 1e9, rel=1e-12)


def test_pipeline_settings_selection():
    chosen = lambda *argv: ps.selected(ps.parser().parse_args(list(argv)))
    pipelines = [s.name for s in ps.SETTINGS if s.group == "pipeline"]
    assert not set(pipelines) & set(chosen())
    assert chosen("--only-pipelines") == ["llama-70b/fsdp64", "llama-70b/pp4-fsdp16"]
    assert chosen("--only-pipelines", "--slow") == pipelines
    assert ps.setting("kimi-k2/pp4-ep64").devices == 256
    assert abs(ps.model_config("kimi-k2").param_count() / 1e12 - 1.03) < 0.01
