"""Megatron's communication count for one dense layer, read from the compiled HLO."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPT, GPTConfig, create_sharded
from jmegatron.models.layers import Block
from jmegatron.sharding import (DEFAULT_RULES, MeshConfig, activation_sharding, logical_to_spec,
                                make_mesh)

CFG = GPTConfig(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128)
B, T = 8, 16


def layer_reports(mesh):
    block = create_sharded(lambda: Block(CFG, nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(block)
    spec = logical_to_spec(("batch", "seq", "act_embed"), DEFAULT_RULES)
    x = jax.device_put(jnp.ones((B, T, CFG.d_model)), NamedSharding(mesh, spec))

    def forward(state, x):
        with activation_sharding(mesh):
            return nnx.merge(graphdef, state)(x, jnp.arange(T))[0]

    def forward_backward(state, x):
        # value_and_grad keeps the forward output live, so no forward all-reduce
        # is dead code.
        return jax.value_and_grad(lambda s, x: forward(s, x).sum(), argnums=(0, 1))(state, x)

    return hlo_collectives(forward, state, x), hlo_collectives(forward_backward, state, x)


@pytest.mark.parametrize("mesh_config, devices", [
    (MeshConfig(fsdp=1, tensor=2), 2),
    (MeshConfig(data=4, fsdp=1, tensor=2), 8),
])
def test_dense_layer_all_reduces(mesh_config, devices):
    mesh = make_mesh(mesh_config, jax.devices()[:devices])
    forward, both = layer_reports(mesh)
    assert forward.count("all-reduce", ("tensor",)) == 2, forward.table()
    assert forward.count() == 2, forward.table()
    assert both.count("all-reduce", ("tensor",)) == 4, both.table()
    # Anything else only sums parameter gradients over the data axis.
    others = [c for c in both.collectives if c.axes != ("tensor",)]
    assert all(c.kind == "all-reduce" and c.axes == ("data",) for c in others), both.table()
    assert bool(others) == (mesh.shape["data"] > 1)


def test_tensor_all_reduces_move_activations_only():
    """Each tensor-parallel all-reduce carries one [B/dp, T, D] activation."""
    mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
    _, both = layer_reports(mesh)
    activation = (B // 4) * T * CFG.d_model * 4
    for c in both.select("all-reduce", ("tensor",)):
        assert c.buffer_bytes == c.buffers * activation, c


def test_vocab_parallel_embedding_is_one_all_reduce():
    cfg = GPTConfig(vocab_size=300, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2,
                    d_ff=128).pad_vocab(2)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, state = nnx.split(create_sharded(lambda: GPT(cfg, nnx.Rngs(0)), mesh))
    tokens = jax.device_put(jnp.zeros((B, T), jnp.int32),
                            NamedSharding(mesh, logical_to_spec(("batch", "seq"), DEFAULT_RULES)))

    def embed_only(state, tokens):
        from jmegatron.models.layers import embed_lookup
        with activation_sharding(mesh):
            return embed_lookup(nnx.merge(graphdef, state).embed[...], tokens)

    report = hlo_collectives(embed_only, state, tokens)
    # One all-reduce over tensor of [B/(data*fsdp), T, D], plus the ZeRO-3
    # all-gather of the table's embed dim over fsdp; the table never moves over tensor.
    assert report.count("all-reduce", ("tensor",)) == 1, report.table()
    (reduce,) = report.select("all-reduce", ("tensor",))
    assert reduce.buffer_bytes == (B // 4) * T * cfg.d_model * 4
    assert {c.axes for c in report.collectives} == {("tensor",), ("fsdp",)}, report.table()
