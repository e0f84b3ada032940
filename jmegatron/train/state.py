"""The train state, created directly in its final sharding."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.optim.plan import ShardingPlan, trainable_params


class TrainState(NamedTuple):
    step: jax.Array          # int32 scalar: optimizer steps taken (skipped ones included)
    params: nnx.State        # fp32 master weights, and variables the step sets itself
    opt_state: optax.OptState
    skipped: jax.Array       # int32 scalar: steps skipped for non-finite gradients


def split_trained(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(what the optimizer trains: the nnx.Params, the other variables: the MoE
    expert bias, which the train step sets); ``nnx.merge_state`` joins them."""
    return nnx.split_state(params, nnx.Param, ...)


def train_state_shardings(abstract: TrainState, plan: ShardingPlan) -> TrainState:
    """Every leaf's sharding, read from the plan: params as it places them, the
    optimizer state by tree structure (``ShardingPlan.state_shardings``)."""
    replicated = NamedSharding(plan.mesh, P())
    return TrainState(replicated, plan.param_shardings(),
                      plan.state_shardings(abstract.opt_state), replicated)


def create_train_state(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation,
                       plan: ShardingPlan) -> tuple[nnx.GraphDef, TrainState]:
    """Builds params and optimizer state under ``jit`` with the shardings of ``plan``
    (``make_plan`` of the model's abstract params on a mesh), so no full copy of the
    model exists on the host or on one device. The optimizer gets the trained
    params only (``trainable_params``)."""
    graphdef, init = state_initializer(make_model, tx, plan)
    return graphdef, init()


def state_initializer(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation,
                      plan: ShardingPlan) -> tuple[nnx.GraphDef, Callable[[], TrainState]]:
    """``create_train_state``'s graphdef and its jitted state builder, to call again."""
    graphdef, _ = nnx.split(nnx.eval_shape(make_model))

    def init() -> TrainState:
        params = nnx.split(make_model())[1]
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, tx.init(trainable_params(params)), zero)

    shardings = train_state_shardings(jax.eval_shape(init), plan)
    return graphdef, jax.jit(init, out_shardings=shardings)
