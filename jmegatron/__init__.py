"""jmegatron: Megatron-style LLM training in JAX with distributed matrix optimizers.

Submodules load on first use, so ``import jmegatron`` stays fast:
``jmegatron.sharding``, ``jmegatron.models``, ``jmegatron.optim``,
``jmegatron.data``, ``jmegatron.train``, ``jmegatron.analysis``.
"""

import importlib

__version__ = "0.1.0"
_SUBMODULES = ("sharding", "models", "optim", "data", "train", "analysis")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"jmegatron.{name}")
    raise AttributeError(f"module 'jmegatron' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBMODULES))
