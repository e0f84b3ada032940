"""bf16 on the wire: under the owner and fsdp layouts a bf16 model's weights are cast to
bf16 before they are gathered (norm scales and the router, which compute in
fp32, in fp32), and its gradients still equal one device's in bf16. With fp32
gradient sums (``GPTConfig.grad_reduce_dtype``) no sum adds bf16 buffers, and
layerwise's masters stay replicated.

XLA:CPU widens bf16 collectives to f32 when it compiles (its float normalization and
AllReducePromotion passes; GPUs keep them bf16): the owner gathers are read from the
program jmegatron hands the compiler, before optimization; the fsdp ones, which XLA
places, from the compiled program, where ``hlo`` counts a widened buffer at 2 bytes an
element (``Collective.widened``)."""

import dataclasses
import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers
from jmegatron.analysis import hlo_collectives, parse_collectives
from jmegatron.models import GPT, GPTConfig, MoEConfig
from jmegatron.models.gpt import ungroup
from jmegatron.optim import make_plan, trainable_params
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.rules import compute_dtype_of, spec_axes
from jmegatron.sharding.stacks import stack_of
from jmegatron.train import AdamWConfig, ScheduleConfig, TrainConfig, make_loss_fn, make_train_step

# One dense layer, three MoE layers: matmul weights, norm scales and routers.
MODEL = GPTConfig(vocab_size=300, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                  moe=MoEConfig(n_experts=4, top_k=2, d_ff=32, first_dense=1)).pad_vocab(2)
TRAIN = TrainConfig(lr=1e-2, steps=3, grad_clip=0.0, schedule=ScheduleConfig(warmup_steps=0),
                    adamw=AdamWConfig(eps=1e-4))
DENSE = dataclasses.replace(MODEL, moe=MoEConfig())
B, T = 16, 16
MESH = MeshConfig(data=2, fsdp=4, tensor=1)
OWNERS_DIVIDE = MeshConfig(data=4, fsdp=1)   # 4 owners, 4 layers: contiguous blocks


def batches():
    return [jax.random.randint(jax.random.key(i), (B, T + 1), 0, MODEL.vocab_size)
            for i in range(3)]


def setup(mesh, dtype, layout="owner", model=MODEL, microbatches=1):
    model = dataclasses.replace(model, dtype=dtype)
    layout, optimizer, graphdef, state = helpers.build(mesh, layout, model, TRAIN)
    cfg = dataclasses.replace(model, **layout.stack_fields)
    step = make_train_step(make_loss_fn(graphdef, cfg, mesh, layout), optimizer, microbatches,
                           mesh, layout.rules)
    return state, step


