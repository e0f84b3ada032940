"""Planning a run: the mesh for the devices present, the corpus, the model and the
layout (or ``--layout auto``'s choice), every setting checked before anything is
compiled (``plan_run``)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
from flax import nnx

from jmegatron.data import Corpus, DataError, load_corpus
from jmegatron.data.batches import require_window
from jmegatron.data.tokenizer import load_tokenizer
from jmegatron.models import GPT, GPTConfig, context, hf
from jmegatron.sharding import MeshConfig, Rules
from jmegatron.sharding.layouts import LAYOUT_CLASSES, Layout, make_layout, takers
from jmegatron.train import run_folder
from jmegatron.train.config import ConfigError, TrainConfig
from jmegatron.train.distributed import same_on_all
from jmegatron.train.optimizer import rank_layouts


def fit_mesh(requested: MeshConfig, n_devices: int, shrink: bool) -> MeshConfig:
    """``requested`` resolved for ``n_devices``; with ``shrink`` (a mesh nobody set
    explicitly), data then tensor are halved until it fits instead of failing."""
    mesh = requested
    while shrink and n_devices % (mesh.data * mesh.tensor):
        field = "data" if mesh.data > 1 else "tensor"
        mesh = dataclasses.replace(mesh, **{field: getattr(mesh, field) // 2})
    return mesh.resolve(n_devices)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's settings after every check, before anything is compiled."""

    mesh: MeshConfig         # resolved for the devices present
    model: GPTConfig         # vocabulary padded for the mesh, layers grouped for the layout
    corpus: Corpus
    layout: Layout
    run_dir: Path            # out_dir/name, checked: writable, and no other run's folder
    choice: str = ""         # --layout auto: what it chose and why (one line); else ""

    @property
    def rules(self) -> Rules:
        return self.layout.rules


