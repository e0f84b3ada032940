"""Checkpoints with orbax, in a layout-independent (canonical) form.

What is written does not depend on the mesh or the optimizer layout: block
weights as [L, ...] (not grouped [L/g, g, ...]), the vocabulary unpadded,
matrix-optimizer state in its parameter's shape or [L, k, k] per matrix
(not padded and reordered for layerwise owners). Every leaf of params and optimizer state is canonicalized
by the parameter it belongs to, so a checkpoint restores onto any mesh and
layout with the same model and optimizer. Each device writes its own
shards (orbax); nothing is gathered to one host. Saving is asynchronous by
default; orbax writes into a temporary folder and renames it when complete,
so a save killed half-way leaves nothing that restores as whole.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from jmegatron.models.config import GPTConfig
from jmegatron.models.gpt import grouped_layers, real_layers
from jmegatron.optim.placement import Placement
from jmegatron.optim.soap import state_key
from jmegatron.sharding import rules as ax
from jmegatron.sharding.rules import logical_axes_of, spec_axes
from jmegatron.train.config import CheckpointConfig
from jmegatron.train.state import TrainState

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored here; the message names the leaf or file."""


@dataclasses.dataclass(frozen=True)
class LeafCodec:
    """How one live leaf maps to its canonical form."""

    grouped: int = 0                    # [G, g, ...] (padded) <-> [L, ...]: L (0: flat)
    vocab_dim: int | None = None        # padded vocabulary <-> vocab_size
    placement: Placement | None = None  # layerwise matrix-optimizer state: padded stack

    def encode(self, x: jax.Array, vocab: int) -> jax.Array:
        if self.placement is not None:
            x = self.placement.unpad(x)
        if self.grouped:
            x = x.reshape(-1, *x.shape[2:])[:self.grouped]
        if self.vocab_dim is not None:
            x = jax.lax.slice_in_dim(x, 0, vocab, axis=self.vocab_dim)
        return x

    def decode(self, x: jax.Array, shape: tuple[int, ...], padded_vocab: int) -> jax.Array:
        if self.vocab_dim is not None:
            widths = [(0, 0)] * x.ndim
            widths[self.vocab_dim] = (0, padded_vocab - x.shape[self.vocab_dim])
            x = jnp.pad(x, widths)
        if self.grouped:
            groups, group = self._param_shape(shape)[:2]
            x = jnp.pad(x, [(0, groups * group - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
            x = x.reshape(groups, group, *x.shape[1:])
        if self.placement is not None:
            x = self.placement.pad(x)
        return x

    def _param_shape(self, shape):
        return shape if self.placement is None else (
            shape[:self.placement.stack_axis] + (self.placement.length,)
            + shape[self.placement.stack_axis + 1:])


def _param_codecs(abstract_params, model: GPTConfig) -> dict[tuple, tuple]:
    """(path, shape) -> LeafCodec for every parameter, by its logical axes."""
    codecs = {}
    for path, var in jax.tree.leaves_with_path(abstract_params,
                                               is_leaf=lambda v: logical_axes_of(v) is not None):
        axes = logical_axes_of(var) or ()
        vocab_dim = axes.index(ax.VOCAB) if ax.VOCAB in axes else None
        codec = LeafCodec(real_layers(var) or 0,
                          vocab_dim if model.vocab != model.vocab_size else None)
        value_path = tuple(path) + tuple(jax.tree_util.tree_flatten_with_path(var)[0][0][0])
        codecs[value_path] = (tuple(var.shape), codec)
    return codecs


def leaf_codecs(abstract_state: TrainState, abstract_params, model: GPTConfig,
                placed: Callable[[tuple], Placement | None]) -> TrainState:
    """A LeafCodec for every leaf of the train state. Optimizer-state leaves
    follow the parameter whose path ends theirs (same shape), or the
    placement ``placed(path)`` gives a matrix optimizer's state (Muon's
    momentum, SOAP's moments and factors); scalars and counts stay as they are."""
    by_path = _param_codecs(abstract_params, model)
    longest = max(map(len, by_path), default=0)
    layers = {state_key(p): n for p, n in grouped_layers(abstract_params).items()}

    def pick(path, leaf):
        placement = placed(path)
        for k in range(min(longest, len(path)), 0, -1):
            shape, codec = by_path.get(tuple(path[-k:]), (None, None))
            if codec is not None and (placement is not None or shape == leaf.shape):
                return dataclasses.replace(codec, placement=placement)
        if placement is not None:   # per-matrix state of a stack (SOAP's factors)
            key = path[[getattr(k, "name", None) for k in path].index("factors") + 1].key
            return LeafCodec(grouped=layers.get(key, 0), placement=placement)   # by factor key
        return LeafCodec()

    return jax.tree.map_with_path(pick, abstract_state)


def canonical_sharding(sharding: jax.sharding.Sharding, codec: LeafCodec,
                       shape: tuple) -> jax.sharding.Sharding:
    """Where a canonical leaf is placed when loaded: its live split, merged for
    ungrouped layers, dropped where the canonical size does not divide."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = list(sharding.spec) + [None] * (len(shape) + (1 if codec.grouped else 0)
                                          - len(sharding.spec))
    if codec.grouped:
        spec = [spec_axes(spec[0]) + spec_axes(spec[1]) or None] + spec[2:]
    mesh = sharding.mesh
    size = lambda entry: int(np.prod([mesh.shape[a] for a in spec_axes(entry)]))
    spec = [entry if entry is not None and shape[i] % size(entry) == 0 else None
            for i, entry in enumerate(spec[:len(shape)])]
    return NamedSharding(mesh, P(*spec))


class Checkpointer:
    """Saves and restores one run's train state in canonical form."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig = CheckpointConfig()):
        self.directory = Path(directory).absolute()
        self._encode = (None, None)   # (codecs, jitted encoder): compiled once per run
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, keep_period=cfg.keep_period,
            enable_async_checkpointing=cfg.async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def save(self, step: int, state: TrainState, codecs: TrainState, model: GPTConfig,
             meta: dict) -> None:
        """Writes the canonical form of ``state`` (asynchronously if configured)."""
        if self._encode[0] is not codecs:
            self._encode = (codecs, jax.jit(lambda s: jax.tree.map(
                lambda c, x: c.encode(x, model.vocab_size), codecs, s,
                is_leaf=lambda c: isinstance(c, LeafCodec))))
        canonical = self._encode[1](state)
        leaves = {jax.tree_util.keystr(p): list(x.shape)
                  for p, x in jax.tree.leaves_with_path(canonical)}
        record = {"format": FORMAT, "step": step, "leaves": leaves, **meta}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(canonical), meta=ocp.args.JsonSave(record)))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def read_meta(self, step: int) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:
            raise CheckpointError(f"cannot read {self.directory / str(step) / 'meta'}: "
                                  f"{type(err).__name__}: {err}") from None

    def restore(self, step: int, target: TrainState, codecs: TrainState,
                model: GPTConfig) -> tuple[TrainState, dict]:
        """The checkpoint at ``step`` in the shape and shardings of ``target``
        (abstract arrays with shardings): another mesh or layout is fine."""
        meta = self.read_meta(step)
        is_codec = lambda c: isinstance(c, LeafCodec)
        canonical = jax.eval_shape(
            lambda s: jax.tree.map(lambda c, x: c.encode(x, model.vocab_size), codecs, s,
                                   is_leaf=is_codec), target)
        self._check_leaves(step, meta, canonical)
        shardings = jax.tree.map(lambda c, t, x: canonical_sharding(t.sharding, c, x.shape),
                                 codecs, target, canonical, is_leaf=is_codec)
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                canonical, shardings)
        try:
            loaded = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as err:
            raise CheckpointError(f"cannot restore {self.directory / str(step)}: "
                                  f"{type(err).__name__}: {str(err)[:500]}") from None
        decode = lambda s: jax.tree.map(
            lambda c, t, x: c.decode(x, t.shape, model.vocab).astype(t.dtype), codecs, target, s,
            is_leaf=is_codec)
        out_shardings = jax.tree.map(lambda t: t.sharding, target)
        return jax.jit(decode, out_shardings=out_shardings)(loaded), meta

    def _check_leaves(self, step: int, meta: dict, canonical) -> None:
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{self.directory / str(step)} has format "
                                  f"{meta.get('format')}, expected {FORMAT}")
        want = {jax.tree_util.keystr(p): list(x.shape)
                for p, x in jax.tree.leaves_with_path(canonical)}
        saved = meta["leaves"]
        for leaf, shape in want.items():
            if leaf not in saved:
                raise CheckpointError(f"checkpoint {self.directory / str(step)} has no leaf {leaf} "
                                      f"(written by optimizer {meta.get('optim')!r}, model "
                                      f"{json.dumps(meta.get('model', {}))[:200]})")
            if saved[leaf] != shape:
                raise CheckpointError(f"checkpoint leaf {leaf} has shape {tuple(saved[leaf])}, but "
                                      f"this model needs {tuple(shape)} "
                                      f"({self.directory / str(step)})")
        extra = sorted(set(saved) - set(want))
        if extra:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} has leaves this run "
                                  f"does not: {extra[:5]}")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
