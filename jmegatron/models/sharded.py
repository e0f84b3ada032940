"""Creating NNX modules directly sharded, from the logical axes of their params."""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jmegatron.sharding.rules import (BATCH, DEFAULT_RULES, Rules, check_divisible,
                                      check_vocab_apart_from_batch, logical_axes_of,
                                      logical_to_spec)

M = TypeVar("M", bound=nnx.Module)


def validate_sharding(logical_dims: Mapping[str, int], mesh_shape: Mapping[str, int],
                      rules: Rules = DEFAULT_RULES, batch_size: int | None = None) -> None:
    """Checks before any compile that every sharded dim divides by its mesh axes.

    Also checks that no mesh axis splits both the vocabulary and the batch.

    Args:
      logical_dims: the size of each logical axis, from the model config
        (``GPTConfig.logical_dims()``).
      mesh_shape: mesh axis -> size, from ``mesh.shape`` or
        ``MeshConfig.resolve(n).sizes()``.
      rules: the logical-to-mesh axis rules.
      batch_size: the global batch, checked against the batch axes; None: not
        checked.

    Raises:
      ValueError: naming the numbers, e.g. "kv_heads=2 is not divisible by
        tensor=4".
    """
    dims = dict(logical_dims)
    if batch_size is not None:
        dims[BATCH] = batch_size
    check_divisible(dims, mesh_shape, rules)
    check_vocab_apart_from_batch(mesh_shape, rules)


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh,
                    rules: Rules = DEFAULT_RULES) -> nnx.State:
    """NamedSharding of every variable in ``state`` under ``rules``.

    Args:
      state: an nnx.State (real or abstract); a variable without logical axes is
        replicated.
      mesh: the device mesh.
      rules: the logical-to-mesh axis rules.

    Returns:
      ``state``'s structure with a NamedSharding per variable.
    """
    def sharding(v: nnx.Variable) -> NamedSharding:
        names = logical_axes_of(v) or (None,) * len(v.shape)
        return NamedSharding(mesh, logical_to_spec(names, rules))

    return jax.tree.map(sharding, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def create_sharded(make: Callable[[], M], mesh: jax.sharding.Mesh | None,
                   rules: Rules = DEFAULT_RULES) -> M:
    """Runs ``make()`` under ``jit`` with every param born in its final sharding.

    No full copy of the model ever exists on one device or on the host.

    Args:
      make: builds the module, e.g. ``lambda: GPT(cfg, nnx.Rngs(0))``; traced
        twice (once abstractly for the shardings).
      mesh: the device mesh; None: created on the default device.
      rules: the logical-to-mesh axis rules that place each param.

    Returns:
      The module, its params sharded.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    out = None if mesh is None else state_shardings(abstract, mesh, rules)
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=out)()
    return nnx.merge(graphdef, state)
