"""Meshes and logical-axis rules, and the layouts and runners built on them."""

from jmegatron.sharding.mesh import BATCH_AXES, MESH_AXES, MeshConfig, axis_size, make_mesh
from jmegatron.sharding.rules import (DATA_PARALLEL_RULES, DEFAULT_RULES, AxisRoles, Rules,
                                      activation_sharding, active_mesh_and_rules, axis_roles,
                                      check_divisible, constrain, logical_to_spec,
                                      mesh_axes_of, with_rules)

__all__ = [
    "BATCH_AXES", "MESH_AXES", "MeshConfig", "make_mesh", "axis_size",
    "DEFAULT_RULES", "DATA_PARALLEL_RULES", "Rules", "with_rules", "mesh_axes_of",
    "logical_to_spec", "check_divisible", "activation_sharding", "constrain",
    "active_mesh_and_rules", "AxisRoles", "axis_roles",
]
