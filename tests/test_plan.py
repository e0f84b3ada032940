"""A user's own optax chains around Muon, under every layout, on 8 CPU devices.

Each chain's state is created twice: by ``jax.jit(tx.init)`` (placed by the
constraints the skeleton puts in ``init``) and by ``create_train_state`` with
the plan alone (placed by tree structure, no hook). Either way the matrix state
must sit where the layout says, read from the arrays' own shards; three steps
(from the second) must equal one device's; the owner layout's optimizer step must need no
collective; and a checkpoint must restore on the next layout.
"""

import dataclasses
import functools

import jax
import optax
import pytest
from flax import nnx

from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPT, GPTConfig
from jmegatron.models.sharded import create_sharded
from jmegatron.optim import PlanSpec, make_plan, muon, scale_by_muon, trainable_params
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import LAYOUTS, make_layout
from jmegatron.train import create_train_state
from jmegatron.train.checkpoint import leaf_codecs

from helpers import assert_close, assert_restores, grads_of, optimizer_step, three_steps

MODEL = GPTConfig(vocab_size=259, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1,
                  d_ff=64).pad_vocab(1)
LR = 0.02
MATRICES = ("qkv", "out", "gate_up", "down")   # the user's own idea of a matrix


def user_labels(params):
    named = lambda path, _: ("matrix" if any(m in jax.tree_util.keystr(path) for m in MATRICES)
                             else "other")
    return jax.tree.map_with_path(named, params, is_leaf=lambda v: isinstance(v, nnx.Variable))


CHAINS = {
    "multi_steps": lambda **where: optax.MultiSteps(muon(LR, **where), every_k_schedule=2),
    "chain": lambda **where: optax.chain(   # with a learning rate the user can change
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(muon, static_args=("plan",))(learning_rate=LR, **where),
        optax.scale(1.0)),
    "multi_transform": lambda **where: optax.multi_transform(
        {"matrix": optax.chain(scale_by_muon(**where), optax.scale(-LR)),
         "other": optax.adam(LR)}, user_labels),
}
NEXT = dict(zip(LAYOUTS, LAYOUTS[1:] + LAYOUTS[:1]))   # where each checkpoint is restored


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(fsdp=8))


def config(layout):
    return dataclasses.replace(MODEL, **layout.stack_fields)


@functools.cache
def built(chain: str, layout_name: str):
    """(layout, plan, tx, state from create_train_state, opt state from jit(tx.init))."""
    mesh = make_mesh(MeshConfig(fsdp=8))
    layout = make_layout(layout_name, mesh.shape)
    make_model = lambda: GPT(config(layout), nnx.Rngs(0))
    plan = make_plan(nnx.split(nnx.eval_shape(make_model))[1], mesh, layout)
    tx = CHAINS[chain](plan=PlanSpec(mesh=mesh, layout=layout))
    _, state = create_train_state(make_model, tx, plan)
    return layout, plan, tx, state, jax.jit(tx.init)(trainable_params(state.params))


@functools.cache
def one_device(chain: str, layer_group: int):
    """Three steps of the same chain and model (grouped alike) on one device."""
    params = nnx.split(GPT(dataclasses.replace(MODEL, layer_group=layer_group), nnx.Rngs(0)))[1]
    tx = CHAINS[chain]()
    return jax.device_get(three_steps(tx, params, tx.init(trainable_params(params))))


def matrix_state(opt_state):
    """(param path, array) of every Muon momentum in a state tree."""
    found = []

    def visit(node):
        if type(node).__name__ == "MuonState":
            found.extend((jax.tree_util.keystr(p), x)
                         for p, x in jax.tree.leaves_with_path(node.momentum))
            return
        for child in jax.tree.leaves(node, is_leaf=lambda n: n is not node):
            if child is not node:
                visit(child)
    visit(opt_state)
    return found


