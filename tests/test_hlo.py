"""The HLO inspector against programs whose communication we know."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jmegatron.analysis import hlo_collectives, parse_collectives
from jmegatron.sharding import MeshConfig, make_mesh


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))


@pytest.fixture(scope="module")
def report(mesh):
    def body(x):                                       # x_block [8, 8] f32: 256 bytes
        a = lax.psum(x, "tensor")
        b = lax.all_gather(x, "data", tiled=True)      # gathers [16, 8]
        c = lax.psum_scatter(x, "tensor", scatter_dimension=0, tiled=True)
        d = lax.all_to_all(x, "tensor", 0, 0, tiled=True)
        e = lax.ppermute(x, "data", [(0, 1), (1, 0)])
        loop, _ = lax.scan(lambda c, _: (lax.psum(c, "data") * 0.5, None), x, None, length=3)
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + loop.sum()

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("data", "tensor"), out_specs=P(),
                       check_vma=False)
    return hlo_collectives(fn, jnp.ones((16, 32)), mesh=mesh)


def test_every_kind_is_found_with_its_axes(report):
    assert report.count("all-reduce", ("tensor",)) == 1
    assert report.count("all-gather", ("data",)) == 1
    assert report.count("reduce-scatter", ("tensor",)) == 1
    assert report.count("all-to-all", ("tensor",)) == 1
    assert report.count("collective-permute", ("data",)) == 1


def test_loop_trip_counts_multiply(report):
    (looped,) = report.select("all-reduce", ("data",))
    assert looped.executions == 3
    assert report.count("all-reduce", ("data",)) == 3


def test_bytes_follow_the_ring_formulas(report):
    n = 8 * 8 * 4   # one [8, 8] f32 block
    assert report.bytes_per_device("all-reduce", ("tensor",)) == 2 * 3 / 4 * n
    assert report.bytes_per_device("all-gather", ("data",)) == 1 / 2 * (2 * n)
    assert report.bytes_per_device("reduce-scatter", ("tensor",)) == 3 / 4 * n
    assert report.bytes_per_device("all-to-all", ("tensor",)) == 3 / 4 * n
    assert report.bytes_per_device("collective-permute", ("data",)) == n
    assert report.bytes_per_device("all-reduce", ("data",)) == 3 * (2 * 1 / 2 * n)


def test_table_lists_every_row(report):
    text = report.table()
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                 "collective-permute"):
        assert kind in text


def test_bf16_collectives_count_at_bf16_width_where_xla_cpu_widens_them(mesh):
    """XLA:CPU widens bf16 collectives to f32 (a convert before, another after): the
    report counts them at 2 bytes an element, as an accelerator sends them; f32
    values stay at 4."""
    def body(x):                                       # x_block [8, 8] f32
        half = x.astype(jnp.bfloat16)
        return (lax.all_gather(half, "data", tiled=True).astype(jnp.float32).sum()
                + lax.psum(half, "tensor").astype(jnp.float32).sum()
                + lax.all_gather(x, "data", tiled=True).sum())

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("data", "tensor"), out_specs=P(),
                       check_vma=False)
    report = hlo_collectives(fn, jnp.ones((16, 32)), mesh=mesh)
    n = 8 * 8   # elements of one block
    gathers = sorted((c.widened, c.buffer_bytes) for c in report.select("all-gather"))
    assert gathers == [(0, 2 * n * 4), (1, 2 * n * 2)], report.collectives
    (summed,) = report.select("all-reduce", ("tensor",))
    assert (summed.widened, summed.buffer_bytes) == (1, n * 2), summed


def test_a_program_without_communication_has_none(mesh):
    fn = jax.jit(lambda x: x * 2, in_shardings=jax.NamedSharding(mesh, P("data")))
    report = hlo_collectives(fn, jnp.ones((8, 4)))
    assert report.collectives == () and "no collectives" in report.table()


HLO = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %x = f32[4,8]{1,0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  %y = f32[4,8]{1,0} all-reduce(%x), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
  %z = (f32[4,8]{1,0}, bf16[4,8]{1,0}) all-reduce(%y, %y), channel_id=3, replica_groups=mesh['a'=2,'b'=2,'c'=2] {'b','c'}, use_global_device_ids=true, to_apply=%add
  %w = f32[4,8]{1,0} all-reduce(%y), channel_id=4, replica_groups=mesh['a'=1,'b'=4,'c'=2], device_ids=([2,2,2]T(1,0,2)) {'b':(1)2}, use_global_device_ids=true, to_apply=%add
  %g = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%y), channel_id=5, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %d = f32[8,8]{1,0} all-gather-done(%g)
}
"""


def test_parses_every_replica_group_form():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    report = parse_collectives(HLO, mesh)
    by_name = {c.name: c for c in report.collectives}
    assert by_name["x"].axes == ("tensor",)            # iota [4,2]: consecutive pairs
    assert by_name["y"].axes == ("data", "fsdp")       # transposed iota: stride-2 quads
    assert by_name["z"].axes == ("fsdp", "tensor")     # mesh form, named axes
    assert by_name["z"].buffers == 2 and by_name["z"].buffer_bytes == 128 + 64
    # device_ids [2,2,2]T(1,0,2) are 0,1,4,5,2,3,6,7; as b=4 x c=2 the rows of b
    # are [0,1],[4,5],[2,3],[6,7]; the major half of b pairs rows 0-2 and 1-3:
    # groups {0,2},{1,3},{4,6},{5,7}, which differ along fsdp.
    assert by_name["w"].axes == ("fsdp",)
    assert by_name["g"].kind == "all-gather" and by_name["g"].buffer_bytes == 256
    assert by_name["g"].axes == ("data",)
    assert report.count("all-reduce") == 5 and report.launches("all-reduce") == 4


def test_unparsed_collectives_raise_instead_of_reporting_none():
    broken = HLO.replace("%x = f32", "%x := f32")   # a line this parser cannot read
    with pytest.raises(ValueError, match="5 collective instructions but only 4"):
        parse_collectives(broken)
    with pytest.raises(ValueError, match="no ENTRY"):
        parse_collectives("HloModule m")


def test_a_program_read_back_from_the_runs_compile_cache_reads_the_same(mesh):
    """tests/conftest.py gives the run one compile cache: an executable read back from it
    has the HLO text, memory and cost analysis the tests read from a fresh compile."""
    from jax import monitoring

    def compiled():
        fn = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0),
                     in_shardings=jax.NamedSharding(mesh, P("data", "tensor")))
        return fn.lower(np.ones((16, 32), np.float32)).compile()

    def seen(c):
        memory = c.memory_analysis()
        # the instructions, without source metadata (its stack frames' numbering varies)
        text = [re.sub(r", metadata=\{[^}]*\}", "", line)
                for line in c.as_text().splitlines() if " = " in line]
        return (text, memory.temp_size_in_bytes, memory.argument_size_in_bytes,
                memory.output_size_in_bytes, c.cost_analysis()["flops"])

    hits = []
    listener = lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None
    kept = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)   # keep this one
    monitoring.register_event_listener(listener)
    try:
        jax.clear_caches()
        fresh = seen(compiled())
        jax.clear_caches()
        read_back = seen(compiled())
    finally:
        monitoring.unregister_event_listener(listener)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", kept)
    # the second compile, the in-memory caches cleared, can only come from the disk
    assert len(hits) == 1 and any("all-gather" in line for line in fresh[0])
    assert read_back == fresh
