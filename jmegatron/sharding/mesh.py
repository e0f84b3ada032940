"""Device meshes with the six jmegatron axes: stage, data, fsdp, expert, context, tensor.

The mesh is an ordered axis -> size mapping; what each axis does is the rules'
business (``jmegatron.sharding.rules``): which logical axes it splits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np

MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")   # outermost first
# The batch is split over every axis that holds a different slice of data.
BATCH_AXES = ("data", "fsdp", "expert")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; exactly one may be -1, meaning "the rest"."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1
    stage: int = 1
    """Pipeline stages: the layer stacks split into this many contiguous parts."""
    context: int = 1
    """Context parallelism: each sequence split into this many parts along T."""

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_AXES}

    def resolve(self, n_devices: int) -> "MeshConfig":
        """Returns the config with -1 replaced; raises ValueError naming the numbers."""
        sizes = self.sizes()
        bad = {k: v for k, v in sizes.items() if v != -1 and v < 1}
        if bad:
            raise ValueError(f"mesh axis sizes must be >= 1 or -1, got {bad}")
        rest = [k for k, v in sizes.items() if v == -1]
        if len(rest) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {rest}")
        fixed = math.prod(v for v in sizes.values() if v != -1)
        if rest:
            if n_devices % fixed:
                raise ValueError(
                    f"{n_devices} devices cannot be split as {self._show(sizes)}: "
                    f"{n_devices} is not divisible by {fixed}")
            sizes[rest[0]] = n_devices // fixed
        elif fixed != n_devices:
            raise ValueError(
                f"mesh {self._show(sizes)} needs {fixed} devices, but {n_devices} "
                "are available (use -1 for one axis to take the rest)")
        return MeshConfig(**sizes)

    @staticmethod
    def _show(sizes: dict[str, int]) -> str:
        return " x ".join(f"{k}={v}" for k, v in sizes.items())

    def __str__(self) -> str:
        return self._show(self.sizes())


def make_mesh(config: MeshConfig = MeshConfig(),
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """Builds a mesh with Auto axes named ``MESH_AXES`` over ``devices`` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.resolve(len(devices)).sizes()
    shape = tuple(sizes[name] for name in MESH_AXES)
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == len(jax.devices()):
        # Lets JAX order devices for the physical topology (matters on GPUs/TPUs).
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                             axis_types=axis_types)


def axis_size(mesh: jax.sharding.Mesh, axes: str | Sequence[str] | None) -> int:
    """Product of the sizes of ``axes`` in ``mesh`` (1 for None)."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)