def resolve_model(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the architecture of its --init-from folder, or else the vocabulary
    size of its --data.tokenizer (as it is without either)."""
    if cfg.init_from:
        model = hf.config_from_hf(cfg.init_from[3:], cfg.model)
    elif cfg.data.tokenizer:
        try:
            size = load_tokenizer(cfg.data.tokenizer).vocab_size
        except ValueError as err:
            raise DataError(str(err)) from None
        model = dataclasses.replace(cfg.model, vocab_size=size)
    else:
        return cfg
    try:
        return dataclasses.replace(cfg, model=model)
    except ConfigError as err:   # a setting the new model refuses (e.g. --qk-clip)
        source = (f"--init-from {cfg.init_from}" if cfg.init_from
                  else f"--data.tokenizer {cfg.data.tokenizer}")
        raise ValueError(f"{err} (with {source})") from None


def plan_run(cfg: TrainConfig) -> Plan:
    """Resolves and checks mesh, corpus, model and batch; raises ValueError (or
    DataError) naming the numbers or path, before any compile."""
    cfg = resolve_model(cfg)
    if cfg.resume and not cfg.name:
        raise ValueError("--resume continues the run folder out_dir/name: give --name "
                         "(or --resume-from PATH)")
    mesh = fit_mesh(cfg.mesh, jax.device_count(), shrink=cfg.fit_mesh)
    corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.data.tokenizer)
    for split in ("train", "val"):
        require_window(len(getattr(corpus, split)), cfg.seq_len,
                       f"the {split} split of {corpus.source!r}")
    if cfg.model.vocab_size < corpus.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                         f"corpus vocabulary ({corpus.vocab_size}, {corpus.source!r})")
    if cfg.top_k > cfg.model.vocab_size:
        raise ValueError(f"--top-k {cfg.top_k}: must be at most the vocabulary "
                         f"(model.vocab_size={cfg.model.vocab_size})")
    if (cfg.owner_group and cfg.layout != "auto"
            and "owner_group" not in LAYOUT_CLASSES[cfg.layout].options):
        raise ValueError(f"--owner-group {cfg.owner_group} applies to --layout "
                         f"{takers('owner_group')}, not {cfg.layout}")
    layout, model, choice = resolve_layout(cfg, mesh)
    axis = context.sequence_axis(mesh.sizes(), layout.rules)
    why = axis and context.refusal(model, cfg.seq_len, mesh.sizes()[axis])
    if why:
        raise ValueError(why)
    run_folder.check_out_dir(cfg.out_dir)
    name = cfg.name or time.strftime(   # process 0's clock, on every process
        "%Y%m%d-%H%M%S", time.localtime(same_on_all(int(time.time()))))
    run_dir = Path(cfg.out_dir) / name
    run_folder.check_run_folder(run_dir, cfg)
    return Plan(mesh, model, corpus, layout, run_dir, choice)


def resolve_layout(cfg: TrainConfig, mesh: MeshConfig) -> tuple[Layout, GPTConfig, str]:
    """The layout ``cfg`` names on ``mesh`` (``--layout auto``: the one it chooses, with
    the line saying why; else ""), and the model stacked for it; ValueError with the
    one-line refusal where it cannot run them."""
    if cfg.layout == "auto":
        return choose_layout(cfg, mesh)
    return (*layout_and_model(cfg.layout, cfg, mesh), "")


def layout_and_model(name: str, cfg: TrainConfig, mesh: MeshConfig,
                     owner_group: str | None = None, prefetch: bool | None = None
                     ) -> tuple[Layout, GPTConfig]:
    """The layout ``name`` on ``mesh`` and the model stacked for it; raises ValueError
    with the layout's one-line refusal (``Layout.check``) where it cannot run them.
    ``owner_group`` and ``prefetch`` (owner; None: ``cfg``'s) are what ``--layout
    auto`` chose."""
    layout = make_layout(name, mesh.sizes(), assignment=cfg.assignment,
                         repeats=cfg.pipeline.repeats, schedule=cfg.pipeline.schedule,
                         owner_group=owner_group or cfg.owner_group or "fsdp")
    model = cfg.model if prefetch is None else dataclasses.replace(cfg.model, prefetch=prefetch)
    why = layout.check(model, mesh.sizes(), cfg.batch_size, cfg.microbatches)
    if why:
        raise ValueError(why)
    return layout, layout.model_for(model, mesh.sizes())


def choose_layout(cfg: TrainConfig, mesh: MeshConfig) -> tuple[Layout, GPTConfig, str]:
    """``--layout auto``: the layout (and owner's group and prefetch) with the shortest
    modelled step (``optimizer.rank_layouts``) among those that can run ``cfg`` on
    ``mesh`` (``Layout.check``), its model, and a line that names it, the runner-up,
    the others with their modelled times, and those skipped and why. Raises
    ValueError, in one line, where none can."""
    params = nnx.state(nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(0))))
    ranked, preset = rank_layouts(cfg, params, mesh.sizes(), jax.devices()[0])
    if not ranked:   # owner's options given, where the mesh allows no owner candidate
        taker = next(name for name, cls in LAYOUT_CLASSES.items() if "prefetch" in cls.options)
        layout_and_model(taker, cfg, mesh)   # raises its refusal
    feasible, skipped = [], {}
    for estimate in ranked:
        c = estimate.candidate
        try:   # a prefetched candidate's prefetch; else the user's (the others refuse it)
            feasible.append((estimate, *layout_and_model(
                c.layout, cfg, mesh, c.owner_group, c.prefetch or None)))
        except ValueError as err:
            skipped[estimate.label] = str(err)
    if not feasible:   # each reason once, with the layouts that give it
        reasons = {why: [n for n, w in skipped.items() if w == why] for why in skipped.values()}
        raise ValueError(next(iter(reasons)) if len(reasons) == 1 else
                         "--layout auto: no layout can run this: " + "; ".join(
                             f"{why} ({', '.join(names)})" for why, names in reasons.items()))
    (best, layout, model), others = feasible[0], [e for e, *_ in feasible[1:]]
    line = (f"layout auto: {best.describe()}"
            + (f"; runner-up {others[0].describe()}" if others else "")
            + "".join(f"; {e.label} {1e3 * e.seconds:,.1f} ms" for e in others[1:])
            + "".join(f"; skipped {name}: {why}" for name, why in skipped.items())
            + f" (modelled on {preset}: the optimizer and collectives of a step; "
              "docs/layouts.md, 'auto')")
    return layout, model, line
