"""Muon as an optax transformation: equations, optax parity, routing, composition."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmegatron.models import GPT, GPTConfig
from jmegatron.optim import (MATRIX, MatrixSpec, MuonState, PlanSpec, Route, Routing, describe,
                             labels, make_plan, muon, muon_flops, newton_schulz, ns_flops, route,
                             scale_by_muon, update_scale)

SHAPES = {"w_square": (32, 32), "w_wide": (16, 48), "w_tall": (48, 24)}


def matrices(seed=0):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items())}


def run(tx, params, steps=5):
    """Params after each of ``steps`` updates with fresh random gradients."""
    state = tx.init(params)
    update = jax.jit(tx.update)
    history = []
    for i in range(steps):
        grads = matrices(100 + i)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history


@pytest.mark.parametrize("ours, theirs", [
    (dict(scale="shape", rms_factor=1.0), dict()),
    (dict(scale="spectral", rms_factor=0.2), dict(consistent_rms=0.2)),
    (dict(scale="shape", rms_factor=1.0, nesterov=False), dict(nesterov=False)),
])
def test_matches_optax_contrib_muon(ours, theirs):
    common = dict(beta=0.95)
    mine = muon(0.02, coefficients="simple", steps=5, bias_correction=True, **common, **ours)
    ref = optax.contrib.muon(0.02, ns_coeffs=(3.4445, -4.7750, 2.0315), ns_steps=5,
                             **common, **theirs)
    for a, b in zip(run(mine, matrices()), run(ref, matrices())):
        chex.assert_trees_all_close(a, b, rtol=2e-5, atol=2e-6)


def test_update_equations_by_hand():
    """Two steps of EMA momentum with Nesterov, spectral scale and decoupled decay."""
    beta, lr, wd = 0.9, 0.1, 0.01
    w = jax.random.normal(jax.random.key(0), (16, 40))
    g1, g2 = (jax.random.normal(jax.random.key(i), (16, 40)) for i in (1, 2))
    tx = muon(lr, beta=beta, weight_decay=wd, coefficients="quintic")
    state = tx.init({"w": w})
    u1, state = tx.update({"w": g1}, state, {"w": w})
    u2, _ = tx.update({"w": g2}, state, {"w": w})
    m1 = (1 - beta) * g1
    m2 = beta * m1 + (1 - beta) * g2
    scale = 0.2 * np.sqrt(40)
    for u, m, g in ((u1, m1, g1), (u2, m2, g2)):
        want = -lr * (scale * newton_schulz(beta * m + (1 - beta) * g) + wd * w)
        np.testing.assert_allclose(u["w"], want, rtol=1e-5, atol=1e-6)


def test_sum_momentum_without_nesterov():
    tx = scale_by_muon(momentum="sum", nesterov=False, beta=0.5, scale="none", rms_factor=1.0)
    g = jax.random.normal(jax.random.key(3), (8, 12))
    state = tx.init({"w": g})
    _, state = tx.update({"w": g}, state)
    u, state = tx.update({"w": 2 * g}, state)
    np.testing.assert_allclose(state.momentum["w"], 0.5 * g + 2 * g, rtol=1e-6)
    np.testing.assert_allclose(u["w"], newton_schulz(2.5 * g), rtol=1e-5, atol=1e-6)


def test_scale_modes():
    assert update_scale("spectral", 64, 256, 1.0) == 16.0
    assert update_scale("spectral", 64, 256) == pytest.approx(3.2)   # Moonlight's 0.2
    assert update_scale("shape", 64, 256) == 2.0 and update_scale("shape", 256, 64) == 1.0
    assert update_scale("unit_rms", 256, 64) == 0.5
    with pytest.raises(ValueError, match="unknown scale mode"):
        update_scale("max", 1, 1)


def test_spectral_scale_gives_unit_update_rms():
    tx = scale_by_muon(scale="spectral", rms_factor=1.0, coefficients="polar_express", steps=8)
    g = {"w": jax.random.normal(jax.random.key(0), (64, 256))}
    u, _ = tx.update(g, tx.init(g))
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(u["w"] ** 2)), 1.0, rtol=0.02)


def test_momentum_dtype():
    tx = scale_by_muon(momentum_dtype=jnp.bfloat16)
    state = tx.init(matrices())
    assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(state.momentum))
    _, state = tx.update(matrices(1), state)
    assert isinstance(state, MuonState) and int(state.count) == 1
    assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(state.momentum))


# --- routing ---------------------------------------------------------------

CFG = GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64).pad_vocab(1)


@pytest.fixture(scope="module")
def gpt_params():
    return nnx.state(GPT(CFG, nnx.Rngs(0)), nnx.Param)


def test_gpt_routing(gpt_params):
    names = labels(gpt_params)
    assert names["embed"] == "adamw" and names["head"] == "adamw"
    assert names["final_norm"] == "adamw" and names["blocks"]["attn_norm"] == "adamw"
    assert {names["blocks"]["attn"][k] for k in ("qkv", "out")} == {"muon"}
    assert {names["blocks"]["mlp"][k] for k in ("gate_up", "down")} == {"muon"}
    table = describe(gpt_params)
    assert "q: 2 x [32, 32], k: 2 x [32, 16], v: 2 x [32, 16]" in table   # K=2 groups, G=2, H=8
    assert "gate: 2 x [32, 64], up: 2 x [32, 64]" in table
    per_head = describe(gpt_params, Routing(per_head=True))
    assert "q: 8 x [32, 8], k: 4 x [32, 8], v: 4 x [32, 8]" in per_head


def blocks_of(qkv, g):
    """Q, K, V of one layer's fused weight [D, K, G+2, H] as matrices."""
    d = qkv.shape[0]
    return (qkv[:, :, :g].reshape(d, -1), qkv[:, :, g].reshape(d, -1),
            qkv[:, :, g + 1].reshape(d, -1))


