"""A run's programs, assembled in one place: the Trainer, the tests, the benchmarks
and the projections all build a model's state, loss and steps for a layout here
(``build_programs``), so that what they compile is what a run trains with."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, NamedTuple

import jax
from flax import nnx

from jmegatron.models import GPT, GPTConfig, qk_clipper
from jmegatron.sharding import make_mesh
from jmegatron.sharding.layouts import Layout
from jmegatron.train.config import TrainConfig
from jmegatron.train.optimizer import Optimizer, make_optimizer
from jmegatron.train.planning import Plan
from jmegatron.train.sample import make_sampler
from jmegatron.train.state import TrainState, state_initializer
from jmegatron.train.step import LossFn, make_eval_step, make_loss_fn, make_train_step


class Programs(NamedTuple):
    """A model's programs under a layout, each jitted, compiled at its first call."""

    mesh: jax.sharding.Mesh
    layout: Layout
    model: GPTConfig                 # as the layout runs it (stacked: Layout.model_for)
    optimizer: Optimizer
    graphdef: nnx.GraphDef
    init: Callable[[], TrainState]   # the state, born in the optimizer plan's shardings
    loss_fn: LossFn
    train_step: Callable             # (state, tokens [B, T+1]) -> (state, metrics)
    eval_step: Callable              # (params, tokens) -> mean next-token loss

    def abstract_state(self) -> TrainState:
        """The state as shapes, dtypes and shardings, without allocating it."""
        return jax.eval_shape(self.init)


def build_programs(cfg: TrainConfig, model: GPTConfig, mesh: jax.sharding.Mesh,
                   layout: Layout,
                   swap_optimizer: Callable[[Optimizer], Optimizer] | None = None
                   ) -> Programs:
    """The programs of ``cfg``'s optimizer, loss and steps for ``model`` (stacked for
    ``layout``) on ``mesh``: ``cfg.microbatches`` run inside the pipeline where the
    layout has stages, else the train step accumulates them; QK-clip where
    ``cfg.qk_clip`` sets it. ``swap_optimizer`` replaces the optimizer built for the
    plan (a benchmark's reference implementation). Nothing is compiled or allocated."""
    optimizer, graphdef, init = build_state(cfg, model, mesh, layout, swap_optimizer)
    # With pipeline stages the microbatches run inside the pipeline, not one by one.
    inner, outer = (cfg.microbatches, 1) if layout.stages > 1 else (1, cfg.microbatches)
    loss_fn = make_loss_fn(graphdef, model, mesh, layout, cfg.z_loss, inner)
    clip = qk_clipper(model, cfg.qk_clip, cfg.qk_clip_alpha) if cfg.qk_clip else None
    return Programs(mesh, layout, model, optimizer, graphdef, init, loss_fn,
                    make_train_step(loss_fn, optimizer, outer, mesh, layout.rules, clip),
                    make_eval_step(loss_fn, optimizer.plan))


def build_state(cfg: TrainConfig, model: GPTConfig, mesh: jax.sharding.Mesh, layout: Layout,
                swap_optimizer: Callable[[Optimizer], Optimizer] | None = None
                ) -> tuple[Optimizer, nnx.GraphDef, Callable[[], TrainState]]:
    """``build_programs``' optimizer, the model's graphdef and the jitted builder of the
    state, born in the optimizer plan's shardings (what a test of the optimizer alone
    needs: no loss, so no pipeline microbatches)."""
    make_model = lambda: GPT(model, nnx.Rngs(cfg.seed))
    optimizer = make_optimizer(cfg, nnx.split(nnx.eval_shape(make_model))[1], mesh, layout)
    if swap_optimizer is not None:
        optimizer = swap_optimizer(optimizer)
    graphdef, init = state_initializer(make_model, optimizer.tx, optimizer.plan)
    return optimizer, graphdef, init


class RunPrograms(NamedTuple):
    """What a Trainer compiles: a run's ``Programs`` and its sampler, with the settings
    they were built for (``programs_key``)."""

    key: tuple
    programs: Programs
    sampler: Callable


# Settings no compiled program depends on: Trainers that differ only in these (a run
# stopped and resumed, the same run in another folder) can share their programs.
UNCOMPILED = ("name", "out_dir", "stop_after", "resume", "resume_from", "init_from",
              "overwrite", "allow_change", "checkpoint", "max_skipped", "eval_every",
              "eval_batches", "log_every", "sample_prompt", "sample_tokens", "progress")
_DEFAULTS = TrainConfig()


def programs_key(cfg: TrainConfig, plan: Plan) -> tuple:
    """What a run's programs depend on: ``cfg`` but its ``UNCOMPILED`` settings, the
    resolved mesh, model and layout, and the devices."""
    return (dataclasses.replace(cfg, **{f: getattr(_DEFAULTS, f) for f in UNCOMPILED}),
            plan.mesh, plan.model, plan.layout, tuple(jax.devices()))


def run_programs(cfg: TrainConfig, plan: Plan) -> RunPrograms:
    """The programs of a run of ``cfg`` on ``plan`` (nothing compiled yet)."""
    programs = build_programs(cfg, plan.model, make_mesh(plan.mesh), plan.layout)
    return RunPrograms(programs_key(cfg, plan), programs,
                       make_sampler(programs.graphdef, plan.model, programs.mesh, plan.rules,
                                    cfg.top_k))


_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "jmegatron_shared_programs", default=None)


@contextlib.contextmanager
def sharing_programs(shared: dict | None = None):
    """Within this context, Trainers whose settings differ only in ``UNCOMPILED`` ones
    share their programs, each compiled once (a process that runs many commands: the
    docs' commands in the tests), and keep them in ``shared`` (a new dict by default;
    pass one again to share with a later context). Off by default: a program built
    under a patched function (a test's) must not serve a later run."""
    token = _SHARED.set({} if shared is None else shared)
    try:
        yield
    finally:
        _SHARED.reset(token)


def shared_programs(cfg: TrainConfig, plan: Plan) -> RunPrograms:
    """The programs of ``cfg`` on ``plan``: built, or an earlier Trainer's with the same
    ``programs_key`` inside ``sharing_programs``."""
    shared = _SHARED.get()
    if shared is None:
        return run_programs(cfg, plan)
    key = programs_key(cfg, plan)
    if key not in shared:
        shared[key] = run_programs(cfg, plan)
    return shared[key]


def differences(key: tuple, other: tuple) -> list[str]:
    """The settings in which two ``programs_key``s differ, by name."""
    cfg, *rest = key
    names = [f.name for f in dataclasses.fields(cfg)
             if getattr(cfg, f.name) != getattr(other[0], f.name)]
    resolved = [name for name, a, b in zip(("mesh", "model", "layout", "devices"), rest,
                                           other[1:]) if a != b and name not in names]
    return names + resolved
