"""Products of activations with weights, whose weight gradients can stay in fp32.

A bf16 model multiplies bf16 activations by its weights cast to bf16. JAX's
transpose of such a product computes the weight gradient x^T dy with fp32
accumulation but rounds it to bf16 (the cast weight's dtype) on each device, and
every sum of those gradients over devices (XLA's all-reduce or reduce-scatter, or a
runner's) then adds bf16 values. Given ``grad_dtype`` float32 (the model's
``GPTConfig.grad_reduce_dtype``; Megatron's fp32 main gradients), the functions
here return the weight gradient as the product's fp32 accumulation instead, so it
is summed in fp32 wherever it is summed. Their forward and input gradient are
exactly the plain product's. ``grad_dtype`` None is the plain product. A remat
policy that saves dots cannot see the dot inside their custom_vjp: the einsums name
their outputs for ``rules.dots_policy``, which the model's and the runners' policies
use.

The gradient reaches the weight in the weight's own dtype: runners that hand a
layer gathered weights hand them in the gradient's dtype for that reason
(``rules.gather_in``), after gathering them in the compute dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jmegatron.sharding.rules import BATCHED_PRODUCT, PRODUCT, varying


def weight_einsum(subscripts: str, x: jax.Array, w: jax.Array, grad_dtype=None,
                  preferred_element_type=None) -> jax.Array:
    """``jnp.einsum(subscripts, x, w.astype(x.dtype))``, w's gradient computed in
    ``grad_dtype`` (None: w's compute dtype, x's, as JAX does).

    Args:
      subscripts: "x,w->out", explicit; every index of w also in x or out.
      x: activations, in the compute dtype.
      w: the weight, any float dtype (cast to x's for the product).
      grad_dtype: the dtype of w's gradient as the product computes it.
      preferred_element_type: the product's output dtype (None: x's).
    """
    if grad_dtype is None:
        return jnp.einsum(subscripts, x, w.astype(x.dtype),
                          preferred_element_type=preferred_element_type)
    x_sub, w_sub, out = _terms(subscripts)   # a bad spec fails here, at trace time
    batched = set(x_sub) & set(w_sub) & set(out)   # dims the dot maps, not contracts
    return checkpoint_name(_einsum(subscripts, jnp.dtype(grad_dtype), preferred_element_type,
                                   x, w), BATCHED_PRODUCT if batched else PRODUCT)


def _terms(subscripts: str) -> tuple[str, str, str]:
    inputs, _, out = subscripts.replace(" ", "").partition("->")
    x_sub, _, w_sub = inputs.partition(",")
    if not out or set(w_sub) - set(x_sub + out) or "." in subscripts:
        raise ValueError(f"weight_einsum needs an explicit 'x,w->out' whose weight indices "
                         f"all appear in x or out; got {subscripts!r}")
    return x_sub, w_sub, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum(subscripts, grad_dtype, preferred, x, w):
    return jnp.einsum(subscripts, x, w.astype(x.dtype), preferred_element_type=preferred)


def _einsum_fwd(subscripts, grad_dtype, preferred, x, w):
    return _einsum(subscripts, grad_dtype, preferred, x, w), (x, w)


def _einsum_bwd(subscripts, grad_dtype, preferred, residuals, g):
    x, w = residuals
    x_sub, w_sub, out = _terms(subscripts)
    _, input_grad = jax.vjp(lambda x: jnp.einsum(subscripts, x, w.astype(x.dtype),
                                                 preferred_element_type=preferred), x)
    dw = jnp.einsum(f"{x_sub},{out}->{w_sub}", x, g, preferred_element_type=grad_dtype)
    return input_grad(g)[0], _like(dw, w)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def _like(d: jax.Array, w: jax.Array) -> jax.Array:
    """Gradient ``d`` as w's cotangent: summed (in d's dtype) over the manual mesh axes
    it varies over and w does not (what the transpose of JAX's implicit broadcast of w
    to the activations' axes does inside ``shard_map``), in w's dtype."""
    extra = tuple(varying(d) - varying(w))
    return (lax.psum(d, extra) if extra else d).astype(w.dtype)


def weight_ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                      grad_dtype=None) -> jax.Array:
    """``lax.ragged_dot(x, w.astype(x.dtype), group_sizes)`` (rows x [M, K] in groups,
    w [G, K, N]), w's gradient computed in ``grad_dtype`` (None: x's, as JAX does)."""
    if grad_dtype is None:
        return lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
    return _ragged(jnp.dtype(grad_dtype), x, w, group_sizes)


# w's gradient [G, K, N]: each group's rows of x [M, K] against its rows of dy [M, N],
# the row dim contracted group by group.
_PER_GROUP = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(grad_dtype, x, w, group_sizes):
    return lax.ragged_dot(x, w.astype(x.dtype), group_sizes)


def _ragged_fwd(grad_dtype, x, w, group_sizes):
    return _ragged(grad_dtype, x, w, group_sizes), (x, w, group_sizes)


def _ragged_bwd(grad_dtype, residuals, g):
    x, w, group_sizes = residuals
    _, input_grad = jax.vjp(lambda x: lax.ragged_dot(x, w.astype(x.dtype), group_sizes), x)
    dw = lax.ragged_dot_general(x, g, group_sizes, _PER_GROUP, preferred_element_type=grad_dtype)
    return input_grad(g)[0], _like(dw, w), None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def bias_add(x: jax.Array, bias: jax.Array, grad_dtype=None) -> jax.Array:
    """``x + bias.astype(x.dtype)`` (bias over x's last dims), the bias's gradient (dy
    summed over x's leading dims) summed in ``grad_dtype`` (None: x's, as JAX does)."""
    if grad_dtype is None:
        return x + bias.astype(x.dtype)
    return _bias(jnp.dtype(grad_dtype), x, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bias(grad_dtype, x, bias):
    return x + bias.astype(x.dtype)


def _bias_fwd(grad_dtype, x, bias):
    return _bias(grad_dtype, x, bias), bias


def _bias_bwd(grad_dtype, bias, g):
    leading = tuple(range(g.ndim - bias.ndim))
    return g, _like(g.astype(grad_dtype).sum(leading), bias)


_bias.defvjp(_bias_fwd, _bias_bwd)
