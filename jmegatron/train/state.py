"""The train state, created directly in its final sharding."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.models.sharded import state_shardings
from jmegatron.sharding.rules import Rules


class TrainState(NamedTuple):
    step: jax.Array          # int32 scalar: optimizer steps taken (skipped ones included)
    params: nnx.State        # fp32 master weights
    opt_state: optax.OptState
    skipped: jax.Array       # int32 scalar: steps skipped for non-finite gradients


StatePlacement = Callable[[tuple], NamedSharding | None]


def follow_params(tree, abstract_params: nnx.State, param_shardings: nnx.State,
                  mesh: jax.sharding.Mesh, placed: StatePlacement = lambda path: None):
    """Shardings for an optimizer-state-like ``tree`` of abstract arrays.

    ``placed(path)`` decides first (an optimizer that places its own state, as
    Muon does under the layerwise layout). Otherwise a leaf whose path ends
    with a parameter's path and whose shape equals that parameter's (a
    momentum, a second moment) takes the parameter's sharding; every other
    leaf (counts, scalars) is replicated.
    """
    by_path = {tuple(path): (leaf.shape, sharding) for (path, leaf), sharding in
               zip(jax.tree.leaves_with_path(abstract_params), jax.tree.leaves(param_shardings))}
    longest = max(map(len, by_path), default=0)
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        if (sharding := placed(path)) is not None:
            return sharding
        for k in range(min(longest, len(path)), 0, -1):
            shape, sharding = by_path.get(tuple(path[-k:]), (None, None))
            if shape == leaf.shape:
                return sharding
        return replicated

    return jax.tree.map_with_path(pick, tree)


def create_train_state(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation,
                       mesh: jax.sharding.Mesh, rules: Rules,
                       placed: StatePlacement = lambda path: None
                       ) -> tuple[nnx.GraphDef, TrainState]:
    """Builds params and optimizer state under ``jit`` with their final shardings,
    so no full copy of the model exists on the host or on one device."""
    graphdef, abstract_params = nnx.split(nnx.eval_shape(make_model))

    def init() -> TrainState:
        params = nnx.split(make_model())[1]
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, tx.init(params), zero)

    abstract = jax.eval_shape(init)
    params = state_shardings(abstract_params, mesh, rules)
    replicated = NamedSharding(mesh, P())
    shardings = TrainState(replicated, params,
                           follow_params(abstract.opt_state, abstract_params, params, mesh,
                                         placed),
                           replicated)
    return graphdef, jax.jit(init, out_shardings=shardings)()