@pytest.mark.parametrize("per_head", [False, True])
def test_fused_qkv_is_orthogonalized_block_by_block(gpt_params, per_head):
    tx = scale_by_muon(scale="spectral", rms_factor=1.0,
                       plan=PlanSpec(routing=Routing(per_head=per_head)))
    qkv = {"qkv": gpt_params["blocks"]["attn"]["qkv"]}
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape), qkv)
    u, _ = tx.update(grads, tx.init(qkv))
    g_full, u_full = grads["qkv"][...], u["qkv"][...]
    g_heads = CFG.group_size
    for layer in range(CFG.n_layers):
        for got, grad in zip(blocks_of(u_full[layer], g_heads), blocks_of(g_full[layer], g_heads)):
            direction = grad   # the first step's direction is a multiple of g; NS ignores scale
            if per_head:
                h = CFG.resolved_head_dim
                heads = direction.reshape(CFG.d_model, -1, h).transpose(1, 0, 2)
                want = (newton_schulz(heads) * np.sqrt(max(CFG.d_model, h)))
                want = want.transpose(1, 0, 2).reshape(CFG.d_model, -1)
            else:
                want = newton_schulz(direction) * np.sqrt(max(direction.shape))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_small_flax_module_routes_by_name_and_trains_with_nnx_optimizer():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embedding = nnx.Embed(50, 16, rngs=rngs)
            self.hidden = nnx.Linear(16, 32, rngs=rngs)
            self.norm = nnx.LayerNorm(32, rngs=rngs)
            self.out = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, ids):
            return self.out(self.norm(jax.nn.gelu(self.hidden(self.embedding(ids)))))

    net = Net(nnx.Rngs(0))
    params = nnx.state(net, nnx.Param)
    routes = route(params)
    kinds = {jax.tree_util.keystr(p): r.kind for p, r in jax.tree.leaves_with_path(
        routes, is_leaf=lambda r: hasattr(r, "kind"))}
    assert kinds["['embedding']['embedding']"] == "adamw"
    assert kinds["['hidden']['kernel']"] == "matrix" and kinds["['hidden']['bias']"] == "adamw"
    assert kinds["['norm']['scale']"] == "adamw" and kinds["['out']['kernel']"] == "matrix"

    optimizer = nnx.Optimizer(net, optax.chain(optax.clip_by_global_norm(1.0), muon(0.05)),
                              wrt=nnx.Param)
    ids = jnp.arange(8)

    @nnx.jit
    def step(net, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(ids) - 1.0) ** 2))(net)
        optimizer.update(net, grads)
        return loss

    losses = [float(step(net, optimizer)) for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_an_unmatched_leaf_raises_until_a_custom_rule_decides_it():
    with pytest.raises(ValueError, match=r"no routing rule matches \['conv'\] \(shape \(3, 3, 8\)"):
        muon(0.1).init({"conv": jnp.ones((3, 3, 8)), "w": jnp.ones((4, 4))})
    conv = Route(MATRIX, "conv as [9, 8] matrices", MatrixSpec((0, 1), (2,)))
    custom = Routing(custom=lambda path, shape, logical: conv if "conv" in path else None)
    state = muon(0.1, plan=PlanSpec(routing=custom)).init({"conv": jnp.ones((3, 3, 8))})
    assert "matrices" in describe({"conv": jnp.ones((3, 3, 8))}, custom)
    assert jax.tree.leaves(state)


def test_scale_by_muon_refuses_non_matrices():
    with pytest.raises(ValueError, match=r"scale_by_muon got \['b'\], which routing sends to AdamW"):
        scale_by_muon().init({"b": jnp.ones(4)})


def test_muon_flops_counts_every_block(gpt_params):
    d, f, h, g = CFG.d_model, CFG.d_ff, CFG.resolved_head_dim, CFG.group_size
    k = CFG.n_kv_heads
    per_layer = (ns_flops(d, k * g * h, 5) + 2 * ns_flops(d, k * h, 5)   # q, k, v
                 + ns_flops(CFG.n_heads * h, d, 5)                     # out
                 + 2 * ns_flops(d, f, 5) + ns_flops(f, d, 5))          # gate, up, down
    assert muon_flops(gpt_params) == CFG.n_layers * per_layer


def test_per_expert_weights_are_batches_and_the_router_goes_to_adamw():
    params = {
        "experts_in": nnx.Param(jnp.ones((2, 4, 8, 16)),
                                out_sharding=("layers", "experts", "embed", "mlp"), eager_sharding=False),
        "experts_out": nnx.Param(jnp.ones((2, 4, 16, 8)),
                                 out_sharding=("layers", "experts", "mlp", "embed"), eager_sharding=False),
        "router": nnx.Param(jnp.ones((2, 8, 4)), out_sharding=("layers", "embed", "experts"),
                            eager_sharding=False),
    }
    table = describe(params)
    assert "8 x [8, 16]" in table and "8 x [16, 8]" in table and "layers,experts" in table
    assert labels(params)["router"] == "adamw"
    assert labels(params, Routing(router="matrix"))["router"] == "muon"
    assert "2 x [8, 4]" in describe(params, Routing(router="matrix"))


def test_nnx_optimizer_on_the_gpt():
    """nnx.Optimizer hands Muon plain arrays at update time; the routes of the plan,
    made once from the logical axes (split QKV included), must still apply. Without
    a plan, the plain arrays cannot be routed, and that is one clear error."""
    model = GPT(CFG, nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, CFG.vocab_size)  # full-rank grads
    unplanned = nnx.Optimizer(model, muon(0.01), wrt=nnx.Param)
    with pytest.raises(ValueError, match="no routing rule matches.*make_plan"):
        unplanned.update(model, nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, muon(0.01, plan=make_plan(nnx.state(model, nnx.Param))),
                              wrt=nnx.Param)
    before = model.blocks.attn.qkv[...]

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(m):
            return jnp.mean(jax.nn.log_softmax(m(tokens[:, :-1]))[..., 0])
        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    step(model, optimizer)
    delta = np.asarray(model.blocks.attn.qkv[...] - before)[0]   # layer 0: [D, K, G+2, H]
    q = delta[:, :, :CFG.group_size].reshape(CFG.d_model, -1)
    # A spectral-scaled orthogonal block has RMS 0.2 * lr; a whole-QKV update would not.
    np.testing.assert_allclose(np.sqrt(np.mean(q ** 2)), 0.2 * 0.01, rtol=0.1)


def test_foreign_axis_names_fall_back_to_name_and_shape():
    params = {"kernel": nnx.Param(jnp.ones((8, 16)), out_sharding=(None, "model"),
                                  eager_sharding=False)}
    assert labels(params)["kernel"] == "muon"
