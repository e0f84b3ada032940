"""Context parallelism's attention (jmegatron.models.context): the sequence dealt
over a context axis of C ranks, each strategy and order equal to one device's causal
attention, gradients and largest logit included; what each strategy sends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.analysis import hlo_collectives
from jmegatron.models.context import (dealt_positions, pairs_computed,
                                       split_sequence_attention)
from jmegatron.models.attention import causal_attention
from jmegatron.sharding import DEFAULT_RULES, MeshConfig, make_mesh

B, T, N, K, H = 2, 32, 4, 2, 8   # grouped-query: 2 query heads per key/value head


def inputs(seed=0):
    q, k, v, dy = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(seed), 4),
        [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)]))
    return q * 2, k * 2, v, dy   # logits of a few units: the softmax far from uniform


def with_grads(attention):
    """(q, k, v, dy) -> (output, largest logit, d(output . dy)/d(q, k, v))."""
    def run(q, k, v, dy):
        def loss(q, k, v):
            y, peak = attention(q, k, v)
            return jnp.sum(y * dy), (y, peak)
        (_, (y, peak)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return y, peak, grads
    return jax.jit(run)


def mapped(strategy, size, order):
    """(``strategy`` manual over a context axis of ``size`` devices, its mesh)."""
    mesh = make_mesh(MeshConfig(context=size, fsdp=1), jax.devices()[:size])
    return split_sequence_attention(strategy, mesh, DEFAULT_RULES, order), mesh


def over_context(strategy, size, order):
    """``strategy`` on a context axis of ``size`` devices, as a function of whole
    sequences: dealt in ``order`` before, gathered back after."""
    attention, _ = mapped(strategy, size, order)
    dealt = dealt_positions(T, size, order)
    back = np.argsort(dealt)

    def whole(q, k, v):
        y, peak = attention(q[:, dealt], k[:, dealt], v[:, dealt])
        return y[:, back], peak
    return whole


def split(mesh, *arrays):
    """``arrays`` split over the context axis along T (as dealt: the order is moot here)."""
    return [jax.device_put(a, NamedSharding(mesh, P(None, "context"))) for a in arrays]


def exact(q, k, v, dy):
    """float64 causal attention by its equations (numpy): (output, largest logit per
    example and head, the gradients of output . dy with respect to q, k, v)."""
    q, k, v, dy = (np.asarray(a, np.float64) for a in (q, k, v, dy))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    k_n, v_n = np.repeat(k, group, 2), np.repeat(v, group, 2)
    logits = np.einsum("btnh,bsnh->bnts", q, k_n) / np.sqrt(h)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("btnh,bsnh->bnts", dy, v_n)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) / np.sqrt(h)
    fold = lambda a: a.reshape(b, t, k.shape[2], group, h).sum(3)
    return (np.einsum("bnts,bsnh->btnh", p, v_n), logits.max(axis=(-2, -1)),
            (np.einsum("bnts,bsnh->btnh", ds, k_n),
             fold(np.einsum("bnts,btnh->bsnh", ds, q)), fold(np.einsum("bnts,btnh->bsnh", p, dy))))


def assert_fp32_accurate(got, want):
    """Each leaf within 1e-6 of its largest magnitude of the float64 values: fp32's
    round-off over sums of T terms (the gradients' terms cancel: a small gradient is
    as exact as its terms are large), which one device's fp32 attention meets too
    (its miss 0.1-0.4 of that bound here; each split here at most 2.5x its miss)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        miss, scale = np.abs(np.asarray(a, np.float64) - b).max(), np.abs(b).max()
        assert miss <= 1e-6 * scale, (miss, scale)


@pytest.fixture(scope="module")
def exact_values():
    return exact(*inputs())


def test_one_devices_attention_is_fp32_accurate(exact_values):
    assert_fp32_accurate(with_grads(causal_attention)(*inputs()), exact_values)


@pytest.mark.parametrize("strategy, size, order", [
    ("ring", 2, "zigzag"), ("ring", 4, "zigzag"), ("ring", 4, "contiguous"),
    ("all_gather", 4, "zigzag"), ("all_gather", 2, "contiguous")])
def test_attention_over_a_split_sequence_equals_one_device(strategy, size, order,
                                                           exact_values):
    """Output, largest logit and the gradients of q, k and v, against float64."""
    assert_fp32_accurate(with_grads(over_context(strategy, size, order))(*inputs()),
                         exact_values)


@pytest.mark.parametrize("strategy, want", [
    ("ring", {"collective-permute": 2 * 3}), ("all_gather", {"all-gather": 2})])
def test_what_each_strategy_sends(strategy, want):
    """At C = 4, the forward: ring passes K and V to the next rank C - 1 times each and
    gathers nothing; all_gather gathers K and V once each; both take the largest
    logit's max over the ranks (one small all-reduce)."""
    attention, mesh = mapped(strategy, 4, "zigzag")
    report = hlo_collectives(jax.jit(attention), *split(mesh, *inputs()[:3]))
    moved = {kind: report.count(kind) for kind in ("collective-permute", "all-gather")}
    assert moved == {"collective-permute": 0, "all-gather": 0, **want}, report.table()


def test_the_ring_backward_returns_the_key_and_value_gradients_home():
    """The backward passes K, V and their gradients around the ring C - 1 times and
    the gradients once more, home: 4 (C - 1) + 2 permutes, besides the forward's."""
    attention, mesh = mapped("ring", 4, "zigzag")
    report = hlo_collectives(with_grads(attention), *split(mesh, *inputs()))
    assert report.count("collective-permute") == 2 * 3 + 4 * 3 + 2, report.table()
    assert report.count("all-gather") == 0, report.table()


def test_zigzag_gives_every_rank_the_same_attention_work():
    """Pairs of chunks each rank's ring computes (its attention FLOPs): the same on
    every rank dealt zigzag; dealt contiguous, the last rank computes (4C - 1)/(2C + 1)
    times the mean, almost 2 as C grows."""
    for size in (2, 4, 8):
        zigzag, contiguous = (pairs_computed(size, order) for order in ("zigzag", "contiguous"))
        assert zigzag.max() / zigzag.mean() == 1 and zigzag.sum() == contiguous.sum()
        assert contiguous.max() / contiguous.mean() == (4 * size - 1) / (2 * size + 1)
        assert contiguous.sum() == size * (2 * size + 1)   # the causal half, diagonals in


def test_the_dealt_positions_are_each_ranks_true_positions():
    assert dealt_positions(8, 2, "zigzag").tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert dealt_positions(8, 2, "contiguous").tolist() == list(range(8))
    with pytest.raises(ValueError, match="cannot be cut into 2 x 3 chunks"):
        dealt_positions(8, 3, "zigzag")
