"""Building blocks shared by the layout and checkpoint tests."""

import dataclasses

import jax
from flax import nnx

from jmegatron.models import GPT
from jmegatron.sharding.layouts import make_layout
from jmegatron.train import create_train_state
from jmegatron.train.checkpoint import leaf_codecs
from jmegatron.train.optimizer import make_optimizer


def build(mesh, layout_name, model, train):
    """(layout, optimizer, graphdef, state) of ``model`` under a layout, born sharded."""
    layout = make_layout(layout_name, mesh.shape, assignment=train.assignment)
    cfg = dataclasses.replace(model, layer_group=layout.layer_group)
    make_model = lambda: GPT(cfg, nnx.Rngs(0))
    abstract = nnx.split(nnx.eval_shape(make_model))[1]
    optimizer = make_optimizer(train, abstract, mesh, layout)
    graphdef, state = create_train_state(make_model, optimizer.tx, optimizer.plan)
    return layout, optimizer, graphdef, state


def codecs_for(model, layout, optimizer, state):
    cfg = dataclasses.replace(model, layer_group=layout.layer_group)
    return cfg, leaf_codecs(state, optimizer.plan)


def randomized(state, seed=0):
    """Every float leaf replaced by distinct random values (same shape and sharding)."""
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [jax.device_put(jax.random.normal(k, x.shape, x.dtype), x.sharding)
           if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x
           for k, x in zip(keys, leaves)]
    return treedef.unflatten(out)
