"""Mixture of experts: router, losses and capacity against a token-by-token
reference; expert parallelism against one device; communication from the HLO."""

import dataclasses
import functools
import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding

from experiments import train as train_cli
from helpers import ns_roundoff, relative_miss
from jmegatron.analysis import parse_collectives
from jmegatron.models import (GPT, GPTConfig, MoE, MoEConfig, balance_expert_bias,
                              create_sharded, cross_entropy, moe_losses, state_shardings,
                              validate_sharding)
from jmegatron.models import dispatch
from jmegatron.models.config import ConfigError
from jmegatron.models.moe import ExpertBias
from jmegatron.optim import PlanSpec, describe, make_plan, muon, scale_by_muon, trainable_params
from jmegatron.sharding import (DEFAULT_RULES, MeshConfig, activation_sharding, logical_to_spec,
                                make_mesh)
from jmegatron.sharding.layouts import make_layout

MOE = MoEConfig(n_experts=8, top_k=2, d_ff=16)
CFG = GPTConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=32, moe=MOE)
B, T = 8, 4                                     # 32 tokens, 64 assignments

MESHES = {
    "expert2": MeshConfig(data=4, fsdp=1, expert=2),
    "expert4": MeshConfig(data=2, fsdp=1, expert=4),
    "expert8": MeshConfig(fsdp=1, expert=8),
    "expert2_tensor2": MeshConfig(data=2, fsdp=1, expert=2, tensor=2),
}


def inputs():
    x = jax.random.normal(jax.random.key(1), (B, T, CFG.d_model))
    cotangent = jax.random.normal(jax.random.key(2), (B, T, CFG.d_model))
    return x, cotangent


# --- the reference: one token at a time, in float64 numpy -----------------------

