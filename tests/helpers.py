"""Building blocks shared by the layout and checkpoint tests."""

import dataclasses
import functools
import math

import jax
import numpy as np
import optax
from flax import nnx

from jmegatron.optim import coefficient_set, trainable_params
from jmegatron.sharding import make_mesh
from jmegatron.sharding.layouts import make_layout
from jmegatron.optim.codec import LeafCodec
from jmegatron.train.checkpoint import Checkpointer, abstract_of, leaf_codecs
from jmegatron.train.programs import build_state


def mesh_of(mesh_config):
    """The mesh of ``mesh_config`` (no axis -1) on the first devices it needs."""
    return make_mesh(mesh_config, jax.devices()[:math.prod(mesh_config.sizes().values())])


def layout_of(mesh, layout_name, train):
    """The layout ``layout_name`` on ``mesh`` with ``train``'s options."""
    return make_layout(layout_name, mesh.shape, assignment=train.assignment,
                       repeats=train.pipeline.repeats, schedule=train.pipeline.schedule,
                       owner_group=train.owner_group or "fsdp")


def build(mesh, layout_name, model, train):
    """(layout, optimizer, graphdef, state) of ``model`` under a layout, born sharded, as
    the trainer builds them (``train.programs.build_state``)."""
    layout = layout_of(mesh, layout_name, train)
    optimizer, graphdef, init = build_state(train, dataclasses.replace(
        model, **layout.stack_fields), mesh, layout)
    return layout, optimizer, graphdef, init()


def codecs_for(model, layout, optimizer, state):
    cfg = dataclasses.replace(model, **layout.stack_fields)
    return cfg, leaf_codecs(state, optimizer.plan)


def randomized(state, seed=0):
    """Every float leaf replaced by distinct random values (same shape and sharding)."""
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [jax.device_put(jax.random.normal(k, x.shape, x.dtype), x.sharding)
           if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x
           for k, x in zip(keys, leaves)]
    return treedef.unflatten(out)


def grads_of(params, seed):
    """Random gradients for the trained leaves, in their params' shardings."""
    leaves, treedef = jax.tree.flatten(trainable_params(params))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([jax.device_put(jax.random.normal(k, x.shape), x.sharding)
                              for k, x in zip(keys, leaves)])


def optimizer_step(tx):
    """(params, opt_state, grads) -> (trained params after the step, opt_state)."""
    def step(params, opt_state, grads):
        trained = trainable_params(params)
        updates, opt_state = tx.update(grads, opt_state, trained)
        return optax.apply_updates(trained, updates), opt_state
    return step


@functools.cache
def stepper(tx):
    """The jitted step of ``tx`` (one per transformation: a start placed alike reuses it)."""
    step = optimizer_step(tx)

    @jax.jit
    def full(params, opt_state, grads):
        trained, opt_state = step(params, opt_state, grads)
        return nnx.merge_state(params, trained), opt_state
    return full


def three_steps(tx, params, opt_state):
    """Params after three steps of ``tx`` on the random gradients of seeds 0, 1, 2."""
    for seed in range(3):
        params, opt_state = stepper(tx)(params, opt_state, grads_of(params, seed))
    return params


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    got = jax.device_get(got)
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def ns_roundoff(coefficients="quintic") -> float:
    """How far apart two fp32 Newton-Schulz results may lie, relative to their largest
    entry, when their programs round differently (another layout's summation order,
    another fusion): each iteration multiplies an error along the smallest singular
    directions by its slope at zero, its ``a``, so one rounding (2**-24) grows by the
    product of the a's (quintic: 492x, 2.9e-5; dion2's Polar Express: 991x, 5.9e-5)."""
    cs = coefficient_set(coefficients)
    return math.prod(a for a, _, _ in cs.schedule(cs.default_steps)) * 2.0 ** -24


def relative_miss(got, want, start=0.0) -> float:
    """The largest miss of ``got`` from ``want``, relative to the largest entry of
    ``want - start`` (an update's, when ``start`` is the params it was applied to;
    absolute where that is all zero)."""
    got, want = np.asarray(got), np.asarray(want)
    scale = np.abs(want - start).max()
    return float(np.abs(got - want).max() / (scale if scale > 0 else 1.0))


def canonical(tree, codecs):
    """``tree`` in its canonical (checkpoint) form, on the host."""
    is_codec = lambda c: isinstance(c, LeafCodec)
    return jax.device_get(jax.jit(lambda s: jax.tree.map(lambda c, x: c.encode(x), codecs, s,
                                                          is_leaf=is_codec))(tree))


def assert_restores(folder, tree, codecs, target, target_codecs):
    """A checkpoint of ``tree`` restored into ``target``'s layout holds the same
    canonical values."""
    saver = Checkpointer(folder)
    saver.save(1, tree, codecs, {})
    saver.finish()
    restored, _ = saver.restore(1, abstract_of(target), target_codecs)
    saver.close()
    for a, b in zip(jax.tree.leaves(canonical(tree, codecs)),
                    jax.tree.leaves(canonical(restored, target_codecs))):
        np.testing.assert_array_equal(a, b)
