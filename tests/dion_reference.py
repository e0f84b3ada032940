"""Float64 pieces shared by the Dion2 and NorDion2 reference tests (written on the
reference's own [out, in] weights; jmegatron's [fan_in, fan_out] leaves are their
transposes), and the checks both optimizers pass alike."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import grads_of, optimizer_step, three_steps
from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPT, GPTConfig
from jmegatron.optim import MATRIX, MatrixSpec, Route, Routing, make_plan, trainable_params
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import make_layout
from jmegatron.train import create_train_state

# "fused" leaves [6, 12] are cut along fan_out into blocks of 8 and 4 columns, as a fused
# QKV/SwiGLU weight; every other leaf is one matrix (a 3-D leaf: a stack of them).
FUSED = MatrixSpec((0,), (1,), split_axis=1, split_sizes=(8, 4))
ROUTING = Routing(custom=lambda path, shape, logical: Route(
    MATRIX, "test", FUSED if "fused" in path else
    MatrixSpec((len(shape) - 2,), (len(shape) - 1,))))

# dion/polar_express.py's _POLAR_EXPRESS_COEFFS, written out again (not imported:
# the tests must not share a typo with the module).
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def iterate64(x, schedule):
    """Odd-polynomial iterations in float64: a wide X through X X^T on the left, a
    tall one through X^T X on the right."""
    for a, b, c in schedule:
        if x.shape[0] > x.shape[1]:
            A = x.T @ x
            x = a * x + x @ (b * A + c * A @ A)
        else:
            A = x @ x.T
            x = a * x + (b * A + c * A @ A) @ x
    return x


def polar_express64(x, eps=1e-8):
    """The reference's polar_express in float64: X / (1.02 ||X||_F + eps), then its
    five iterations."""
    return iterate64(x / (np.linalg.norm(x) * 1.02 + eps), POLAR_EXPRESS)


@dataclasses.dataclass(frozen=True)
class Leaves:
    """A tree of named leaves (``shapes``; "fused" cut as ``FUSED``), their gradients
    per step (seeded ``seed + step``), and the comparison of an optimizer's updates
    with per-matrix references (objects with ``step(g [out, in]) -> update``)."""

    shapes: dict
    seed: int = 0

    def blocks(self, name):
        """The blocks of a leaf as (slice of the leaf's last axis, stack shape [...,
        fan_in, fan_out])."""
        if name == "fused":
            return [(slice(0, 8), (6, 8)), (slice(8, 12), (6, 4))]
        return [(slice(None), self.shapes[name])]

    def gradients(self, step):
        rng = np.random.default_rng(self.seed + step)
        return {k: rng.standard_normal(s) * (1 + 0.5 * step) for k, s in self.shapes.items()}

    def references(self, make):
        """Per leaf, per block, ``make(out_in)`` for every matrix of the stack."""
        return {name: [[make(shape[-2:][::-1]) for _ in range(math.prod(shape[:-2]))]
                       for _, shape in self.blocks(name)] for name in self.shapes}

    def reference_updates(self, refs, grads):
        """The references' updates of one step, as jmegatron leaves [..., fan_in, fan_out]."""
        out = {}
        for name, per_block in refs.items():
            parts = []
            for (cols, shape), mats in zip(self.blocks(name), per_block):
                g = grads[name][..., cols].reshape(-1, *shape[-2:])
                parts.append(np.stack([ref.step(m.T).T for ref, m in zip(mats, g)])
                             .reshape(shape))
            out[name] = np.concatenate(parts, axis=-1)
        return out

    def run(self, tx, steps):
        """The transformation's updates of ``steps`` steps (jitted once), float64 leaves."""
        params = {k: jnp.zeros(s, jnp.float32) for k, s in self.shapes.items()}
        state, update = tx.init(params), jax.jit(tx.update)
        out = []
        for step in range(steps):
            got, state = update(jax.tree.map(jnp.float32, self.gradients(step)), state, params)
            out.append(jax.tree.map(lambda x: np.asarray(x, np.float64), got))
        return out

    def worst(self, got_steps, refs):
        """Per leaf, the largest error over the steps relative to the leaf's largest entry."""
        errors = {name: 0.0 for name in self.shapes}
        for step, got in enumerate(got_steps):
            want = self.reference_updates(refs, self.gradients(step))
            for name in self.shapes:
                scale = np.abs(want[name]).max()
                errors[name] = max(errors[name], np.abs(got[name] - want[name]).max() / scale)
        return errors


def assert_refused(make, full, bad, full_only=()):
    """Each (option, bad value, words) of ``bad`` given to ``make`` raises a one-line
    ValueError holding the words, at construction; ``full_only`` (kwargs, words) cases
    go to ``full``, the optimizer with its learning rate."""
    for name, value, words in bad:
        with pytest.raises(ValueError) as err:
            make(**{name: value})
        message = str(err.value)
        assert "\n" not in message and words in message, (name, value, message)
    for kwargs, words in [(dict(learning_rate=0.0), "learning_rate"),
                          (dict(learning_rate=0.1, weight_decay=-1.0), "weight_decay"),
                          *full_only]:
        with pytest.raises(ValueError, match=words):
            full(**kwargs)


MODEL = GPTConfig(vocab_size=259, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                  d_ff=64).pad_vocab(2)


def assert_owner_steps_like_one_device(optimizer):
    """``optimizer(lr, **options)`` on a small GPT (3 layers, fused QKV and SwiGLU) on
    8 devices under the owner layout (fsdp 8: whole matrices on their owners): three
    steps (fp32 matmuls) give one device's params, and the optimizer step compiles
    with no collective."""
    mesh = make_mesh(MeshConfig(fsdp=8))
    layout = make_layout("owner", mesh.shape)
    cfg = dataclasses.replace(MODEL, **layout.stack_fields)
    make_model = lambda: GPT(cfg, nnx.Rngs(0))
    plan = make_plan(nnx.split(nnx.eval_shape(make_model))[1], mesh, layout)
    options = dict(weight_decay=0.1, matmul_dtype="float32")
    tx = optimizer(0.02, plan=plan, **options)
    _, state = create_train_state(make_model, tx, plan)
    report = hlo_collectives(jax.jit(optimizer_step(tx)), state.params, state.opt_state,
                             grads_of(state.params, 0))
    assert report.collectives == (), report.table()
    got = jax.device_get(three_steps(tx, state.params, state.opt_state))

    params = nnx.split(make_model())[1]
    local = optimizer(0.02, **options)
    want = jax.device_get(three_steps(local, params, local.init(trainable_params(params))))
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