def reference(x, weights, moe: MoEConfig, groups: int = 1, bias=None):
    """(output [S, D], counts [E], dropped, aux loss, z-loss) token by token; capacity
    queues are per group of S / groups consecutive tokens (one device's tokens)."""
    x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    router, gate_up, down = (np.asarray(weights[k], np.float64)
                             for k in ("router", "gate_up", "down"))
    s, e, k = x.shape[0], moe.n_experts, moe.top_k
    logits = x @ router
    if moe.scoring == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else np.asarray(bias))
    cap = dispatch.capacity_slots(s // groups, k, e, moe.capacity_factor)
    y, counts, dropped = np.zeros_like(x), np.zeros(e), 0
    for group in np.split(np.arange(s), groups):
        queue = np.zeros(e)
        for t in group:
            chosen = np.argsort(-choice[t], kind="stable")[:k]
            w = scores[t, chosen] / (scores[t, chosen].sum() if moe.normalize_top_k else 1)
            for i, w_i in zip(chosen, w):
                counts[i] += 1
                queue[i] += 1
                if moe.dispatch == "capacity" and queue[i] > cap:
                    dropped += 1
                    continue
                g, u = x[t] @ gate_up[i, :, 0], x[t] @ gate_up[i, :, 1]
                y[t] += w_i * ((g / (1 + np.exp(-g)) * u) @ down[i])
    probs = scores / scores.sum(-1, keepdims=True)
    aux = e * np.sum(counts / (s * k) * probs.mean(0))
    log_z = np.log(np.exp(logits).sum(-1))
    return y, counts, dropped, aux, np.mean(log_z ** 2)


@functools.cache
def initial_state(with_bias: bool) -> nnx.State:
    moe = dataclasses.replace(MOE, bias_rate=0.1 if with_bias else 0.0)
    return nnx.split(create_sharded(lambda: MoE(dataclasses.replace(CFG, moe=moe),
                                                nnx.Rngs(0)), None))[1]


def placed(state: nnx.State, mesh) -> nnx.State:
    """A copy of ``state`` on its shardings on ``mesh`` (as ``create_sharded`` makes it)."""
    if mesh is None:
        return jax.tree.map(lambda x: x, state)   # new variables, same arrays
    return jax.device_put(state, state_shardings(state, mesh))


def layer(cfg: GPTConfig, mesh):
    """(graphdef, params) of one MoE layer of ``cfg`` on ``mesh``; the same params for
    every dispatch and exchange option (compiled once)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(0))))[0]
    return graphdef, placed(initial_state(bool(cfg.moe.bias_rate)), mesh)


def forward(cfg: GPTConfig, mesh=None, x=None):
    graphdef, state = layer(cfg, mesh)
    with activation_sharding(mesh):
        y, stats = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, inputs()[0] if x is None
                                                                      else x)
    return state, y, stats


def weights_of(state):
    return {k: state[k][...] for k in ("router", "gate_up", "down")}


@pytest.mark.parametrize("option", [
    {}, {"scoring": "sigmoid", "bias_rate": 0.1, "normalize_top_k": False}])
def test_router_output_and_losses_equal_the_reference(option):
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, **option))
    graphdef, state = layer(cfg, None)
    bias = None
    if cfg.moe.bias_rate:   # a bias that changes choices: scores are ~0.5 +- 0.01
        bias = jax.random.uniform(jax.random.key(3), (MOE.n_experts,), maxval=0.05)
        state["expert_bias"].set_value(bias)
    x = inputs()[0]
    y, stats = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    y_ref, counts, _, aux, z = reference(x, weights_of(state), cfg.moe, bias=bias)
    np.testing.assert_allclose(y.reshape(-1, CFG.d_model), y_ref, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(stats["load"] * B * T * MOE.top_k, counts)
    np.testing.assert_allclose(stats["aux_loss"], aux, rtol=1e-5)
    np.testing.assert_allclose(stats["z_loss"], z, rtol=1e-5)
    assert stats["dropped"] == 0
    if bias is not None:   # the bias moved choices (else this case tests nothing new)
        _, unbiased, *_ = reference(x, weights_of(state), cfg.moe)
        assert not np.array_equal(unbiased, counts)


@pytest.mark.parametrize("mesh_name, factor", [(None, 0.5), ("expert4", 1.0)])
def test_capacity_drops_exactly_what_the_rule_says(mesh_name, factor):
    """Each device's tokens fill each expert's C = ceil(factor * S * k / E) slots in
    token order; later assignments are dropped (output zero)."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, dispatch="capacity",
                                                           capacity_factor=factor))
    mesh = None if mesh_name is None else make_mesh(MESHES[mesh_name])
    groups = 1 if mesh is None else mesh.shape["data"] * mesh.shape["expert"]
    x = inputs()[0]
    if mesh is not None:
        x = jax.device_put(x, NamedSharding(mesh, logical_to_spec(("batch",), DEFAULT_RULES)))
    state, y, stats = forward(cfg, mesh, x)
    y_ref, counts, dropped, _, _ = reference(x, weights_of(state), cfg.moe, groups)
    assert dropped > 0
    np.testing.assert_allclose(stats["dropped"] * B * T * MOE.top_k, dropped)
    np.testing.assert_array_equal(stats["load"] * B * T * MOE.top_k, counts)
    np.testing.assert_allclose(y.reshape(-1, CFG.d_model), y_ref, rtol=1e-4, atol=1e-7)


# --- expert parallelism against one device ---------------------------------------

def lowered_step(cfg: GPTConfig, mesh):
    """The lowered (output, stats) and gradients (of params and input) of
    sum(y * c) + aux + z-loss, with its arguments."""
    graphdef, state = layer(cfg, mesh)

    def loss(state, x, c):
        with activation_sharding(mesh):
            y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * c) + 0.1 * stats["aux_loss"] + 0.1 * stats["z_loss"], (y, stats)

    x, c = inputs()
    if mesh is not None:
        batch = NamedSharding(mesh, logical_to_spec(("batch", "seq", "act_embed"),
                                                    DEFAULT_RULES))
        x, c = jax.device_put(x, batch), jax.device_put(c, batch)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return step.lower(state, x, c), (state, x, c)


def grads_and_hlo(cfg: GPTConfig, mesh):
    """The step's results and its compiled HLO text."""
    lowered, args = lowered_step(cfg, mesh)
    compiled = lowered.compile()
    return compiled(*args), compiled.as_text(), mesh


@pytest.fixture(scope="module")
def one_device():
    return grads_and_hlo(CFG, None)[0]


@pytest.fixture(scope="module")
def sharded():
    return {name: grads_and_hlo(CFG, make_mesh(mesh)) for name, mesh in MESHES.items()}


@pytest.mark.parametrize("name", MESHES)
def test_expert_parallel_forward_and_backward_equal_one_device(name, sharded, one_device):
    ((loss, (y, stats)), grads), _, _ = sharded[name]
    ((ref_loss, (ref_y, ref_stats)), ref_grads) = one_device
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    # Per-expert token counts are integers: exactly equal.
    np.testing.assert_array_equal(stats["load"] * B * T * MOE.top_k,
                                  ref_stats["load"] * B * T * MOE.top_k)
    chex.assert_trees_all_close(stats, ref_stats, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-8)


