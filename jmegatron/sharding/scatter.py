"""Layers on weights every rank holds, their gradients reduce-scattered onto owners.

Under the layerwise layout every data rank holds all params, and each whole
matrix's optimizer state lives on one rank (a stack [L, ...] split over the
data axes in contiguous blocks where they divide L). Left to XLA, each
layer's weight gradients are all-reduced inside the backward loop and the
owners keep their slices: every rank receives every gradient. ``run_stack``
instead computes each rank's own (unreduced) gradients of the whole stack and
reduce-scatters them onto the owners: half the bytes of an all-reduce, each
rank receiving only the gradients it owns (Megatron's distributed optimizer
does the same).

It takes the stack twice: as the replicated weights the layers run on, and
as a view split over the owners (free: every rank already holds its block).
The gradient goes to the view only, so it leaves split like the optimizer
state and the optimizer's step slices nothing.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jmegatron.sharding.mesh import axis_size
from jmegatron.sharding.rules import (active_mesh_and_rules, activation_sharding, manual_split,
                                     only_batch_axes_live)

# run(x, leaves) -> (x, stats): the layers of one stack on its weights (each leaf
# [L, ...]); stats per layer and example [L, B, ...], which carry no gradient.
RunStack = Callable[[jax.Array, list], tuple[jax.Array, dict]]


def run_stack(run: RunStack, x: jax.Array, leaves: Sequence[jax.Array],
              reduce_dtypes: Sequence[jnp.dtype], owners: Sequence[str]):
    """``run(x, leaves)``, each leaf's gradient reduce-scattered along dim 0 onto the
    mesh axes ``owners`` (the layerwise layout's), in its ``reduce_dtypes`` entry.

    Runs in ``jax.shard_map``, manual over every mesh axis. Just ``run(x, leaves)``,
    and XLA's all-reduce, without an active mesh, inside a map already manual over
    the owners (a pipeline stage's: ``Layout.pipeline_batch_axes``), without owners, for a stack the
    owners do not divide (the layerwise state pads and deals those round-robin), or
    where an axis other than the batch axes is live (``only_batch_axes_live``).

    Args:
      run: the layers of one stack (``RunStack``); no ``shard_map`` of its own
        (its transpose would not lower nested: Shardy, jax 0.10.2).
      x: activations [B, T, D].
      leaves: the stack's weights, each [L, ...], replicated over the batch axes.
      reduce_dtypes: per leaf, the dtype its gradient is summed in
        (``rules.grad_dtype_of``): the one the layers compute with (bf16 matmul
        weights: half the bytes of fp32), as XLA sums them at the matmuls otherwise,
        or fp32 where the model computes its weight gradients in fp32.
      owners: the batch axes whose ranks own the stack's matrices, each rank a
        contiguous block of its layers.
    """
    active = active_mesh_and_rules()
    if active is None:
        return run(x, list(leaves))
    mesh, rules = active
    if set(owners) & set(jax.sharding.get_abstract_mesh().manual_axes):
        # A pipeline stage manual over the batch axes: it sums the whole step's
        # gradients over them itself, once (pipeline.over_stages).
        return run(x, list(leaves))
    split = manual_split(mesh, rules, tuple(owners), [() for _ in leaves])
    owners = split.owners
    if not owners or leaves[0].shape[0] % axis_size(mesh, owners):
        return run(x, list(leaves))

    # Only where no other axis is live: the stack then runs manual over every axis,
    # as on one device (with tensor axes left auto, Shardy gathers the weights over
    # them: only_batch_axes_live).
    if not only_batch_axes_live(mesh.shape, rules):
        return run(x, list(leaves))

    def inner_run(x, whole):
        with activation_sharding(None):
            return run(x, whole)

    def body(x_block, whole, views):
        return _scattering(inner_run, split.manual, owners, reduce_dtypes)(x_block, whole,
                                                                          views)

    n = len(leaves)
    return jax.shard_map(body, mesh=mesh, in_specs=(split.x_spec, [P()] * n, [P(owners)] * n),
                         out_specs=(split.x_spec, split.stats_spec),
                         axis_names=set(mesh.axis_names))(x, list(leaves), list(leaves))


def _scattering(run: RunStack, manual: tuple[str, ...], owners: tuple[str, ...],
                reduce_dtypes: Sequence[jnp.dtype]):
    """``run`` on local blocks: forward on ``whole`` (replicated), the gradient of
    each rank's rows reduce-scattered onto ``views`` (each leaf this rank's
    [L/owners, ...])."""
    others = tuple(a for a in manual if a not in owners)

    def primal(x, whole, views):
        del views
        return run(x, whole)

    def fwd(x, whole, views):
        del views
        # Varying: the vjp then gives this rank's gradients, not their sum.
        local = [jax.lax.pcast(w, manual, to="varying") for w in whole]
        y, vjp, stats = jax.vjp(run, x, local, has_aux=True)
        return (y, stats), vjp

    def bwd(vjp, cotangents):
        dy, _ = cotangents   # the stats carry no gradient
        dx, d_local = vjp(dy)
        def reduce(d, dtype):
            d_sum = jax.lax.psum_scatter(d.astype(dtype), owners, scatter_dimension=0,
                                         tiled=True)
            return (jax.lax.psum(d_sum, others) if others else d_sum).astype(d.dtype)
        return dx, None, [reduce(d, dtype) for d, dtype in zip(d_local, reduce_dtypes)]

    loop = jax.custom_vjp(primal)
    loop.defvjp(fwd, bwd)
    return loop