def gathers(dtype, prefetch=False):
    """[(dtype, shape)] of every all-gather the owner train step asks for, and
    {gathered shape: the dtype that weight computes in} of the stacked weights."""
    mesh = make_mesh(MESH)
    state, step = setup(mesh, dtype, model=dataclasses.replace(MODEL, prefetch=prefetch))
    text = step.lower(state, jax.device_put(batches()[0])).compiler_ir("hlo").as_hlo_text()
    found = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", text)
    want = {}
    for v in jax.tree.leaves(state.params, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        if stack_of(v) is not None:   # [G, g, ...]: gathered [g, ...]
            want.setdefault(tuple(v[...].shape[1:]), set()).add(compute_dtype_of(v).name)
    return found, want


@pytest.mark.parametrize("dtype, prefetch", [("float32", False), ("bfloat16", False),
                                             ("bfloat16", True)],
                         ids=["float32", "bfloat16", "bfloat16_prefetch"])
def test_owner_gathers_each_weight_in_the_dtype_it_computes_in(dtype, prefetch):
    """Each group of layers is gathered whole (with ``prefetch``, the dense stack's a
    group ahead): in bf16 for the matmul weights of a bf16 model (half the bytes), in
    fp32 for its norm scales and routers, and all in fp32 for an fp32 model, as
    before."""
    found, want = gathers(dtype, prefetch)
    short = {"float32": "f32", "bfloat16": "bf16"}
    weights = [(kind, tuple(int(n) for n in dims.split(","))) for kind, dims in found
               if tuple(int(n) for n in dims.split(",") if n) in want]
    assert len(weights) >= 2 * 5, found   # every stacked leaf, forward and backward
    for kind, shape in weights:
        assert len(want[shape]) == 1, want   # one dtype per gathered shape
        assert kind == short[dtype if want[shape] == {"bfloat16"} else "float32"], (kind, shape)
    assert any(kind == "f32" for kind, _ in weights)   # norm scales, routers
    assert dtype == "float32" or any(kind == "bf16" for kind, _ in weights)


def fsdp_layer_gathers(dtype):
    """The all-gathers of an fsdp train step that run once per layer (in the layer loops)."""
    mesh = make_mesh(MESH)
    state, step = setup(mesh, dtype, "fsdp", DENSE)
    report = hlo_collectives(step, state, jax.device_put(batches()[0]))
    return [c for c in report.select("all-gather") if c.executions == DENSE.n_layers]


def test_fsdp_gathers_a_bf16_models_weights_in_bf16():
    """Under fsdp XLA places the gathers, and it casts the layers' weights before it
    gathers them: bf16, half the bytes of an fp32 model's. (Read at f32 width, as
    XLA:CPU's program types them, this looked like an fp32 gather.)"""
    fp32, bf16 = fsdp_layer_gathers("float32"), fsdp_layer_gathers("bfloat16")
    assert fp32 and not any(c.widened for c in fp32), fp32
    assert bf16 and all(c.widened == c.buffers for c in bf16), bf16
    assert sum(c.buffer_bytes for c in bf16) * 2 == sum(c.buffer_bytes for c in fp32)


BF16 = dataclasses.replace(DENSE, dtype="bfloat16")
FP32_SUMS = dataclasses.replace(BF16, grad_reduce_dtype="float32")   # GPTConfig.grad_reduce_dtype


class Gradients(NamedTuple):
    grads: dict               # the weight gradients, as [L, ...] stacks
    collectives: object       # the compiled program's (hlo.CollectiveReport)
    dots: int                 # its dot instructions (loop bodies once)


@functools.cache
def gradients(mesh_config, layout="owner", model=BF16) -> Gradients:
    """The weight gradients of ``model``'s loss on one batch, with what its compiled
    program does (each setting compiled once; pipeline stages run 4 microbatches)."""
    mesh = helpers.mesh_of(mesh_config)
    layout, _, graphdef, state = helpers.build(mesh, layout, model, TRAIN)
    loss_fn = make_loss_fn(graphdef, dataclasses.replace(model, **layout.stack_fields), mesh,
                           layout, microbatches=4 if mesh_config.stage > 1 else 1)
    args = (trainable_params(state.params), jax.device_put(batches()[0]))
    compiled = jax.jit(jax.grad(lambda p, tokens: loss_fn(p, tokens)[0])).lower(*args).compile()
    text = compiled.as_text()
    return Gradients(ungroup(compiled(*args)), parse_collectives(text, mesh),
                     len(re.findall(r"= \S+ dot\(", text)))


ONE_DEVICE = MeshConfig(fsdp=1)   # on the first device


def assert_near_one_device(got, model):
    """Within bf16 round-off of one device's gradients: the weights are the same bf16
    values, but each rank's bf16 activations are rounded in another order (and
    without fp32 sums each rank's partial gradient is rounded to bf16 before the sum
    over ranks): 8 bits kept, a few roundings, 2% of the largest entry, as
    test_layouts' bf16 layerwise-against-fsdp check."""
    assert_near(got, gradients(ONE_DEVICE, model=model).grads)


def assert_near(got, want):
    """Each leaf of ``got`` within 2% of ``want``'s largest entry (bf16 round-off)."""
    want = dict(jax.tree_util.tree_leaves_with_path(want))
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = np.asarray(want[path])
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=2e-2 * np.abs(b).max(),
                                   err_msg=jax.tree_util.keystr(path))


LAYOUT_CASES = [("owner", BF16), ("owner", dataclasses.replace(BF16, prefetch=True)),
                ("fsdp", BF16)]
LAYOUT_IDS = ["owner", "owner_prefetch", "fsdp"]


