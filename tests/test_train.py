"""The train step, state, schedules and the CLI end to end."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments import train as train_cli
from jmegatron.analysis import hlo_collectives
from jmegatron.models import GPT, GPTConfig
from jmegatron.optim import matrix_pieces
from jmegatron.sharding import DEFAULT_RULES, MeshConfig, make_mesh
from jmegatron.train import (ScheduleConfig, TrainConfig, create_train_state, fit_mesh,
                             make_loss_fn, make_train_step, run_folder)
from jmegatron.train.optimizer import make_optimizer, make_schedule
from jmegatron.train.step import accumulate_grads, split_microbatches

MODEL = GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64).pad_vocab(2)
B, T = 16, 32


def build(optim: str):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    make_model = lambda: GPT(MODEL, nnx.Rngs(0))
    abstract = nnx.split(nnx.eval_shape(make_model))[1]
    cfg = TrainConfig(optim=optim, lr=1e-2, steps=10, schedule=ScheduleConfig(warmup_steps=0))
    optimizer = make_optimizer(cfg, abstract, mesh)
    graphdef, state = create_train_state(make_model, optimizer.tx, optimizer.plan)
    loss_fn = make_loss_fn(graphdef, MODEL, mesh, optimizer.plan.layout)
    return mesh, optimizer, state, loss_fn


@pytest.fixture(scope="module")
def setup():
    return build("adamw")


@pytest.fixture(scope="module")
def muon_setup():
    return build("muon")


def tokens(seed=0, batch=B):
    return jax.random.randint(jax.random.key(seed), (batch, T + 1), 0, MODEL.vocab_size)


def test_state_is_born_sharded(setup):
    mesh, _, state, _ = setup
    qkv = state.params["blocks"]["attn"]["qkv"][...]
    assert qkv.sharding.spec == jax.P(None, "fsdp", "tensor", None, None)
    adam = state.opt_state[1][0]   # chain(clip, adamw): adamw's scale_by_adam state
    assert adam.mu["blocks"]["attn"]["qkv"][...].sharding == qkv.sharding
    assert adam.nu["embed"][...].sharding == state.params["embed"][...].sharding
    assert adam.count.sharding.is_fully_replicated


def test_muon_momentum_is_born_sharded_like_its_param(muon_setup):
    _, _, state, _ = muon_setup
    muon_state = state.opt_state[1].inner_states["muon"].inner_state[0]
    for name in ("qkv", "out"):
        param = state.params["blocks"]["attn"][name][...]
        assert muon_state.momentum["blocks"]["attn"][name][...].sharding == param.sharding


def test_microbatches_keep_rows_on_their_devices(setup):
    mesh = setup[0]
    batch = jax.device_put(tokens(), jax.NamedSharding(mesh, jax.P(("data", "fsdp", "expert"))))
    split = jax.jit(lambda t: split_microbatches(t, 4, mesh, DEFAULT_RULES))
    np.testing.assert_array_equal(split(batch)[1], tokens()[1::4])
    assert hlo_collectives(split, batch).collectives == ()


def test_accumulation_equals_one_big_batch(setup):
    """k microbatches of b rows give the loss and gradients of one batch of k*b rows."""
    mesh, _, state, loss_fn = setup
    many = jax.jit(lambda p, t: accumulate_grads(
        loss_fn, p, split_microbatches(t, 4, mesh, DEFAULT_RULES)))(state.params, tokens())
    (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(state.params, tokens())
    np.testing.assert_allclose(many[0], loss, rtol=1e-6)
    chex.assert_trees_all_close(many[2], grads, rtol=1e-5, atol=1e-8)


@jax.custom_vjp
def nan_gradient(x):
    """The identity whose gradient is NaN: a finite loss with non-finite gradients."""
    return x


nan_gradient.defvjp(lambda x: (x, None), lambda _, g: (g * jnp.nan,))


@pytest.mark.parametrize("which", ["adamw", "muon"])
def test_a_nan_gradient_skips_the_step(which, setup, muon_setup):
    mesh, optimizer, state, loss_fn = setup if which == "adamw" else muon_setup
    poisoned = lambda p, t: loss_fn(jax.tree.map(nan_gradient, p), t)
    assert np.isfinite(jax.jit(poisoned)(state.params, tokens())[0])
    before = jax.device_get(state)   # host copy: the step donates its input
    step = make_train_step(poisoned, optimizer, 1, mesh, DEFAULT_RULES)
    state = jax.tree.map(jnp.copy, state)
    after, metrics = step(state, tokens())
    assert bool(metrics["skipped"]) and int(after.skipped) == 1 and int(after.step) == 1
    for a, b in zip(jax.tree.leaves(before.params) + jax.tree.leaves(before.opt_state),
                    jax.tree.leaves(after.params) + jax.tree.leaves(after.opt_state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    good = make_train_step(loss_fn, optimizer, 1, mesh, DEFAULT_RULES)
    later, metrics = good(after, tokens())
    assert not bool(metrics["skipped"]) and int(later.skipped) == 1
    assert not np.array_equal(later.params["embed"][...], before.params["embed"][...])


def poison_state():
    """A transformation whose own state turns NaN while the updates stay finite."""
    def update(updates, state, params=None):
        return updates, {"x": state["x"] * jnp.nan}

    return optax.GradientTransformation(lambda params: {"x": jnp.zeros(())}, update)


@pytest.mark.parametrize("poison", ["update", "state"])
def test_non_finite_new_params_or_optimizer_state_skip_the_step(poison, setup):
    """The loss and gradients are finite; what the optimizer makes of them is not."""
    mesh, optimizer, _, loss_fn = setup
    extra = optax.scale(jnp.nan) if poison == "update" else poison_state()
    optimizer = dataclasses.replace(optimizer, tx=optax.chain(optimizer.tx, extra))
    make_model = lambda: GPT(MODEL, nnx.Rngs(0))
    _, state = create_train_state(make_model, optimizer.tx, optimizer.plan)
    before = jax.device_get(state)
    after, metrics = make_train_step(loss_fn, optimizer, 1, mesh, DEFAULT_RULES)(state, tokens())
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    assert bool(metrics["skipped"]) and int(after.skipped) == 1
    for a, b in zip(jax.tree.leaves((before.params, before.opt_state)),
                    jax.tree.leaves((after.params, after.opt_state))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_training_lowers_the_loss(setup):
    mesh, optimizer, state, loss_fn = setup
    step = make_train_step(loss_fn, optimizer, 2, mesh, DEFAULT_RULES)
    state = jax.tree.map(jnp.copy, state)
    losses = []
    for _ in range(8):   # the same batch: the loss must fall
        state, metrics = step(state, tokens())
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("kind, checks", [
    ("cosine", {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 110: 0.1, 60: 0.55}),
    ("linear", {10: 1.0, 60: 0.55, 110: 0.1}),
    ("wsd", {10: 1.0, 60: 1.0, 88: 1.0, 99: 0.55, 110: 0.1}),   # decays over the last 22
    ("constant", {5: 0.6, 10: 1.0, 110: 1.0}),
])
def test_schedules(kind, checks):
    schedule = make_schedule(ScheduleConfig(kind=kind, warmup_steps=10, min_lr_ratio=0.1,
                                            decay_fraction=0.2), 1.0, 110)
    for step, want in checks.items():
        np.testing.assert_allclose(schedule(step), want, atol=1e-6, err_msg=f"step {step}")


def test_a_mesh_given_on_the_command_line_is_not_fitted():
    assert train_cli.parse([]).fit_mesh
    assert not train_cli.parse(["--mesh.tensor", "2"]).fit_mesh


def test_default_mesh_shrinks_to_fit_but_explicit_meshes_do_not():
    default = TrainConfig().mesh
    assert fit_mesh(default, 8, shrink=True) == MeshConfig(2, 2, 1, 2)
    assert fit_mesh(default, 1, shrink=True) == MeshConfig(1, 1, 1, 1)
    assert fit_mesh(default, 2, shrink=True) == MeshConfig(1, 1, 1, 2)
    with pytest.raises(ValueError, match="4 devices"):
        fit_mesh(MeshConfig(data=2, fsdp=1, tensor=2), 2, shrink=False)


SMALL = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "2",
         "--model.n-kv-heads", "2", "--model.d-ff", "64", "--batch-size", "8", "--seq-len", "32",
         "--eval-batches", "1", "--sample-tokens", "8", "--no-progress"]


def test_cli_runs_three_steps_and_writes_every_output(tmp_path):
    summary = train_cli.main(SMALL + ["--steps", "3", "--eval-every", "2", "--log-every", "1",
                                      "--microbatches", "2", "--out-dir", str(tmp_path),
                                      "--name", "run", "--qk-clip", "0.05"])
    run = tmp_path / "run"
    config = json.loads((run / "config.json").read_text())
    assert config["config"]["steps"] == 3 and config["mesh"]["tensor"] == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [2, 3]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in train)
    # Muon is the default: its group's update RMS and Newton-Schulz FLOPs are logged.
    assert all(r["update_rms_muon"] > 0 and r["update_rms_adamw"] > 0 for r in train)
    assert train[-1]["optimizer_flops_per_s"] > 0
    assert "muon" in (run / "routing.txt").read_text()
    assert train[-1]["tokens_per_s"] > 0 and 0 < train[-1]["mfu"]
    assert evals[-1]["sample_greedy"].startswith("def ")
    assert "--- greedy" in (run / "samples.txt").read_text()
    # QK-clip's watch: the largest attention logit, per layer too, and the heads clipped.
    layers = config["config"]["model"]["n_layers"]
    assert all(r["max_attention_logit"] == max(r["max_attention_logit_per_layer"]) > 0
               and len(r["max_attention_logit_per_layer"]) == layers
               and 0 <= r["qk_clipped_heads"] for r in train)
    png = (run / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 12 * 120    # loss and max-logit panels
    saved = json.loads((run / "summary.json").read_text())
    assert saved["steps"] == 3 and saved["val_loss"] == summary["val_loss"]
    assert 0 < saved["val_unigram_entropy"] < 5


def test_an_unknown_optimizer_is_refused_when_parsed():
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(SMALL + ["--optim", "lion"])
    message = exit_info.value.code
    assert message.startswith("error: --optim 'lion': must be one of muon, ") and "\n" not in message


def test_a_registry_entry_is_all_a_new_optimizer_needs(monkeypatch, tmp_path):
    """A test optimizer (sign descent on the matrices, AdamW elsewhere) registered under
    a new name trains from the command line, its update RMS logged under its name."""
    from jmegatron.optim.matrix import descend, with_adamw
    from jmegatron.train import registry

    def signum(cfg, schedule, common):
        matrix = descend(optax.scale_by_sign(), schedule, common["weight_decay"],
                         common["weight_decay_method"])
        return with_adamw("signum", matrix, common["plan"], schedule,
                          common["adamw"])

    monkeypatch.setitem(registry.OPTIMIZERS, "signum",
                        registry.Entry(("muon",), signum, lambda cfg: lambda m, n: 0))
    train_cli.main(SMALL + ["--optim", "signum", "--steps", "2", "--eval-every", "2",
                            "--out-dir", str(tmp_path), "--name", "run"])
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["update_rms_signum"] > 0 for r in records if "loss" in r] == [True, True]
    assert "signum" in (tmp_path / "run/routing.txt").read_text()


def test_a_registration_is_all_a_new_layout_needs(monkeypatch, tmp_path):
    """A layout defined here, ZeRO-3 over data and fsdp (its rules split ``embed`` over
    both), registered under a new name: --layout auto counts it among its candidates,
    and it trains from the command line as fsdp does (the same losses)."""
    from jmegatron.optim import auto_layout
    from jmegatron.sharding import layouts
    from jmegatron.sharding.rules import STAGES, split_size, with_rules

    class DataFSDP(layouts.FSDP):
        name = "data_fsdp"

        @classmethod
        def for_mesh(cls, mesh_shape, rules, assignment, owner_group):
            zero3 = layouts.owner_group_axes(mesh_shape, rules)
            return cls(with_rules(rules, embed=zero3 or None),
                       stages=split_size(mesh_shape, rules, STAGES))

    monkeypatch.setitem(layouts.LAYOUT_CLASSES, "data_fsdp", DataFSDP)
    mesh = {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert "data_fsdp" in [c.layout for c in auto_layout.candidates(mesh)]
    assert DataFSDP.for_mesh(mesh, DEFAULT_RULES, "round_robin", "fsdp").param_spec(
        ("embed", "mlp")) == jax.P(("data", "fsdp"), "tensor")
    losses = {}
    for layout in ("data_fsdp", "fsdp"):
        train_cli.main(SMALL + ["--layout", layout, "--steps", "2", "--eval-every", "2",
                                "--out-dir", str(tmp_path), "--name", layout])
        records = [json.loads(line) for line in
                   (tmp_path / layout / "metrics.jsonl").read_text().splitlines()]
        losses[layout] = [r["loss"] for r in records if "loss" in r]
    assert len(losses["fsdp"]) == 2
    np.testing.assert_allclose(losses["data_fsdp"], losses["fsdp"], rtol=2e-4)


@pytest.mark.parametrize("args, message", [
    (["--data.path", "/no/such/corpus"], "'/no/such/corpus' does not exist"),
    (["--seq-len", "1000000"], "seq_len=1000000 needs at least 1000001 tokens"),
    (["--mesh.data", "1", "--mesh.fsdp", "1", "--mesh.tensor", "8"],
     "heads=2 is not divisible by tensor=8: change --mesh.tensor or --model.n-heads"),
    (["--batch-size", "4", "--microbatches", "2"],
     "--batch-size 4 in 2 microbatches does not split over the 4 batch ranks (data=2 x "
     "fsdp=2): use a multiple of 8"),
    (["--model.vocab-size", "100"], "model.vocab_size=100 is smaller than the corpus"),
    (["--top-k", "10000"], "--top-k 10000: must be at most the vocabulary (model.vocab_size=259)"),
])
def test_cli_bad_input_gives_one_clear_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(SMALL + args)
    assert exit_info.value.code.startswith("error: ")
    assert message in exit_info.value.code


@pytest.mark.parametrize("name, billions", [("dense-1b", 0.886), ("qwen3-moe-small", 0.701)])
def test_the_accelerator_presets_build_the_sizes_they_state(name, billions):
    """The presets bench_train_speed measures on a GPU: their shapes build (abstractly:
    nothing allocated) and hold the parameters their docstrings state."""
    cfg = train_cli.PRESETS[name]().model.pad_vocab(1)
    model = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    assert count == cfg.param_count() and round(count / 1e9, 3) == billions
    assert cfg.dtype == "bfloat16"


def test_every_registered_optimizer_builds_from_its_entry():
    """``registry.OPTIMIZERS`` alone decides --optim's choices, the option groups a
    resume keeps, the transformation, its FLOPs and the cost the plan balances
    owners by (one per-matrix FLOP count for both)."""
    from jmegatron.train.registry import OPTIMIZERS, optimizer_names
    abstract = nnx.split(nnx.eval_shape(lambda: GPT(MODEL, nnx.Rngs(0))))[1]
    assert train_cli.parse(["--optim", "rekls"]).optim == "rekls"
    assert set(optimizer_names()) == {*OPTIMIZERS, "adamw"}
    for name, entry in OPTIMIZERS.items():
        cfg = TrainConfig(optim=name)
        assert cfg.optimizer_groups == entry.groups
        assert all(f"{group}.{field}" in run_folder.run_settings(cfg) for group in entry.groups
                   for field in dataclasses.asdict(getattr(cfg, group)))
        optimizer = make_optimizer(cfg, abstract)
        assert optimizer.flops_per_step > 0 and set(optimizer.leaf_groups) == {name, "adamw"}
        per_matrix = entry.matrix_flops(cfg)
        assert optimizer.plan.cost(48, 96) == per_matrix(48, 96) > 0
        assert optimizer.flops_per_step == int(sum(p.count * per_matrix(p.fan_in, p.fan_out)
                                                   for p in matrix_pieces(abstract)))