def test_tokens_travel_by_all_to_all_never_all_gathered(sharded):
    """Forward and backward move tokens only by all-to-all over `expert` (dispatch,
    combine and their transposes); no all-gather carries tokens (only the [P, E]
    integer counts); tensor parallelism adds one all-reduce forward, none of tokens
    for expert=8."""
    token_bytes = B * T * CFG.d_model * 4
    for name in ("expert8", "expert2_tensor2"):
        _, hlo, mesh = sharded[name]
        report = parse_collectives(hlo, mesh)
        assert report.count("all-to-all", ("expert",)) == 4, (name, report)
        assert report.count("all-to-all") == 4
        gathers = report.select("all-gather")
        assert gathers and all(c.shape.startswith("s32") for c in gathers), (name, report)
        assert report.bytes_per_device("all-gather") < token_bytes / 16
    expert8 = parse_collectives(sharded["expert8"][1], sharded["expert8"][2])
    # Dropless, padded: each device sends every other rank its worst case S * min(k, E/P).
    s_local = B * T // 8
    assert expert8.bytes_per_device("all-to-all") == 4 * 7 / 8 * 8 * s_local * CFG.d_model * 4
    tensor = parse_collectives(sharded["expert2_tensor2"][1], sharded["expert2_tensor2"][2])
    assert tensor.count("all-reduce", ("tensor",)) >= 1


def test_capacity_exchange_sends_its_capacity_not_the_worst_case():
    """Capacity dispatch at factor 1.25 sends each rank's E x C slots per exchange, C =
    ceil(1.25 S k / E): 1.25x the routed rows S k, where the padded dropless exchange
    sends P x them (above). Issue 43's goal: at most 1.5x."""
    s_local, p = 64, 8
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, dispatch="capacity",
                                                           capacity_factor=1.25))
    mesh = make_mesh(MESHES["expert8"])
    graphdef, state = layer(cfg, mesh)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (p, s_local, CFG.d_model)),
                       NamedSharding(mesh, logical_to_spec(("batch",), DEFAULT_RULES)))

    def loss(state, x):
        with activation_sharding(mesh):
            return jnp.sum(nnx.merge(graphdef, state)(x)[0])
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))   # as inside a model: x's gradient too
    report = parse_collectives(step.lower(state, x).compile().as_text(), mesh)
    row = CFG.d_model * 4 * (p - 1) / p        # fp32 bytes of one row sent off the rank
    slots = MOE.n_experts * math.ceil(1.25 * s_local * MOE.top_k / MOE.n_experts)
    assert report.count("all-to-all", ("expert",)) == 4, report
    assert report.bytes_per_device("all-to-all") == 4 * slots * row
    assert slots / (s_local * MOE.top_k) == 1.25


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """``lax.ragged_all_to_all`` from all-gathers (XLA:CPU cannot run the real one)."""
    me = lax.axis_index(axis_name)
    everyone = lambda a: lax.all_gather(a, axis_name)
    sources = everyone(operand)                                   # [P, N, D]
    starts = everyone(input_offsets)[:, me]    # where each source's rows for me start
    lands = everyone(output_offsets)[:, me]    # where they land here
    rows = jnp.arange(output.shape[0])
    inside = (rows >= lands[:, None]) & (rows < (lands + recv_sizes)[:, None])   # [P, M]
    src = jnp.argmax(inside, 0)
    taken = sources[src, jnp.clip(starts[src] + rows - lands[src], 0, operand.shape[0] - 1)]
    return jnp.where(inside.any(0)[:, None], taken, output)


