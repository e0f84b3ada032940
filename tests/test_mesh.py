import jax
import pytest

from jmegatron.sharding import MESH_AXES, MeshConfig, make_mesh


def test_minus_one_takes_the_rest():
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == MeshConfig(2, 2, 1, 2)
    assert MeshConfig(data=-1, fsdp=1).resolve(8).data == 8


@pytest.mark.parametrize("config, n, message", [
    (MeshConfig(data=2, fsdp=2, tensor=4), 8, "needs 16 devices, but 8"),
    (MeshConfig(data=-1, fsdp=-1), 8, "at most one mesh axis may be -1"),
    (MeshConfig(data=3, fsdp=-1), 8, "8 is not divisible by 3"),
    (MeshConfig(data=0, fsdp=-1), 8, "got {'data': 0}"),
])
def test_bad_mesh_configs_name_the_numbers(config, n, message):
    with pytest.raises(ValueError, match=message):
        config.resolve(n)


def test_make_mesh_builds_auto_axes():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1,
                                "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_make_mesh_on_a_subset_of_devices():
    mesh = make_mesh(MeshConfig(fsdp=1, tensor=2), jax.devices()[:2])
    assert mesh.size == 2 and mesh.shape["tensor"] == 2
