"""Pallas kernels for the matrix optimizers."""

from jmegatron.optim.kernels.syrk_kernel import (BACKENDS, DEFAULT_BLOCK, DEFAULT_BLOCK_K,
                                                 SyrkPlan, resolve_backend, syrk, syrk_flops,
                                                 syrk_plan, tile_of)

__all__ = ["syrk", "syrk_flops", "syrk_plan", "SyrkPlan", "tile_of", "resolve_backend",
           "BACKENDS", "DEFAULT_BLOCK", "DEFAULT_BLOCK_K"]