def test_ragged_exchange_equals_one_device(monkeypatch, one_device):
    """The ragged exchange's offsets and sizes, run through a stand-in for the
    primitive; the real primitive is what the lowered program calls."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, exchange="ragged"))
    mesh = make_mesh(MESHES["expert4"])
    text = lowered_step(cfg, mesh)[0].as_text()   # XLA:CPU cannot compile it
    assert text.count("@ragged_all_to_all(") == 4   # dispatch, combine, their transposes
    plain = [line for line in text.splitlines() if '"stablehlo.all_to_all"' in line]
    assert all("xi32>" in line and "xf32>" not in line for line in plain)   # offsets only
    monkeypatch.setattr(dispatch, "ragged_all_to_all", emulated_ragged_all_to_all)
    ((loss, (y, stats)), grads), _, _ = grads_and_hlo(cfg, mesh)
    ((ref_loss, (ref_y, ref_stats)), ref_grads) = one_device
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(stats, ref_stats, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-8)


# --- optimizer ---------------------------------------------------------------------

def expert_muon_step(mesh_config, layout=None):
    """Muon's update of expert weights stacked [L, E, ...] as the model names them,
    on a mesh: (updates, one-device updates, collectives of the compiled update)."""
    e, d, f = MOE.n_experts, CFG.d_model, MOE.d_ff
    param = lambda key, shape, axes: nnx.Param(jax.random.normal(jax.random.key(key), shape),
                                               out_sharding=axes, eager_sharding=False)
    mesh = make_mesh(mesh_config)
    grads = placed({"gate_up": param(0, (2, e, d, 2, f),
                                     ("layers", "experts", "embed", "glu", "mlp")),
                    "down": param(1, (2, e, f, d), ("layers", "experts", "mlp", "embed"))},
                   mesh)
    experts = grads   # Muon's state only needs their shapes and shardings
    tx = scale_by_muon(plan=PlanSpec(mesh=mesh, layout=layout))
    update = jax.jit(lambda g, s: tx.update(g, s)[0])
    state = tx.init(experts)
    compiled = update.lower(grads, state).compile()
    ref_tx = scale_by_muon()
    ref = jax.jit(lambda g: ref_tx.update(g, ref_tx.init(g))[0])(jax.device_get(grads))
    return compiled(grads, state), ref, parse_collectives(compiled.as_text(), mesh)


def assert_ns_close(updates, ref):
    """Muon's updates equal one device's to fp32 Newton-Schulz round-off."""
    for (path, a), b in zip(jax.tree.leaves_with_path(updates), jax.tree.leaves(ref)):
        miss = relative_miss(a, b)
        assert miss < ns_roundoff(), (jax.tree_util.keystr(path), miss)


def test_expert_muon_step_needs_no_collective():
    """Experts split over `expert` (data replicas do the same): each device
    orthogonalizes its own experts, with no communication at all."""
    updates, ref, report = expert_muon_step(MeshConfig(data=2, fsdp=1, expert=4))
    assert report.collectives == (), report
    assert_ns_close(updates, ref)
    # The check can fail: split D over fsdp too and each matrix must be gathered.
    _, _, fsdp = expert_muon_step(MeshConfig(fsdp=2, expert=4))
    assert fsdp.count("all-gather", ("fsdp",)) > 0


def test_layerwise_shares_expert_layers_out_over_the_data_ranks():
    """Under layerwise, experts stay split over `expert` and each expert rank's
    data ranks own whole layers of its experts: the update equals one device's,
    and only the updated matrices are gathered back (over data)."""
    updates, ref, report = expert_muon_step(MeshConfig(data=2, fsdp=1, expert=4), "layerwise")
    assert_ns_close(updates, ref)
    assert {(c.kind, c.axes) for c in report.collectives} == {("all-gather", ("data",))}, report
    spec = make_layout("layerwise", {"data": 2, "expert": 4}).state_spec(
        ("layers", "experts", "mlp", "embed"), (0, 1))
    assert spec == jax.P("data", "expert", "tensor", None)


@pytest.mark.parametrize("mesh_config", [MeshConfig(fsdp=2, expert=2, tensor=2),
                                         MeshConfig(data=2, fsdp=2, expert=2)],
                         ids=["constrained", "gathered"])
def test_owner_layout_runs_moe_like_one_device(mesh_config):
    """A dense layer then three MoE layers, stored whole on owners (two groups of
    2 per stack, each ending in padding): loss, MoE stats and gradients equal one
    device's, and the optimizer step has no collective over the data axes. Under
    tensor 2 the MoE groups move by sharding constraints; without, in
    ``run_gathered``'s shard_map, where the layer runs on its local blocks."""
    import helpers
    from jmegatron.analysis import hlo_collectives
    from jmegatron.models.gpt import ungroup
    from jmegatron.optim import trainable_params
    from jmegatron.train import TrainConfig, make_loss_fn
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=32,
                    vocab_multiple=32, moe=dataclasses.replace(MOE, first_dense=1,
                                                               bias_rate=0.01))
    train = TrainConfig(steps=1, grad_clip=0.0)
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, cfg.vocab_size)

    def run(mesh, layout_name):
        layout, optimizer, graphdef, state = helpers.build(mesh, layout_name, cfg, train)
        loss_fn = make_loss_fn(graphdef, cfg, mesh, layout)
        batch = jax.device_put(tokens, NamedSharding(mesh, jax.P(("data", "fsdp", "expert"))))
        grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        return optimizer, state, grad(state.params, batch)

    optimizer, state, ((loss, metrics), grads) = run(make_mesh(mesh_config), "owner")
    _, _, ((ref_loss, ref_metrics), ref_grads) = run(
        make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]), "fsdp")
    assert state.params["moe_blocks"]["moe"]["down"].shape[:3] == (2, 2, MOE.n_experts)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    chex.assert_trees_all_close(metrics, ref_metrics, rtol=1e-5)
    chex.assert_trees_all_close(ungroup(grads), ref_grads, rtol=1e-4, atol=1e-7)

    def opt_step(params, grads, opt_state):   # the optimizer gets the trained params only
        return optimizer.tx.update(trainable_params(grads), opt_state, trainable_params(params))

    # Only tensor-parallel Newton-Schulz talks (over `tensor`, within a matrix's owners).
    report = hlo_collectives(jax.jit(opt_step), state.params, grads, state.opt_state)
    assert {c.axes for c in report.collectives} <= {("tensor",)}, report.table()


