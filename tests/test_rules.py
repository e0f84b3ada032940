import pytest
from jax.sharding import PartitionSpec as P

from jmegatron.models import GPTConfig, validate_sharding
from jmegatron.models.config import ConfigError
from jmegatron.sharding import (DATA_PARALLEL_RULES, DEFAULT_RULES, MeshConfig, axis_roles,
                                check_divisible, logical_to_spec, with_rules)


def test_logical_to_spec_maps_names():
    assert logical_to_spec(("layers", "embed", "mlp"), DEFAULT_RULES) == P(None, "fsdp", "tensor")
    assert logical_to_spec(("batch", "seq"), DEFAULT_RULES) == P(("data", "fsdp", "expert"), "context")
    assert logical_to_spec(("embed", "mlp"), DATA_PARALLEL_RULES) == P(None, None)


def test_a_mesh_axis_is_used_once_per_array():
    rules = with_rules(DEFAULT_RULES, layers="fsdp")
    assert logical_to_spec(("layers", "embed", "mlp"), rules) == P("fsdp", None, "tensor")


def test_unknown_logical_axis_raises():
    with pytest.raises(ValueError, match="'embedding' has no rule"):
        logical_to_spec(("embedding",), DEFAULT_RULES)
    with pytest.raises(ValueError, match="unknown logical axes"):
        with_rules(DEFAULT_RULES, embedding="fsdp")


def test_check_divisible_names_the_numbers():
    check_divisible({"heads": 8, "batch": 8}, {"data": 2, "fsdp": 2, "expert": 1, "tensor": 4},
                    DEFAULT_RULES)
    with pytest.raises(ValueError, match=r"batch=12 is not divisible by data=2 x fsdp=4 = 8"):
        check_divisible({"batch": 12}, {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1},
                        DEFAULT_RULES)


@pytest.mark.parametrize("model, mesh, batch, message", [
    (dict(n_heads=6, n_kv_heads=6, d_model=96), MeshConfig(fsdp=2, tensor=4), 8,
     "heads=6 is not divisible by tensor=4"),
    (dict(n_heads=8, n_kv_heads=2), MeshConfig(fsdp=2, tensor=4), 8,
     "kv_heads=2 is not divisible by tensor=4"),
    (dict(n_heads=4, n_kv_heads=4), MeshConfig(data=4, fsdp=1, tensor=2), 6,
     "batch=6 is not divisible by data=4"),
    (dict(d_model=100, n_heads=2, n_kv_heads=2), MeshConfig(fsdp=8), 8,
     "embed=100 is not divisible by fsdp=8"),
    (dict(d_ff=100, n_heads=8, n_kv_heads=8), MeshConfig(fsdp=1, tensor=8), 8,
     "mlp=100 is not divisible by tensor=8"),
])
def test_invalid_setups_raise_before_compiling(model, mesh, batch, message):
    cfg = GPTConfig(**model).pad_vocab(mesh.tensor)
    with pytest.raises(ValueError, match=message):
        validate_sharding(cfg.logical_dims(), mesh.resolve(8).sizes(), DEFAULT_RULES, batch)


def test_unpadded_vocab_under_tensor_parallelism_is_refused():
    cfg = GPTConfig(vocab_size=259)
    with pytest.raises(ValueError, match="vocab=259 is not divisible by tensor=2"):
        validate_sharding(cfg.logical_dims(), MeshConfig(fsdp=4, tensor=2).resolve(8).sizes())
    assert cfg.pad_vocab(2).vocab == 512 and cfg.pad_vocab(1).vocab == 384


@pytest.mark.parametrize("model, message", [
    (dict(n_heads=6, n_kv_heads=4), "n_heads=6 is not divisible by n_kv_heads=4"),
    (dict(d_model=100, n_heads=8, n_kv_heads=8), "d_model=100 is not divisible by n_heads=8"),
    (dict(remat="some"), "remat='some'"),
])
def test_inconsistent_model_configs_raise(model, message):
    with pytest.raises(ConfigError, match=message):   # one line from the CLI, not boxed
        GPTConfig(**model)


def test_vocab_sharing_a_mesh_axis_with_the_batch_is_refused():
    rules = with_rules(DEFAULT_RULES, act_vocab="fsdp")
    with pytest.raises(ValueError, match=r"act_vocab and batch both use mesh axes \['fsdp'\]"):
        validate_sharding(GPTConfig().pad_vocab(2).logical_dims(),
                          MeshConfig(data=2, fsdp=2, tensor=2).resolve(8).sizes(), rules, 8)


def test_the_rules_declare_what_each_mesh_axis_does():
    """The batch, sequence and stage roles are the rules' mapping of those logical axes;
    the axes holding other tokens (what a gradient is summed over) are the batch's and
    the sequence's."""
    roles = axis_roles(DEFAULT_RULES)
    assert (roles.batch, roles.sequence, roles.stages) == (("data", "fsdp", "expert"),
                                                           ("context",), ("stage",))
    assert roles.tokens == ("data", "fsdp", "expert", "context")
    assert roles.ranks({"stage": 2, "data": 2, "fsdp": 3, "expert": 1, "tensor": 4}) == 6
    assert roles.ranks({"stage": 2, "tensor": 4}, "stages") == 2
    assert roles.ranks({"context": 4, "data": 2}, "sequence") == 4
    data_parallel = axis_roles(DATA_PARALLEL_RULES)
    assert (data_parallel.batch, data_parallel.sequence) == (roles.batch, roles.sequence)
    split = axis_roles(with_rules(DEFAULT_RULES, seq="tensor"))
    assert split.sequence == ("tensor",)
    assert split.tokens == ("data", "fsdp", "expert", "tensor")
