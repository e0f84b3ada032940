"""Weight products whose weight gradient stays in fp32 (``models.products``), on one
device against float64: the weight gradient is the exact product x^T dy rounded once
to fp32; the plain bf16 product's is rounded to bf16 (8 bits); the forward and the
input gradient are the plain product's, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.models.products import bias_add, weight_einsum, weight_ragged_dot

KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEYS[0], (4, 6, 8)).astype(jnp.bfloat16)
W = jax.random.normal(KEYS[1], (8, 3, 5))
ROWS = jax.random.normal(KEYS[2], (10, 8)).astype(jnp.bfloat16)
EXPERTS = jax.random.normal(KEYS[3], (3, 8, 4))
SIZES = jnp.array([3, 5, 2], jnp.int32)   # rows 0-2, 3-7, 8-9; none past the last group
BIAS = jax.random.normal(KEYS[1], (6, 8))


def gradients(product, x, w):
    """(y, dx, dw) of sum(y^2) / 2: dy = y, in the product's dtype."""
    loss = lambda x, w: 0.5 * jnp.sum(jnp.square(product(x, w).astype(jnp.float32)))
    return jax.jit(lambda x, w: (product(x, w), *jax.grad(loss, (0, 1))(x, w)))(x, w)


def exact_einsum(x, y, w):
    return np.einsum("btd,btkh->dkh", x, y)


def exact_ragged(x, y, w):
    starts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    return np.stack([x[s:s + n].T @ y[s:s + n] for s, n in zip(starts, np.asarray(SIZES))])


def exact_bias(x, y, w):
    return y.reshape(-1, *w.shape).sum(0)


CASES = {
    "einsum": (lambda wide: lambda x, w: weight_einsum("btd,dkh->btkh", x, w, wide), X, W,
               exact_einsum),
    "ragged_dot": (lambda wide: lambda x, w: weight_ragged_dot(x, w, SIZES, wide), ROWS, EXPERTS,
                   exact_ragged),
    "bias": (lambda wide: lambda x, w: bias_add(x, w, wide), X, BIAS, exact_bias),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_weight_gradient_is_the_fp32_product(case):
    """With grad_dtype float32 the weight gradient is x^T dy to fp32 round-off (the
    plain bf16 einsum's is 0.4% off: bf16 keeps 8 bits); y and dx are unchanged."""
    make, x, w, exact = CASES[case]
    y, dx, dw = gradients(make(None), x, w)
    y32, dx32, dw32 = gradients(make(jnp.float32), x, w)
    np.testing.assert_array_equal(np.asarray(y32), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(dx32), np.asarray(dx))
    want = exact(np.asarray(x, np.float64), np.asarray(y, np.float64), w)
    scale = np.abs(want).max()
    assert dw32.dtype == jnp.float32
    assert np.abs(np.asarray(dw32, np.float64) - want).max() <= 1e-6 * scale
    if case == "einsum":   # XLA:CPU happens to keep the others' sums in f32 (no rounding)
        assert np.abs(np.asarray(dw, np.float64) - want).max() > 1e-3 * scale


def test_an_einsum_whose_weight_index_is_nowhere_else_is_refused():
    with pytest.raises(ValueError, match="explicit 'x,w->out'"):
        weight_einsum("btd,dk->bt", X, jnp.ones((8, 2)), jnp.float32)
