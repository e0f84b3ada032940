"""The bench_layouts baseline is fair: optax.contrib.muon, given dimension numbers
read from jmegatron's routing, orthogonalizes the same matrices as jmegatron's
Muon (same coefficients, steps and scale) on fsdp-placed params, and hands every
other leaf to its own AdamW."""

import dataclasses

import chex
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import helpers
from experiments.bench_layouts import optax_dimension_numbers, optax_muon
from jmegatron.models import GPT, GPTConfig
from jmegatron.optim import make_plan, trainable_params
from jmegatron.optim.routing import batch_axes
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.train import MuonConfig, ScheduleConfig, TrainConfig, create_train_state
from jmegatron.train.optimizer import make_optimizer

# As many query as kv heads (as bench_layouts' model): split Q, K, V are then
# blocks of size 1 along the qkv axis, which optax sees as a batch axis.
MODEL = GPTConfig(vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                  d_ff=192).pad_vocab(1)
DimNums = optax.contrib.MuonDimensionNumbers


def train_config(scale: str, coefficients: str = "quintic") -> TrainConfig:
    return TrainConfig(lr=1e-2, steps=3, grad_clip=0.0, weight_decay=0.1,
                       schedule=ScheduleConfig(warmup_steps=0),
                       muon=MuonConfig(scale=scale, ns_coefficients=coefficients))


def abstract_params(model=MODEL):
    return nnx.split(nnx.eval_shape(lambda: GPT(model, nnx.Rngs(0))))[1]


def flat_dims(plan):
    """The dimension numbers, one entry (MuonDimensionNumbers or None) per trained leaf."""
    return jax.tree.leaves(optax_dimension_numbers(plan),
                           is_leaf=lambda x: x is None or isinstance(x, DimNums))


def test_every_matrix_gets_its_routed_axes_and_every_other_leaf_none():
    plan = make_plan(abstract_params()).for_optimizer()
    dims = flat_dims(plan)
    assert len(dims) == len(plan.leaves)
    assert any(leaf.is_matrix for leaf in plan.leaves)
    assert any(not leaf.is_matrix for leaf in plan.leaves)
    for leaf, dim in zip(plan.leaves, dims):
        if not leaf.is_matrix:
            assert dim is None, leaf.path
            continue
        spec = leaf.route.spec
        split = () if spec.split_axis is None else (spec.split_axis,)
        assert dim.reduction_axis == tuple(a for a in spec.in_axes if a not in split)
        assert dim.output_axis == tuple(a for a in spec.out_axes if a not in split)
        # optax's batch axes: the stacked layers (and a split axis), as routed.
        batch = set(range(len(leaf.shape))) - set(dim.reduction_axis) - set(dim.output_axis)
        assert batch == set(batch_axes(spec, len(leaf.shape))) | set(split), leaf.path


def test_unequal_blocks_are_refused():
    """Grouped-query Q (2 query heads per kv head) is one block of 2 along the qkv
    axis next to K and V of 1: no batch of equal matrices, so no dimension numbers."""
    gqa = dataclasses.replace(MODEL, n_kv_heads=2)
    with pytest.raises(ValueError, match="not equal"):
        optax_dimension_numbers(make_plan(abstract_params(gqa)))


def one_update(tx, state, grads):
    trained = trainable_params(state.params)
    return jax.jit(lambda g, s, p: tx.update(g, s, p)[0])(grads, state.opt_state, trained)


# spectral (bench_layouts' setting; optax's consistent_rms) is symmetric in fan-in
# and fan-out, as orthogonalization is; the shape scale sqrt(max(1, out/in)) is
# not, so it also catches reduction and output axes swapped. "simple" is one
# constant triple, which optax_muon hands over in optax's one-triple form.
@pytest.mark.parametrize("scale, coefficients", [("spectral", "quintic"), ("shape", "simple")])
def test_first_step_matches_jmegatron_muon(scale, coefficients):
    mesh = make_mesh(MeshConfig(fsdp=8))
    train = train_config(scale, coefficients)
    layout, ours, _, state = helpers.build(mesh, "fsdp", MODEL, train)
    theirs = optax_muon(train, ours)
    model = dataclasses.replace(MODEL, **layout.stack_fields)
    _, optax_state = create_train_state(lambda: GPT(model, nnx.Rngs(0)), theirs.tx,
                                        theirs.plan)   # its state placed by the fsdp plan
    chex.assert_trees_all_equal(state.params, optax_state.params)   # same init, same place
    grads = helpers.grads_of(state.params, 0)
    mine = jax.tree.leaves(one_update(ours.tx, state, grads))
    ref = jax.tree.leaves(one_update(theirs.tx, optax_state, grads))
    plan = ours.plan.for_optimizer()
    # One step from zero momentum: both directions are the gradient (optax's bias
    # correction only rescales it, and Newton-Schulz normalizes), so the matrices'
    # updates, weight decay included, agree to fp32 round-off.
    for leaf, a, b in zip(plan.leaves, mine, ref):
        if leaf.is_matrix:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(a).max(),
                                       err_msg=leaf.path)
    check_adam_leaves(train, plan, state, grads, ref)


def check_adam_leaves(train, plan, state, grads, ref):
    """optax's other leaves got its AdamW: Nesterov, no decay mask (what differs
    from jmegatron's AdamW, stated in ``optax_muon``)."""
    a = train.adamw
    adam = optax.adamw(train.lr, b1=a.b1, b2=a.b2, eps=a.eps, weight_decay=train.weight_decay,
                       nesterov=True)
    params = jax.tree.leaves(trainable_params(state.params))
    others = [i for i, leaf in enumerate(plan.leaves) if not leaf.is_matrix]
    g, p = [jax.tree.leaves(grads)[i] for i in others], [params[i] for i in others]
    want, _ = adam.update(g, adam.init(p), p)
    for i, w in zip(others, want):
        np.testing.assert_allclose(ref[i], w, rtol=1e-5, atol=1e-8, err_msg=plan.leaves[i].path)


def test_settings_optax_lacks_are_refused():
    """No silent mismatch: a jmegatron Muon setting optax.contrib.muon lacks raises."""
    ours = make_optimizer(train_config("spectral"), abstract_params())
    train = dataclasses.replace(train_config("spectral"),
                                muon=MuonConfig(scale="none", ns_dtype="bfloat16"))
    with pytest.raises(ValueError, match="scale 'none', bf16 Newton-Schulz"):
        optax_muon(train, ours)