@pytest.mark.parametrize("layout, model", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_bf16_gradients_equal_one_device_in_bf16(layout, model):
    """Under owner (its groups gathered in turn or a group ahead: ``prefetch``, with its
    own backward) and fsdp (data 2 x fsdp 4) a bf16 model's gradients, through the bf16
    gathers and their reductions, equal one device's in bf16 to bf16 round-off
    (``assert_near_one_device``). A dense model: in an MoE model bf16 activations
    summed in another order can flip a token's top-k experts, which changes the
    gradients by more than round-off."""
    assert_near_one_device(gradients(MESH, layout, model).grads, BF16)


# --- fp32 gradient sums: GPTConfig.grad_reduce_dtype="float32" ------------------------


def sums(report):
    """The all-reduces and reduce-scatters over more than one device."""
    return [c for kind in ("all-reduce", "reduce-scatter") for c in report.select(kind)
            if c.group_size > 1]


def wide(model):
    return dataclasses.replace(model, grad_reduce_dtype="float32")


@pytest.mark.parametrize("layout, model", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_fp32_gradient_sums_send_fp32_and_equal_one_device(layout, model):
    """With fp32 gradient sums every sum over devices adds the fp32 products (none is a
    bf16 buffer XLA:CPU widened, as the default's are), with more bytes; the weights
    are still gathered in bf16 (but the embedding table, looked up in fp32 so that its
    gradient accumulates in fp32); and the gradients equal one device's with fp32
    sums to bf16 round-off (a sum missing or repeated over a mesh axis: 2x off). The
    owner runners' remat policy saves the products' outputs as it saves dots
    (``rules.dots_policy``; their dot is hidden in a custom_vjp): no more dots."""
    (got, fp32, dots), (_, bf16, plain_dots) = (gradients(MESH, layout, wide(model)),
                                                 gradients(MESH, layout, model))
    widened = lambda collectives: sum(c.widened for c in collectives)
    moved = lambda collectives: sum(c.buffer_bytes * c.executions for c in collectives)
    assert sums(fp32) and widened(sums(fp32)) == 0 < widened(sums(bf16)), sums(fp32)
    assert moved(sums(fp32)) > moved(sums(bf16))
    assert widened(fp32.select("all-gather")) >= widened(bf16.select("all-gather")) - 1 > 0
    assert dots == plain_dots
    assert_near_one_device(got, FP32_SUMS)


@pytest.mark.parametrize("layout, mesh_config, model", [
    ("layerwise", OWNERS_DIVIDE, DENSE), ("owner", MeshConfig(stage=2, data=2, fsdp=2), DENSE),
    ("owner", MESH, MODEL)], ids=["layerwise", "stage2_owner", "owner_moe"])
def test_fp32_gradient_sums_under_layerwise_pipelines_and_moe(layout, mesh_config, model):
    """Layerwise's reduce-scatters onto 4 owners (``scatter.run_stack``), two pipeline
    stages (each stage's owner groups), and the MoE experts' grouped products
    (``models.products.weight_ragged_dot``, in their own ``shard_map``) sum fp32 too.
    The dense gradients equal one device's; the MoE model's, whose top-k choices bf16
    can flip between meshes, equal those of its bf16 sums on the same mesh, which
    differ from them by bf16 round-off only."""
    model = dataclasses.replace(model, dtype="bfloat16")
    got, fp32, _ = gradients(mesh_config, layout, wide(model))
    assert sums(fp32) and not any(c.widened for c in sums(fp32)), sums(fp32)
    if model.moe.n_experts:
        assert_near(got, gradients(mesh_config, layout, model).grads)
    else:
        assert_near_one_device(got, FP32_SUMS)


# --- layerwise: fp32 masters on their owners, bf16 weights gathered once a step ---------


def layerwise_plan(model, mesh_config):
    mesh = helpers.mesh_of(mesh_config)
    return make_plan(nnx.split(GPT(model, nnx.Rngs(0)))[1], mesh, "layerwise")


@pytest.mark.parametrize("model, mesh_config, kept", [
    (BF16, OWNERS_DIVIDE, True), (DENSE, OWNERS_DIVIDE, False), (BF16, MESH, False),
    (FP32_SUMS, OWNERS_DIVIDE, False)],
    ids=["bfloat16", "float32", "bfloat16_dealt", "bfloat16_fp32_sums"])
def test_layerwise_keeps_a_bf16_models_masters_on_their_owners(model, mesh_config, kept):
    """Megatron's distributed optimizer: a bf16 model's matrix stacks keep their fp32
    params where their state lives, split over the owners (the model computes with a
    bf16 copy, ``model_weights``); norm scales, embedding and head stay replicated. An
    fp32 model, stacks dealt round-robin (8 owners, 4 layers), and a bf16 model with
    fp32 gradient sums (whose bf16 copy would take bf16 gradients) keep replicated
    params, as before."""
    plan = layerwise_plan(model, mesh_config)
    stacks = [leaf for leaf in plan.leaves if leaf.is_matrix and "blocks" in leaf.path]
    assert len(stacks) == 4, [leaf.path for leaf in stacks]   # qkv, out, gate_up, down
    owners = set(plan.layout.owner_axes)
    on_owners = lambda spec: owners & {a for e in spec for a in spec_axes(e)}
    for leaf in plan.leaves:
        if leaf in stacks and kept:
            assert leaf.param == leaf.held and on_owners(leaf.param), leaf
            assert leaf.model.dtype == jnp.bfloat16 and not on_owners(leaf.model.spec), leaf
        else:
            assert leaf.model is None and not on_owners(leaf.param), leaf


def layerwise_gathers(dtype):
    """The all-gathers of a layerwise train step of two microbatches, on 4 owners."""
    mesh = helpers.mesh_of(OWNERS_DIVIDE)
    state, step = setup(mesh, dtype, "layerwise", DENSE, microbatches=2)
    report = hlo_collectives(step, state, jax.device_put(batches()[0]))
    stacked = sum(x.size for path, x in jax.tree.leaves_with_path(state.params)
                  if "blocks" in jax.tree_util.keystr(path) and x.ndim > 2)
    return report.select("all-gather"), stacked


def test_layerwise_gathers_a_bf16_models_weights_once_in_bf16():
    """fp32: the owners' updated matrices are gathered in fp32 after the update.
    bf16: the owners' masters are gathered once a step, before the microbatches, in
    bf16: half the bytes. (XLA places these gathers; XLA:CPU widens them, and
    ``hlo`` counts a widened buffer at 2 bytes.)"""
    (fp32, elements), (bf16, _) = layerwise_gathers("float32"), layerwise_gathers("bfloat16")
    moved = lambda gathers: sum(c.buffer_bytes * c.executions for c in gathers)
    assert fp32 and not any(c.widened for c in fp32), fp32
    assert moved(fp32) == 4 * elements, (moved(fp32), elements)
    assert bf16 and all(c.widened == c.buffers and c.executions == 1 for c in bf16), bf16
    assert moved(bf16) == 2 * elements, (moved(bf16), elements)
