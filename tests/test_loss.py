"""Vocab-parallel cross-entropy equals the dense one and never gathers the logits."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jmegatron.analysis import hlo_collectives
from jmegatron.models import cross_entropy
from jmegatron.sharding import DEFAULT_RULES, MeshConfig, logical_to_spec, make_mesh

B, T, V, VALID = 8, 16, 512, 300


def inputs(mesh=None):
    keys = jax.random.split(jax.random.key(0), 3)
    logits = 3.0 * jax.random.normal(keys[0], (B, T, V))
    targets = jax.random.randint(keys[1], (B, T), 0, VALID)
    mask = jax.random.bernoulli(keys[2], 0.8, (B, T))
    if mesh is not None:
        logits = jax.device_put(logits, NamedSharding(
            mesh, logical_to_spec(("batch", "seq", "act_vocab"), DEFAULT_RULES)))
    return logits, targets, mask


def loss_fn(mesh):
    rules = None if mesh is None else DEFAULT_RULES

    def f(logits, targets, mask):
        return cross_entropy(logits, targets, VALID, mask=mask, z_loss=1e-3, mesh=mesh,
                             rules=rules)[0]
    return jax.jit(jax.value_and_grad(f))


def test_dense_matches_a_plain_log_softmax():
    logits, targets, mask = inputs()
    loss, parts = cross_entropy(logits, targets, VALID, mask=mask)
    logp = jax.nn.log_softmax(logits[..., :VALID], axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, (nll * mask).sum() / mask.sum(), rtol=1e-6)
    assert parts["z_loss"] > 0


@pytest.mark.parametrize("mesh_config", [MeshConfig(data=4, fsdp=1, tensor=2),
                                         MeshConfig(fsdp=1, tensor=8),
                                         MeshConfig(data=2, fsdp=2, tensor=2)])
def test_vocab_parallel_equals_dense(mesh_config):
    mesh = make_mesh(mesh_config)
    want_loss, want_grad = loss_fn(None)(*inputs())
    loss, grad = loss_fn(mesh)(*inputs(mesh))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    chex.assert_trees_all_close(grad, want_grad, rtol=1e-5, atol=1e-9)
    assert not jnp.any(grad[..., VALID:]), "padded vocabulary must get no gradient"


def test_vocab_parallel_moves_only_token_statistics():
    mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
    report = hlo_collectives(loss_fn(mesh), *inputs(mesh))
    assert report.count("all-gather") == 0, report.table()
    token_stats = B * T * 4   # one fp32 value per token, whole batch
    tensor_ops = report.select(axes=("tensor",))
    assert tensor_ops, report.table()
    for c in tensor_ops:
        assert c.buffer_bytes <= c.buffers * token_stats, c