MOE_LAYERS = 4


def _moe_gradients(mesh, layout_name, keep_gathered=False):
    """MOE_LAYERS MoE layers: (collectives of the jitted gradient, the gradients, params)."""
    import helpers
    from jmegatron.analysis import hlo_collectives
    from jmegatron.train import TrainConfig, make_loss_fn
    model = GPTConfig(vocab_size=64, d_model=32, n_layers=MOE_LAYERS, n_heads=4, n_kv_heads=2,
                      d_ff=32, vocab_multiple=32, moe=dataclasses.replace(MOE, bias_rate=0.01),
                      keep_gathered=keep_gathered)
    tokens = jax.device_put(jax.random.randint(jax.random.key(0), (B, T + 1), 0,
                                               model.vocab_size),
                            NamedSharding(mesh, jax.P(("data", "fsdp", "expert"))))
    layout, _, graphdef, state = helpers.build(mesh, layout_name, model, TrainConfig(steps=1))
    loss_fn = make_loss_fn(graphdef, model, mesh, layout)
    grad = jax.jit(jax.grad(lambda p: loss_fn(p, tokens)[0]))
    return hlo_collectives(grad, state.params), grad(state.params), state.params


def _moved(report, kind, axes=None):
    return sum(c.buffer_bytes * c.executions for c in report.select(kind, axes))


def _one_pass_of_gathers(params):
    """Each group of every MoE block leaf whole on each device: f = 2 layers of its
    own shard ([G, f, ...], f split over fsdp)."""
    return sum(2 * math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(params["moe_blocks"]))


