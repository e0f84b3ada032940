"""The optimizer factories refuse bad arguments when called, bad leaves and a foreign
plan at init, each in one line naming what is wrong; good arguments still run."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmegatron.optim
from helpers import ns_roundoff, relative_miss
from jmegatron.optim import (DION2_COEFFICIENTS, AdamW, adaptive_muon, descend, dion2, make_plan,
                             mop, muon, muon_bp, polar_factor, rekls, scale_by_adaptive_muon,
                             scale_by_dion2, scale_by_mop, scale_by_muon, scale_by_muon_bp,
                             scale_by_rekls, scale_by_soap, soap)
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.train.registry import OPTIMIZERS as REGISTRY

NAN, INF = float("nan"), float("inf")
OPTIMIZERS = {"muon": muon, "muon_bp": muon_bp, "mop": mop, "adaptive_muon": adaptive_muon,
              "soap": soap, "rekls": rekls, "dion2": dion2}
DIRECTIONS = {"muon": scale_by_muon, "muon_bp": scale_by_muon_bp, "mop": scale_by_mop,
              "adaptive_muon": scale_by_adaptive_muon, "soap": scale_by_soap,
              "rekls": scale_by_rekls, "dion2": scale_by_dion2}
BAD_LEARNING_RATES = ["abc", NAN, INF, -INF, 0, 0.0, -1e-3, None, True, [1e-3], jnp.ones(2)]

# (argument, bad value, what the message shows of it) of each direction's own options;
# each case runs on scale_by_NAME and on NAME.
BAD_OPTIONS = {
    "muon": [("beta", 2, "2"), ("beta", 1.0, "1.0"), ("beta", -0.1, "-0.1"), ("beta", NAN, "nan"),
             ("steps", 0, "0"), ("steps", 2.5, "2.5"), ("rms_factor", 0.0, "0.0"),
             ("rms_factor", INF, "inf"), ("momentum", "nesterov", "'nesterov'"),
             ("scale", "max", "'max'"), ("momentum_dtype", jnp.int32, "int32"),
             ("matmul_dtype", "int8", "int8"), ("tp_mode", "fast", "'fast'")],
    "muon_bp": [("period", 0, "0"), ("period", 2.0, "2.0"), ("block_lr_ratio", 0.0, "0.0"),
                ("block_lr_ratio", NAN, "nan"), ("beta", 1.0, "1.0"),
                ("tp_mode", "fast", "'fast'")],
    "mop": [("beta", 1.5, "1.5"), ("rms_factor", -1.0, "-1.0"),
            ("momentum_dtype", "int32", "int32")],
    "adaptive_muon": [("beta2", 1.0, "1.0"), ("eps", 0.0, "0.0"), ("eps", -1e-8, "-1e-08"),
                      ("beta", NAN, "nan"), ("steps", 0, "0"), ("scale", "max", "'max'")],
    "soap": [("b1", 1.0, "1.0"), ("b2", -0.5, "-0.5"), ("shampoo_beta", 2, "2"),
             ("eps", 0, "0"), ("eps", NAN, "nan"), ("precondition_frequency", 0, "0"),
             ("max_precond_dim", -1, "-1")],
    "rekls": [("b1", 1, "1"), ("b2", 3.0, "3.0"), ("shampoo_beta", 1.0, "1.0"),
              ("eps", 0.0, "0.0"), ("max_precond_dim", 2.0, "2.0")],
    "dion2": [("fraction", 0.0, "0.0"), ("fraction", 1.5, "1.5"), ("ef_decay", 1.0, "1.0"),
              ("coefficients", "fast", "fast"), ("matmul_dtype", "int8", "int8")],
}
OPTION_CASES = [(name, *case) for name, cases in BAD_OPTIONS.items() for case in cases]


def refused(call, *words):
    """The ValueError of ``call()``: one line, holding every one of ``words``."""
    with pytest.raises(ValueError, match=re.escape(words[0])) as err:
        call()
    message = str(err.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


def tiny(w_shape=(4, 6), w_dtype=jnp.float32):
    """A matrix and a bias: the smallest tree with both groups."""
    return {"w": jnp.ones(w_shape, w_dtype), "b": jnp.zeros(6)}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("value", BAD_LEARNING_RATES, ids=repr)
def test_a_bad_learning_rate_is_refused_at_construction(name, value):
    message = refused(lambda: OPTIMIZERS[name](value), "learning_rate must be",
                      "a finite number > 0 or a schedule")
    assert "got " in message


@pytest.mark.parametrize("name, arg, value, shown", OPTION_CASES,
                         ids=[f"{n}-{a}={s}" for n, a, _, s in OPTION_CASES])
@pytest.mark.parametrize("full", [False, True], ids=["scale_by", "with_adamw"])
def test_a_bad_option_is_refused_at_construction(full, name, arg, value, shown):
    factory = (lambda **kw: OPTIMIZERS[name](1e-3, **kw)) if full else DIRECTIONS[name]
    refused(lambda: factory(**{arg: value}), arg, shown)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("value", [-0.1, NAN, INF, "0.1"], ids=repr)
def test_a_bad_weight_decay_is_refused(name, value):
    refused(lambda: OPTIMIZERS[name](1e-3, weight_decay=value), "weight_decay must be",
            "a finite number >= 0")


@pytest.mark.parametrize("arg, value, words", [
    ("learning_rate", "abc", ("AdamW learning_rate must be", "'abc'")),
    ("learning_rate", -1.0, ("AdamW learning_rate must be", "or None", "-1.0")),
    ("b1", 1.0, ("AdamW b1 must be a number in [0, 1)", "1.0")),
    ("b2", NAN, ("AdamW b2 must be", "nan")),
    ("eps", 0.0, ("AdamW eps must be a finite number > 0", "0.0")),
    ("weight_decay", -0.01, ("AdamW weight_decay must be", "-0.01")),
])
def test_adamw_settings_are_checked(arg, value, words):
    refused(lambda: AdamW(**{arg: value}), *words)


def test_the_shared_pieces_check_their_arguments():
    refused(lambda: descend(scale_by_muon(), -1.0, 0.0), "learning_rate must be", "-1.0")
    refused(lambda: descend(scale_by_muon(), 1e-3, -0.5), "weight_decay must be", "-0.5")
    refused(lambda: muon(1e-3, adamw=optax.adamw(1e-3)), "adamw must be a jmegatron.optim.AdamW")


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_], ids=["int32", "bool"])
def test_a_non_float_matrix_leaf_is_refused_at_init(name, dtype):
    tx = OPTIMIZERS[name](1e-3)
    refused(lambda: tx.init(tiny(w_dtype=dtype)), "['w']", f"dtype {jnp.dtype(dtype).name}",
            "floating-point")


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("shape", [(0, 6), (4, 0)], ids=str)
def test_a_zero_size_matrix_is_refused_at_init(name, shape):
    tx = OPTIMIZERS[name](1e-3)
    refused(lambda: tx.init(tiny(shape)), "['w']", f"shape {shape}", "no elements")


def test_scale_by_refuses_bad_leaves_too():
    refused(lambda: scale_by_soap().init({"w": jnp.ones((4, 6), jnp.int8)}),
            "scale_by_soap got ['w'] of dtype int8")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_plan_of_other_shapes_is_refused_at_init(name):
    tx = OPTIMIZERS[name](1e-3, plan=make_plan(tiny((4, 8))))
    refused(lambda: tx.init(tiny()), "the plan does not fit the params", "['w']",
            "(4, 6) in the params", "(4, 8) in the plan")
    bias = make_plan({"w": jnp.ones((4, 6)), "b": jnp.zeros(3)})   # an AdamW leaf differs
    refused(lambda: OPTIMIZERS[name](1e-3, plan=bias).init(tiny()), "['b']", "(6,)", "(3,)")
    refused(lambda: DIRECTIONS[name](plan=make_plan({"w": jnp.ones((6, 4))})).init(
        {"w": jnp.ones((4, 6))}), f"scale_by_{name}: the plan does not fit", "(6, 4)")


def test_a_plan_of_another_tree_is_refused_at_init():
    other = make_plan({"v": jnp.ones((4, 6)), "b": jnp.zeros(6)})
    refused(lambda: muon(1e-3, plan=other).init(tiny()), "the plan has no leaf ['w']",
            "(4, 6)")
    bigger = make_plan({**tiny(), "c": jnp.zeros((2, 3))})
    refused(lambda: muon(1e-3, plan=bigger).init(tiny()), "the params have no leaf ['c']",
            "(2, 3)")


def test_a_foreign_plan_on_a_mesh_is_refused_before_jax_sees_it():
    mesh = make_mesh(MeshConfig(fsdp=8))

    def params(d):
        return {"w": nnx.Param(jnp.ones((d, 16)), out_sharding=("embed", "mlp"),
                               eager_sharding=False),
                "b": nnx.Param(jnp.zeros(16), out_sharding=("mlp",), eager_sharding=False)}

    tx = soap(1e-3, plan=make_plan(params(8), mesh, "fsdp"))
    refused(lambda: tx.init(params(16)), "soap: the plan does not fit", "['w']",
            "(16, 16) in the params", "(8, 16) in the plan")


def _schedule(count):
    return 1e-3 * jnp.minimum(1.0, (count + 1) / 10)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("lr", [_schedule, np.float32(1e-3), jnp.asarray(1e-3), 1],
                         ids=["schedule", "numpy", "jax", "int"])
def test_good_arguments_construct_and_step(name, lr):
    tx = OPTIMIZERS[name](lr, weight_decay=0.0, adamw=AdamW(learning_rate=optax.constant_schedule(
        1e-3), b1=0.0, weight_decay=0.1))
    params = {"w": jax.random.normal(jax.random.key(0), (4, 6)), "b": jnp.zeros(6)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_traced_hyperparameters_pass_unchecked():
    """optax.inject_hyperparams hands the factory traced arrays under jit."""
    tx = optax.inject_hyperparams(muon)(learning_rate=1e-3, beta=0.9, weight_decay=0.1)
    params = {"w": jnp.ones((4, 6))}
    state = jax.jit(tx.init)(params)
    updates, _ = jax.jit(tx.update)(params, state, params)
    assert bool(jnp.all(jnp.isfinite(updates["w"])))


# The options that fix the program (integers, Dion2's fraction, which sets a shape):
# optax.inject_hyperparams must be told they are static.
STATIC = ("steps", "period", "precondition_frequency", "max_precond_dim", "fraction")


@pytest.mark.parametrize("name", REGISTRY)
def test_inject_hyperparams_with_static_options_equals_the_plain_factory(name):
    """learning_rate, weight decay and the decays are injectable; the jitted update is the
    plain factory's, to the round-off bound of the loosest default Newton-Schulz (Dion2's,
    5.9e-5; a weight decay lost misses by 0.09 to 0.47, but under SOAP, whose first
    update is zero). max_precond_dim 4: a block preconditioned on both sides starts in
    the eigenbases of its own first gradient, where REKLS's Adam divides round-off by
    round-off (any change of rounding flips it); one side keeps the test well posed."""
    factory = getattr(jmegatron.optim, name)
    options = inspect.signature(factory).parameters
    static = tuple(arg for arg in STATIC if arg in options)
    kw = dict(learning_rate=1e-3, weight_decay=0.1,
              **{"max_precond_dim": 4} if "max_precond_dim" in options else {})
    params = {"w": jax.random.normal(jax.random.key(0), (4, 6)), "b": jnp.zeros(6)}
    grads = {"w": jax.random.normal(jax.random.key(1), (4, 6)), "b": jnp.ones(6)}
    injected = optax.inject_hyperparams(factory, static_args=static)(**kw)
    got, _ = jax.jit(injected.update)(grads, injected.init(params), params)
    plain = factory(**kw)
    want, _ = plain.update(grads, plain.init(params), params)
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        miss = relative_miss(a, b)   # jit fuses, op-by-op does not: they round apart
        assert miss < ns_roundoff(DION2_COEFFICIENTS), (jax.tree_util.keystr(path), miss)


@pytest.mark.parametrize("name, arg", [("muon_bp", "period"), ("soap", "precondition_frequency"),
                                       ("rekls", "max_precond_dim"), ("dion2", "fraction"),
                                       ("nordion2", "fraction"), ("muon", "steps")])
def test_a_static_option_injected_as_an_array_is_refused_in_one_line(name, arg):
    factory = getattr(jmegatron.optim, name)
    others = tuple(a for a in STATIC if a != arg and a in inspect.signature(factory).parameters)
    given = {"steps": 5} if arg == "steps" else {}   # None by default: not injected
    tx = optax.inject_hyperparams(factory, static_args=others)(1e-3, **given)
    for init, kind in ((tx.init, "a jax Array"), (jax.jit(tx.init), "a traced Array")):
        refused(lambda: init(tiny()), f"{arg} must be a Python ", f"got {kind}: under "
                "optax.inject_hyperparams, name it in static_args", f"static_args=({arg!r},)")


def test_a_non_finite_gradient_poisons_the_block_as_documented():
    """scale_by_muon's docstring: NaN in one entry -> the whole block's update NaN, now
    and after; optax.apply_if_finite keeps the state clean."""
    params = {"w": jax.random.normal(jax.random.key(0), (4, 6))}
    bad = {"w": params["w"].at[0, 0].set(NAN)}
    tx = scale_by_muon()
    updates, state = tx.update(bad, tx.init(params))
    assert bool(jnp.all(jnp.isnan(updates["w"])))
    updates, _ = tx.update(params, state)
    assert bool(jnp.all(jnp.isnan(updates["w"])))
    guarded = optax.apply_if_finite(scale_by_muon(), max_consecutive_errors=3)
    _, state = guarded.update(bad, guarded.init(params))
    updates, _ = guarded.update(params, state)
    assert bool(jnp.all(jnp.isfinite(updates["w"])))


def test_the_polar_factor_of_an_inf_is_nan_not_a_hang():
    """LAPACK's SVD of a matrix holding an inf never returns; MOP must not call it."""
    x = jnp.stack([jnp.ones((3, 4)).at[0, 0].set(INF), jnp.eye(3, 4)])
    polar, s = polar_factor(x)
    assert bool(jnp.all(jnp.isnan(polar[0]))) and bool(jnp.all(jnp.isnan(s[0])))
    np.testing.assert_allclose(polar[1], jnp.eye(3, 4), atol=1e-6)