def owners_hold(layout_name: str, path: str, x: jax.Array) -> None:
    """Each device's shard of a momentum is what the layout says: layerwise and owner
    give every rank whole matrices (1/8 of the stack), fsdp splits the embed dim,
    replicated holds all of it."""
    shards = x.addressable_shards
    assert len(shards) == 8
    local = shards[0].data.shape
    if layout_name == "replicated":
        assert local == x.shape, path
        return
    axis = {"layerwise": 0, "owner": 1}.get(layout_name)
    if axis is None:   # fsdp: the embed dim (d_model = 32) is split
        axis = next(a for a, n in enumerate(x.shape) if n == MODEL.d_model)
    else:
        assert x.shape[axis] == 8, (path, x.shape)   # the 3 layers padded to the 8 owners
    want = x.shape[:axis] + (x.shape[axis] // 8,) + x.shape[axis + 1:]
    assert local == want, (path, local, want)
    starts = sorted(s.index[axis].start or 0 for s in shards)
    assert starts == [i * want[axis] for i in range(8)], (path, starts)


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("chain", list(CHAINS))
def test_user_chain_is_placed_stepped_and_checkpointed(chain, layout_name, tmp_path):
    layout, plan, tx, state, jit_init = built(chain, layout_name)
    for created in (state.opt_state, jit_init):
        found = matrix_state(created)
        assert len(found) == len(MATRICES), [p for p, _ in found]
        for path, x in found:
            owners_hold(layout_name, path, x)

    reference = one_device(chain, layout.layer_group)
    # Stepped from create_train_state's state only: jit(tx.init)'s optax moments come
    # out replicated, so stepping from it compiles the step once more per case
    # (about 2 minutes of the suite) to check what the placement check above shows.
    assert_close(three_steps(tx, state.params, state.opt_state), reference)

    if layout_name == "owner":
        report = hlo_collectives(jax.jit(optimizer_step(tx)), state.params, state.opt_state,
                                 grads_of(state.params, 0))
        if chain == "chain":   # clip_by_global_norm: the squared norm is summed over ranks
            assert {c.kind for c in report.collectives} <= {"all-reduce"}, report.table()
            assert sum(c.buffer_bytes for c in report.collectives) <= 4 * 16, report.table()
        else:
            assert report.collectives == (), report.table()

    _, next_plan, _, target, _ = built(chain, NEXT[layout_name])
    assert_restores(tmp_path, state, leaf_codecs(state, plan), target,
                    leaf_codecs(target, next_plan))


def nnx_optimizer(mesh, layout):
    """(model, plan, nnx.Optimizer of Muon on the plan), the model born sharded."""
    make_model = lambda: GPT(config(layout), nnx.Rngs(0))
    model = create_sharded(make_model, mesh, layout.rules)
    plan = make_plan(nnx.state(model, nnx.Param), mesh, layout if mesh else None)
    return model, plan, nnx.Optimizer(model, muon(LR, plan=plan), wrt=nnx.Param)


def checkpointed(model, plan, optimizer):
    """What a checkpoint of an nnx.Optimizer run holds, placed by the plan (the
    optimizer's counts were made eagerly on one device), with its codecs."""
    params, opt = nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state)
    tree = jax.device_put({"params": params, "opt": opt},
                          {"params": plan.param_shardings(), "opt": plan.state_shardings(opt)})
    return tree, {"params": plan.param_codecs(params), "opt": plan.state_codecs(opt)}


@nnx.jit
def nnx_step(model, optimizer, grads):
    optimizer.update(model, grads)


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_nnx_optimizer_with_the_plan(layout_name, mesh, tmp_path):
    """nnx.Optimizer hands plain arrays to update; with the plan, Muon still places
    its state, steps like one device, needs no collective under owner, and its
    checkpoint restores on the next layout."""
    layout = make_layout(layout_name, mesh.shape)
    single, _, single_opt = nnx_optimizer(None, layout)
    model, plan, optimizer = nnx_optimizer(mesh, layout)
    (path, x), *_ = matrix_state(nnx.as_pure(optimizer.opt_state))
    owners_hold(layout_name, path, x)

    if layout_name == "owner":
        graphdef, pure = nnx.split((model, optimizer))

        def step(pure, grads):
            model, optimizer = nnx.merge(graphdef, pure)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer))

        report = hlo_collectives(jax.jit(step), pure, grads_of(nnx.state(model, nnx.Param), 0))
        assert report.collectives == (), report.table()

    for seed in range(3):
        nnx_step(single, single_opt, grads_of(nnx.state(single, nnx.Param), seed))
        nnx_step(model, optimizer, grads_of(nnx.state(model, nnx.Param), seed))
    assert_close(nnx.state(model, nnx.Param), jax.device_get(nnx.state(single, nnx.Param)))

    target = nnx_optimizer(mesh, make_layout(NEXT[layout_name], mesh.shape))
    assert_restores(tmp_path, *checkpointed(model, plan, optimizer), *checkpointed(*target))