def test_owner_moe_moves_no_more_than_fsdp():
    """On data 2 x fsdp 2 x expert 2, in ``run_gathered``'s shard_map (each group
    gathered once per pass, its gradients reduce-scattered, the sums over the other
    batch axes after the scatter, the expert all-to-all's outputs kept for the
    backward) the owner forward + backward moves no more bytes per device than
    fsdp's; by sharding constraints it moved 1.2x. With keep_gathered the backward
    gathers nothing again, and the gradients are the same."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
    (fsdp, _, _), (owner, grads, params), (kept, kept_grads, _) = (
        _moe_gradients(mesh, "fsdp"), _moe_gradients(mesh, "owner"),
        _moe_gradients(mesh, "owner", keep_gathered=True))
    assert owner.bytes_per_device() <= fsdp.bytes_per_device()
    assert _moved(owner, "all-to-all") == _moved(fsdp, "all-to-all"), owner.table()
    assert (_moved(owner, "all-gather", ("fsdp",)) - _moved(kept, "all-gather", ("fsdp",))
            == _one_pass_of_gathers(params)), (kept.table(), owner.table())
    assert _moved(kept, "reduce-scatter") == _moved(owner, "reduce-scatter")
    chex.assert_trees_all_close(kept_grads, grads, rtol=1e-6, atol=1e-7)


def test_owner_moe_under_tensor_parallelism_keeps_what_it_is_asked_to():
    """On fsdp 2 x expert 2 x tensor 2 the groups are gathered by sharding
    constraints and the MoE layer runs its own shard_map. The expert all-to-all's
    outputs are still kept for the backward: two exchanges per layer forward
    (dispatch, combine) and their two transposes (as fsdp's; recomputed, 1.5x).
    keep_gathered keeps the gathered groups: one pass of gathers fewer, the same
    gradients."""
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2))
    (owner, grads, params), (kept, kept_grads, _) = (
        _moe_gradients(mesh, "owner"), _moe_gradients(mesh, "owner", keep_gathered=True))
    assert owner.count("all-to-all") == 4 * MOE_LAYERS, owner.table()
    assert (_moved(owner, "all-gather", ("fsdp",)) - _moved(kept, "all-gather", ("fsdp",))
            == _one_pass_of_gathers(params)), (kept.table(), owner.table())
    chex.assert_trees_all_close(kept_grads, grads, rtol=1e-6, atol=1e-7)


def test_each_expert_is_its_own_muon_matrix():
    params = nnx.split(nnx.eval_shape(lambda: GPT(CFG, nnx.Rngs(0))))[1]
    table = describe(params)
    e, d, f = MOE.n_experts, CFG.d_model, MOE.d_ff
    assert f"gate: {e} x [{d}, {f}]" in table and f"up: {e} x [{d}, {f}]" in table
    assert f"{e} x [{f}, {d}]" in table and "layers,experts" in table
    router = next(line for line in table.splitlines() if "router" in line)
    assert "adamw" in router


def test_the_expert_bias_never_reaches_an_optimizer():
    """It is set by the step; an optimizer handed it refuses it by name instead of
    training it with AdamW."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, bias_rate=0.01))
    params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))[1]
    for tx in (muon(0.1), muon(0.1, plan=make_plan(params))):
        with pytest.raises(ValueError, match=r"expert_bias.*not trained"):
            jax.eval_shape(tx.init, params)
    bias = {"b": ExpertBias(jnp.zeros((2, 4)), out_sharding=("layers", None),
                            eager_sharding=False, rate=0.5)}
    with pytest.raises(ValueError, match=r"scale_by_muon got \['b'\], which is not trained"):
        scale_by_muon().init(bias)
    state = jax.eval_shape(muon(0.1).init, trainable_params(params))
    assert not any("expert_bias" in jax.tree_util.keystr(p)
                   for p, _ in jax.tree.leaves_with_path(state))


def test_expert_bias_moves_against_the_load():
    bias = ExpertBias(jnp.zeros((2, 4)), out_sharding=("layers", None), eager_sharding=False,
                      rate=0.5)
    other = nnx.Param(jnp.ones(3))
    load = jnp.array([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]])
    new = balance_expert_bias({"b": bias, "w": other}, {"moe_load": load})
    np.testing.assert_array_equal(new["b"][...], [[-0.5, 0, 0, 0.5], [0, 0, 0, 0]])
    assert new["w"] is other
    # Grouped for the owner layout, [G, g, E]: the layers in order, padding untouched.
    grouped = ExpertBias(jnp.zeros((2, 2, 4)), out_sharding=("layer_groups", "layers", None),
                         eager_sharding=False, rate=0.5, real_layers=3)
    new = balance_expert_bias({"b": grouped}, {"moe_load": load[:1].repeat(3, 0)})
    np.testing.assert_array_equal(new["b"][...].reshape(4, 4),
                                  [[-0.5, 0, 0, 0.5]] * 3 + [[0, 0, 0, 0]])
    # Pipeline stages in owner groups, [S, G, g, E]: 5 layers, 3 a stage, each stage
    # padded to 4 slots on its own; layer i overloads expert i % 4.
    staged = ExpertBias(jnp.zeros((2, 2, 2, 4)),
                        out_sharding=("stages", "layer_groups", "layers", None),
                        eager_sharding=False, rate=1.0, real_layers=5)
    loads = jnp.eye(4)[jnp.arange(5) % 4]
    got = balance_expert_bias({"b": staged}, {"moe_load": loads})["b"][...].reshape(8, 4)
    want = np.sign(0.25 - np.asarray(loads))
    np.testing.assert_array_equal(got, np.concatenate([want[:3], np.zeros((1, 4)), want[3:],
                                                       np.zeros((2, 4))]))
    dense = {"w": other}
    assert balance_expert_bias(dense, {}) is dense


