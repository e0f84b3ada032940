"""The optimizer family under every layout: MOP, AdaMuon, NorMuon, NAMO, REKLS and
Muon with Gram Newton-Schulz step like one device (with tensor parallelism), and
the owner layout's optimizer step needs no collective.

Two transformations cover all six at one compilation per layout: each matrix
kind of the model goes to another optimizer (``optax.multi_transform``), the
other leaves to Adam. Gradients are random, not a model's: every layout then
feeds bit-identical inputs to the per-matrix math (eigh, SVD, the second
moments' divisions), which would otherwise amplify summation-order round-off.
REKLS runs with eps = 0.3: at its default 1e-8, its first step on a block
preconditioned on both sides turns fp32 round-off into O(1) updates (see
tests/test_rekls.py), so a one-ulp difference between the batched and the
per-owner factor products would decide the result, not the layout. Even at
0.3, fp32 eigh leaves a floor: its eigenvectors err by about eps_mach |C| / gap,
and the factors of a few gradients have clustered spectra, so the per-owner
and batched eigh (ulp-apart inputs) give REKLS updates about 4e-6 apart
relative to their norm, whatever eps (measured for qkv under layerwise, eps
0.3 / 1 / 3: 5e-5 / 1.2e-5 / 4e-6 after one step, 7.6e-6 / 3.5e-6 / 3.3e-6
after three; replicated, which runs the same batched eigh as one device:
6e-8). REKLS leaves are therefore compared by the norm of the difference of
the updates; every other leaf element-wise.
"""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import (assert_restores, grads_of, ns_roundoff, optimizer_step, relative_miss,
                     stepper, three_steps)
from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPT, GPTConfig
from jmegatron.optim import (PlanSpec, make_plan, scale_by_adaptive_muon, scale_by_mop,
                             scale_by_muon, scale_by_rekls, trainable_params)
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import LAYOUTS, make_layout
from jmegatron.train import create_train_state
from jmegatron.train.checkpoint import leaf_codecs

MODEL = GPTConfig(vocab_size=259, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                  d_ff=64).pad_vocab(2)
LR = 0.02
TP = MeshConfig(data=2, fsdp=2, tensor=2)


def by_matrix(optimizers: dict[str, str]):
    """Labels: the optimizer named for each matrix kind (by path), "adam" elsewhere."""
    def labels(params):
        def label(path, _):
            key = jax.tree_util.keystr(path)
            return next((name for kind, name in optimizers.items() if f"'{kind}'" in key),
                        "adam")
        return jax.tree.map_with_path(label, params,
                                      is_leaf=lambda v: isinstance(v, nnx.Variable))
    return labels


def family(transforms: dict, optimizers: dict[str, str]):
    def make(**where):
        inner = {name: optax.chain(make_direction(**where), optax.scale(-LR))
                 for name, make_direction in transforms.items()}
        return optax.multi_transform({**inner, "adam": optax.adam(LR)}, by_matrix(optimizers))
    return make


# The matrix kinds a transformation sends to REKLS (compared by norm: see above), and
# to Newton-Schulz (compared to its round-off bound, helpers.ns_roundoff).
EIGENBASIS_KINDS = {"rekls_and_gram": ("qkv", "gate_up")}
NEWTON_SCHULZ_KINDS = {"muon_family": ("out", "gate_up", "down"), "rekls_and_gram": ("out", "down")}
TRANSFORMS = {
    "muon_family": family(
        {"mop": scale_by_mop,
         **{kind: functools.partial(scale_by_adaptive_muon, second_moment=kind)
            for kind in ("adamuon", "normuon", "namo")}},
        {"qkv": "mop", "out": "adamuon", "gate_up": "normuon", "down": "namo"}),
    "rekls_and_gram": family(
        {"rekls": functools.partial(scale_by_rekls, eps=0.3, max_precond_dim=32),
         "gram": functools.partial(scale_by_muon, ns_method="gram")},
        {"qkv": "rekls", "gate_up": "rekls", "out": "gram", "down": "gram"}),
}


@functools.cache
def built(name: str, layout_name: str, mesh_config: MeshConfig):
    mesh = make_mesh(mesh_config)
    layout = make_layout(layout_name, mesh.shape)
    make_model = lambda: GPT(dataclasses.replace(MODEL, **layout.stack_fields),
                             nnx.Rngs(0))
    plan = make_plan(nnx.split(nnx.eval_shape(make_model))[1], mesh, layout)
    tx = TRANSFORMS[name](plan=PlanSpec(mesh=mesh, layout=layout))
    _, state = create_train_state(make_model, tx, plan)
    return layout, tx, state, plan


@functools.cache
def one_device(name: str, layer_group: int):
    params = nnx.split(GPT(dataclasses.replace(MODEL, layer_group=layer_group), nnx.Rngs(0)))[1]
    tx = TRANSFORMS[name]()
    return jax.device_get(three_steps(tx, params, tx.init(trainable_params(params))))


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_three_steps_equal_one_device_with_tensor_parallelism(name, layout_name):
    """data 2 x fsdp 2 x tensor 2: matrices split over the tensor axis are gathered
    for the SVD, eigh and statistics (duplicated) or orthogonalized by Muon's
    tensor-parallel modes."""
    layout, tx, state, _ = built(name, layout_name, TP)
    start = jax.device_get(state.params)
    got = jax.device_get(three_steps(tx, state.params, state.opt_state))
    want = one_device(name, layout.layer_group)
    is_kind = lambda kinds, key: any(f"'{kind}'" in key for kind in kinds.get(name, ()))
    for (path, a), b, a0 in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want),
                                jax.tree.leaves(start)):
        key = jax.tree_util.keystr(path)
        if is_kind(EIGENBASIS_KINDS, key):
            error = np.linalg.norm(a - b) / np.linalg.norm(b - a0)
            assert error < 2e-5, (key, error)
        elif is_kind(NEWTON_SCHULZ_KINDS, key):
            miss = relative_miss(a, b, a0)
            assert miss < ns_roundoff(), (key, miss)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_owner_optimizer_step_has_no_collective(name):
    _, tx, state, _ = built(name, "owner", MeshConfig(fsdp=8))
    report = hlo_collectives(jax.jit(optimizer_step(tx)), state.params, state.opt_state,
                             grads_of(state.params, 0))
    assert report.collectives == (), report.table()


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_state_after_a_step_restores_on_another_layout(name, tmp_path):
    """owner -> layerwise (3 layers padded to the 2 data ranks): every field, the
    per-row and per-matrix second moments and REKLS's factors included, comes back
    with the same canonical values."""
    _, tx, state, plan = built(name, "owner", TP)
    params, opt_state = stepper(tx)(state.params, state.opt_state, grads_of(state.params, 0))
    stepped = state._replace(params=params, opt_state=opt_state)
    _, _, target, target_plan = built(name, "layerwise", TP)
    assert_restores(tmp_path, stepped, leaf_codecs(stepped, plan), target,
                    leaf_codecs(target, target_plan))
