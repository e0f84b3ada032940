"""Groups of whole layers run in turn, each group's all-gather issued one group ahead.

The owner layout stores each layer's weights whole on one rank: block weights
are stacked [G, g, ...] with the g axis split over the owner ranks, and group
i's g layers must be gathered before they run. ``run_prefetched`` issues the
all-gather of group i + 1 before group i computes and gives it no operand
computed from group i, so a latency-hiding scheduler (XLA's, on GPU/TPU) can
overlap the two; the backward runs the groups in reverse the same way: it
gathers group i - 1 while group i's gradients are computed, and the
reduce-scatter of group i's gradients onto their owners feeds nothing that
group i - 1 computes.

Two groups are whole at a time instead of one. ``run`` unrolls the group's
layers: as a loop of its own nested in the group loop, XLA copied the carried
group into it (a while loop may not share a buffer its caller's loop
overwrites), in both passes, which cost 2.9 groups' weights more per device.
Unrolled, measured on XLA:CPU against the unprefetched ``rules.run_gathered``:
+0.36 groups at 32 layers on 8 owners (5.57 against 5.09 MB; a group is
1.31 MB), -0.02 at 16. The price is compile time, g layers per group body.
It is an option (``GPTConfig.prefetch``), off by default: what it hides has
not been measured on a GPU.

The backward gathers each group again instead of keeping every group whole
(which would hold all weights on every device): the forward keeps what
``jax.checkpoint``'s ``dots_with_no_batch_dims_saveable`` policy keeps (the
outputs of the projections and the group's input), without the gathered
weights, which the backward puts back into each group's saved vjp.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jmegatron.sharding.rules import (active_mesh_and_rules, activation_sharding, dots_policy,
                                     manual_split, mesh_axes_of, scatter_to_owners, varying)

# run(x, whole, size) -> (x, stats): the first ``size`` layers of one group, ``whole``
# its gathered weights (each leaf [g, ...]); stats per layer and example [size, B, ...],
# which carry no gradient.
RunGroup = Callable[[jax.Array, list, int], tuple[jax.Array, dict]]

_SAVED = dots_policy()


def run_prefetched(run: RunGroup, x: jax.Array, leaves: Sequence[jax.Array],
                   leaf_axes: Sequence[Sequence[str | None]], name: str,
                   sizes: Sequence[int], dtypes: Sequence[jnp.dtype] | None = None,
                   grad_dtypes: Sequence[jnp.dtype] | None = None) -> tuple[jax.Array, dict]:
    """``x`` through groups 0..G-1 of ``leaves`` ([G, g, ...] each, dim 1 named
    ``name``, split over the owner ranks): ``run(x, whole_i, sizes[i])`` in turn;
    returns x and the groups' stats concatenated [sum(sizes), B, ...].

    Runs in ``jax.shard_map``, manual over the batch axes: each group moves by one
    all-gather over the mesh axes that split ``name``, issued a group ahead (see
    the module docstring); its gradients come back by one reduce-scatter onto
    those axes (plus the sum over the other batch axes). Inside, activations are
    constrained over the remaining (auto) axes only. Without an active mesh, the
    groups just run in turn.

    Args:
      run: runs the first ``size`` layers of one gathered group (``RunGroup``).
      x: activations [B, T, D].
      leaves: the stack's weights, each [G, g, ...].
      leaf_axes: each leaf's logical axes after the group axis (``name`` first).
      name: the logical axis of the layers within a group.
      sizes: static layers to run per group (all g, except perhaps the last).
      dtypes: per leaf, the dtype it computes in, gathered and reduced in
        (``rules.gather_in``); None: each leaf's own.
      grad_dtypes: per leaf, the dtype its gathered weight is handed to ``run`` in
        and its gradient summed in (``rules.gather_in``); None: ``dtypes``.
    """
    active = active_mesh_and_rules()
    dtypes = tuple(leaf.dtype for leaf in leaves) if dtypes is None else tuple(dtypes)
    grad_dtypes = dtypes if grad_dtypes is None else tuple(grad_dtypes)
    if active is None:
        return _groups(lambda i: [leaf[i] for leaf in leaves], run, x, sizes)
    mesh, rules = active
    split = manual_split(mesh, rules, mesh_axes_of(name, rules),
                         [(None, *axes) for axes in leaf_axes])

    def inner_run(x, whole, size):
        with activation_sharding(jax.sharding.get_abstract_mesh(), split.inner_rules):
            return run(x, whole, size)

    def body(x_block, *blocks):   # [B/dp, T, D], each [G, g/owners, ...]
        return _prefetching(inner_run, split.manual, split.owners, tuple(sizes),
                            dtypes, grad_dtypes)(x_block, list(blocks))

    return jax.shard_map(body, mesh=mesh, in_specs=(split.x_spec, *split.leaf_specs),
                         out_specs=(split.x_spec, split.stats_spec),
                         axis_names=set(split.manual))(x, *leaves)


def _groups(fetch, run, x, sizes):
    """Groups in turn, no collectives (one device)."""
    stats = []
    for i, size in enumerate(sizes):
        x, group_stats = run(x, fetch(i), size)
        stats.append(group_stats)
    return x, _concatenate(stats)


def _concatenate(stats: list) -> dict:
    return jax.tree.map(lambda *s: jnp.concatenate(s), *stats)


def _prefetching(run: RunGroup, manual: tuple[str, ...], owners: tuple[str, ...],
                 sizes: tuple[int, ...], dtypes: tuple[jnp.dtype, ...],
                 grad_dtypes: tuple[jnp.dtype, ...]):
    """The custom-vjp group loop of ``run_prefetched`` on local blocks."""
    groups = len(sizes)

    def gather(blocks, i):
        """Group i whole, each leaf [g, ...] gathered in its compute dtype and handed on
        in its gradient's, typed as varying over every batch axis: a group's vjp then
        leaves the sum over the batch axes to ``scatter`` (in ``sum_dtype``, after
        the reduce-scatter)."""
        local = [jax.lax.dynamic_index_in_dim(b, i, keepdims=False).astype(dtype)
                 for b, dtype in zip(blocks, dtypes)]
        whole = [(jax.lax.all_gather(b, owners, axis=0, tiled=True) if owners else b)
                 .astype(wide) for b, wide in zip(local, grad_dtypes)]
        rest = lambda w: tuple(a for a in manual if a not in varying(w))
        return [jax.lax.pcast(w, rest(w), to="varying") if rest(w) else w for w in whole]

    def scatter(grads, blocks):
        """Each leaf [g, ...] -> this rank's [g/owners, ...] of one group, summed
        over the batch axes the block does not vary over (in its ``sum_dtype``)."""
        return [scatter_to_owners(d, owners, tuple(varying(d) - varying(b)),
                                  b.dtype) for d, b in zip(grads, blocks)]

    layouts = {}   # full (0) and last group: where the weights sit among the vjp's residuals

    def forward_group(i, x, whole):
        """(y, stats, the residuals to save: group i's vjp without its weights); i is
        0 for any full group (they share one trace) or G-1."""
        run_i = functools.partial(run, size=sizes[i])
        y, vjp, stats = jax.vjp(jax.checkpoint(run_i, policy=_SAVED), x, whole, has_aux=True)
        leaves, treedef = jax.tree.flatten(vjp)
        where = [next((k for k, w in enumerate(whole) if r is w), None) for r in leaves]
        layouts[i] = (treedef, where)
        return y, stats, [r for r, k in zip(leaves, where) if k is None]

    def backward_group(i, saved, whole, dy):
        treedef, where = layouts[i]
        kept = iter(saved)
        return treedef.unflatten([next(kept) if k is None else whole[k] for k in where])(dy)

    def primal(x, blocks):
        return fwd(x, blocks)[0]

    def fwd(x, blocks):
        whole, saved, stats = gather(blocks, 0), None, []
        if groups > 1:   # groups 0..G-2 are full: one scan; the last may be shorter
            def step(carry, i):
                x, whole = carry
                ahead = gather(blocks, i + 1)   # issued before group i, independent of it
                x, group_stats, kept = forward_group(0, x, whole)
                return (x, ahead), (group_stats, kept)
            (x, whole), (full, saved) = jax.lax.scan(step, (x, whole), jnp.arange(groups - 1))
            stats.append(jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), full))
        x, last_stats, last = forward_group(groups - 1, x, whole)
        return (x, _concatenate([*stats, last_stats])), (blocks, saved, last)

    def bwd(res, cotangents):
        dy, _ = cotangents   # the stats carry no gradient
        blocks, saved, last = res
        whole = gather(blocks, once(groups - 1, dy))
        ahead = gather(blocks, once(groups - 2, dy)) if groups > 1 else None
        dy, d_whole = backward_group(groups - 1, last, whole, dy)
        d_last = scatter(d_whole, blocks)
        if groups == 1:
            return dy, [d[None] for d in d_last]

        def step(carry, inputs):
            dy, whole = carry
            i, kept = inputs
            # Issued before group i's gradients; typed like the carry (which
            # ``once`` made vary over every batch axis: a type, no communication).
            ahead = [jax.lax.pcast(a, tuple(varying(w) - varying(a)), to="varying")
                     for a, w in zip(gather(blocks, i - 1), whole)]
            dy, d_whole = backward_group(0, kept, whole, dy)
            return (dy, ahead), scatter(d_whole, blocks)

        # Groups G-2..1 in a scan, each gathering the one before it; then group 0.
        middle = jax.tree.map(lambda r: r[1:][::-1], saved)
        (dy, whole), d_middle = jax.lax.scan(step, (dy, ahead),
                                             (jnp.arange(groups - 2, 0, -1), middle))
        dy, d_whole = backward_group(0, jax.tree.map(lambda r: r[0], saved), whole, dy)
        d_first = scatter(d_whole, blocks)
        return dy, [jnp.concatenate([f[None], m[::-1], l[None]])
                    for f, m, l in zip(d_first, d_middle, d_last)]

    loop = jax.custom_vjp(primal)
    loop.defvjp(fwd, bwd)
    return loop


def once(i: int, dep: jax.Array) -> jax.Array:
    """The index ``i``, known only once ``dep`` is computed. The backward's first
    gathers take it, so no scheduler hoists them above the forward (which would
    hold two more groups whole all along it); XLA's CPU pipeline drops
    ``optimization_barrier``s before scheduling, so the dependence is data."""
    late = jnp.isnan(dep.ravel()[0]).astype(jnp.int32)   # 0, opaque to the compiler
    return jnp.minimum(i, i + late)