# --- the model, its configuration and the CLI ---------------------------------------

def test_layer_pattern_and_parameter_count():
    mixed = GPTConfig(n_layers=6, moe=MoEConfig(n_experts=4, first_dense=1, every=2,
                                                shared_d_ff=64, bias_rate=0.01))
    assert mixed.moe_layers == (False, False, True, False, True, False)
    model = nnx.eval_shape(lambda: GPT(mixed, nnx.Rngs(0)))
    assert model.blocks.attn.qkv.shape[0] == 4 and model.moe_blocks.moe.down.shape[:2] == (2, 4)
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == mixed.param_count()
    with pytest.raises(ValueError, match="experts=8 is not divisible by expert=16"):
        validate_sharding(CFG.logical_dims(), {"expert": 16}, DEFAULT_RULES)
    with pytest.raises(ConfigError, match=r"owner layout .* needs the dense and MoE layers in "
                                         r"two runs \(moe.every=1\), not moe.every=2"):
        dataclasses.replace(mixed, layer_group=2)


def test_mixed_model_on_a_mesh_equals_one_device():
    """A dense layer, then an MoE layer with a shared expert: loss, MoE stats and
    gradients on fsdp x expert x tensor equal one device."""
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32,
                    vocab_multiple=32, moe=dataclasses.replace(MOE, every=2, shared_d_ff=16))
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, cfg.vocab_size)
    graphdef, params = nnx.split(create_sharded(lambda: GPT(cfg, nnx.Rngs(0)), None))

    def run(mesh):
        state = placed(params, mesh)

        def loss(state, tokens):
            with activation_sharding(mesh):
                logits, aux = nnx.merge(graphdef, state)(tokens[:, :-1], return_aux=True)
            rules = None if mesh is None else DEFAULT_RULES
            nll = cross_entropy(logits, tokens[:, 1:], cfg.vocab_size, mesh=mesh, rules=rules)[0]
            extra, metrics = moe_losses(aux.moe, cfg.moe)
            return nll + extra, metrics

        batch = tokens if mesh is None else jax.device_put(
            tokens, NamedSharding(mesh, logical_to_spec(("batch",), DEFAULT_RULES)))
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(state, batch)

    (loss, metrics), grads = run(make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2)))
    (ref_loss, ref_metrics), ref_grads = run(None)
    assert metrics["moe_load"].shape == (1, MOE.n_experts)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    chex.assert_trees_all_close(metrics, ref_metrics, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-7)


def test_qwen3_moe_tiny_trains_from_the_cli(tmp_path):
    """The preset, shrunk, with capacity dispatch and aux-loss-free sigmoid routing,
    under the layerwise optimizer layout: the loss falls and the MoE metrics are
    recorded."""
    small = ["--preset", "qwen3-moe-tiny", "--model.n-layers", "2", "--model.d-model", "32",
             "--model.n-heads", "2",
             "--model.n-kv-heads", "1", "--model.d-ff", "64", "--model.moe.d-ff", "32",
             "--model.moe.dispatch", "capacity", "--model.moe.capacity-factor", "1.0",
             "--model.moe.scoring", "sigmoid",
             "--model.moe.bias-rate", "0.001", "--batch-size", "8", "--seq-len", "32",
             "--steps", "16", "--lr", "1e-2", "--schedule.warmup-steps", "2", "--log-every", "1",
             "--eval-every", "16", "--eval-batches", "1", "--sample-tokens", "4",
             "--layout", "layerwise", "--no-progress", "--out-dir", str(tmp_path),
             "--name", "moe"]
    summary = train_cli.main(small)
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["mesh"]["expert"] == 4
    routing = (tmp_path / "moe" / "routing.txt").read_text()
    assert "layerwise over 8 ranks" in routing, routing
    records = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").open()]
    train = [r for r in records if "loss" in r]
    assert np.mean([r["loss"] for r in train[-3:]]) < train[0]["loss"] - 1.0, train
    assert np.isfinite(summary["val_loss"])
    last = train[-1]
    assert np.array(last["moe_load"]).shape == (1, 8)            # 1 MoE layer x 8 experts
    np.testing.assert_allclose(np.sum(last["moe_load"], axis=1), 1.0, rtol=1e-5)
    assert 0 < last["moe_dropped"] < 1 and last["moe_aux_loss"] > 0 and last["moe_z_loss"] > 0
    assert last["moe_max_load"] >= 1.0
