"""experiments.project_scale: abstract (AOT) programs measure what the allocated ones
do, the cost model's arithmetic, and one-line errors."""

import subprocess
import sys

import jax
import pytest
from flax import nnx

from experiments import project_scale as ps
from jmegatron.models import GPT
from jmegatron.optim import trainable_params
from jmegatron.sharding import cost_model as cm
from jmegatron.sharding import hlo_collectives
from jmegatron.train import create_train_state

SMALL = ps.setting("small/fsdp8")   # bench_layouts --small's model on fsdp = 8


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


def test_projection_by_hand_for_the_owner_layout(rows):
    """The owner train step on h100 (8 GPUs, one node: every collective on NVLink)."""
    row = rows["owner"]
    hw = cm.hardware("h100")
    colls = ps.collectives_of(row, "train")
    assert all(cm.within_node(c.axes, row["mesh_shape"], 8) for c in colls)
    # Every collective: executions * (10 us + bytes / 450 GB/s); none is widened on
    # this fp32 model, so its bytes are hlo's.
    comm = sum(c.executions * (10e-6 + c.bytes_per_device / 450e9) for c in colls)
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
    group crosses nodes."""
    shape = {"data": 2, "fsdp": 8, "expert": 1, "tensor": 1}
    hw = cm.hardware("h100")
    inside = ps._Coll("all-gather", ("fsdp",), 8, 3, 7 / 8 * 80e6)     # 70 MB sent, 3 times
    across = ps._Coll("all-reduce", ("data",), 2, 2, 2 * 1 / 2 * 40e6)  # 40 MB sent, twice
    cost = cm.comm_cost([inside, across], shape, hw)
    assert cost.seconds == pytest.approx(3 * (10e-6 + 70e6 / 450e9) + 2 * (25e-6 + 40e6 / 50e9))
    assert (cost.nvlink_bytes, cost.ib_bytes, cost.launches) == (210e6, 80e6, 5)
    assert not cm.within_node(("data", "fsdp"), shape, 8)
    assert cm.within_node(("data",), shape, 16)   # one NVLink domain of 16 holds both


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
