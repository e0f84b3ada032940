"""``--layout auto``: the layout whose modelled step is shortest for a mesh, a model
and an optimizer, decided from the params' shapes alone (nothing is compiled).

Per device and step, for each candidate the mesh allows (``candidates``: a layout,
and for owner its group, ``layouts.OWNER_GROUPS``, and prefetch):

  optimizer    the matrix optimizer's FLOPs on one rank (``cost`` per matrix):
               every rank runs every matrix under replicated and fsdp ("stock
               FSDP-Muon"), its own whole matrices under layerwise and owner, a
               rank's ceil(L / owners) slots of an L-layer stack (padding counts:
               the busiest rank sets the step), at the preset's mfu x peak;
  collectives  the bytes one rank sends, by ring algorithms (an all-gather or a
               reduce-scatter over n ranks sends (n - 1) / n of the whole, an
               all-reduce twice that), over NVLink where every group of the
               collective stays in one node, else InfiniBand, each launch timed by
               the preset's links (``cost_model.comm_cost``: NCCL's ring model on
               GPUs, its latency growing with the ring's steps);
  hidden       prefetch only, on a preset that overlaps collectives with compute
               (``Hardware.overlaps``): in each pass every group's collectives but
               the first's, up to the layers' compute (``_hidden``);
  memory       params, gradients and optimizer state per device (and a prefetched
               group's weights). A layout whose
               share exceeds ``MEMORY_SHARE`` of the device's memory is chosen only
               when no layout fits.

What each layout sends, per trained leaf, is the layout's own model
(``Layout.traffic`` in ``sharding.layouts``, from the pieces of ``sharding.traffic``);
this module fills in each leaf's shapes, dtypes and owners and times the result.

On a preset whose XLA makes gradient sums it places itself all-reduces
(``Hardware.reduce_scatters``: XLA:CPU), their reduce-scatters count as all-reduces.

The forward and backward FLOPs are equal under every layout and left out, so the
modelled times rank layouts; they are not step times. Gathers are counted in the
compute dtype, gradient sums in the gradients' (``rules.grad_dtype_of``: the compute
dtype, or fp32 with ``GPTConfig.grad_reduce_dtype``), what accelerators run (XLA:CPU
widens bf16 sums to f32).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, NamedTuple, Sequence

import jax
from flax import nnx

from jmegatron.analysis.cost_model import CommCost, Hardware, comm_cost, hardware, preset_for
from jmegatron.optim.placement import place
from jmegatron.optim.routing import MATRIX, MatrixFlops, Routing, leaf_routes, routed
from jmegatron.sharding import rules as ax
from jmegatron.sharding.layouts import LAYOUT_CLASSES, Layout, layout_label, make_layout
from jmegatron.sharding.traffic import LeafTraffic, RunOptions, Transfer

MEMORY_SHARE = 0.8      # of the device's memory for params, gradients and state
# Optimizer state per element, in bytes, where the caller does not say: Muon's fp32
# momentum for matrices, AdamW's two fp32 moments for the rest.
STATE_BYTES = (4, 8)


class Candidate(NamedTuple):
    """One way to run a step that auto compares: a layout and the owner layout's
    options (its group, ``layouts.OWNER_GROUPS``; ``GPTConfig.prefetch``)."""

    layout: str
    owner_group: str = "fsdp"
    prefetch: bool = False

    @property
    def label(self) -> str:
        return layout_label(self.layout, self.owner_group, self.prefetch)

    def make(self, mesh_shape: Mapping[str, int], rules: ax.Rules = ax.DEFAULT_RULES) -> Layout:
        return make_layout(self.layout, mesh_shape, rules, owner_group=self.owner_group)


@dataclasses.dataclass(frozen=True)
class LayoutEstimate:
    """One candidate's modelled step on one preset, per device."""

    candidate: Candidate
    optimizer_s: float       # the matrix optimizer's FLOPs on the busiest rank
    comm: CommCost           # its collectives
    memory_bytes: float      # params, gradients and optimizer state
    fits: bool               # memory_bytes within MEMORY_SHARE of the device's
    hidden_s: float = 0.0    # collectives prefetch hides behind the layers' compute

    @property
    def layout(self) -> str:
        return self.candidate.layout

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def seconds(self) -> float:
        """Optimizer and collectives, nothing overlapped but what prefetch hides."""
        return self.optimizer_s + self.comm.seconds - self.hidden_s

    def describe(self) -> str:
        moved = self.comm.nvlink_bytes + self.comm.ib_bytes
        hidden = f" - hidden {1e3 * self.hidden_s:,.1f}" if self.hidden_s else ""
        return (f"{self.label} {1e3 * self.seconds:,.1f} ms (optimizer "
                f"{1e3 * self.optimizer_s:,.1f} + collectives {1e3 * self.comm.seconds:,.1f}"
                f"{hidden}, {moved / 1e6:,.1f} MB sent, {self.memory_bytes / 1e6:,.1f} MB "
                f"params+grads+state{'' if self.fits else ', does not fit'})")


def _hidden(stacks: list[tuple[LeafTraffic, list[Transfer]]], tokens: float,
            mesh_shape: Mapping[str, int], hw: Hardware) -> float:
    """Seconds of collectives that prefetch hides, per step: in each pass, every
    group's gather but the first runs while the group before it computes (and in
    the backward, every group's gradient sums but the last), so up to (G - 1) / G
    of a pass's collectives hide behind (G - 1) / G of its compute; the layers'
    compute is 2 FLOPs per weight and token forward, 4 backward (attention's
    score products left out: less compute, less hidden)."""
    if not (hw.overlaps and tokens and stacks):
        return 0.0
    weights = sum(leaf.used for leaf, _ in stacks)
    share = sum((leaf.groups - 1) / leaf.groups * leaf.used for leaf, _ in stacks) / weights
    hidden = 0.0
    # traffic.sharded's order: the forward's gather, then the backward's collectives.
    for flops_per_weight, pick in ((2, lambda t: t[:1]), (4, lambda t: t[1:])):
        comm = comm_cost([c for _, t in stacks for c in pick(t)], mesh_shape, hw).seconds
        hidden += share * min(comm, flops_per_weight * weights * tokens / hw.flops_per_s)
    return hidden


def _all_reduced(t: Transfer) -> Transfer:
    """A reduce-scatter as XLA:CPU runs it (``Hardware.reduce_scatters``)."""
    if t.kind != "reduce-scatter":
        return t
    return t._replace(kind="all-reduce", bytes_per_device=2 * t.bytes_per_device)


def candidates(mesh_shape: Mapping[str, int], rules: ax.Rules = ax.DEFAULT_RULES,
               prefetch: bool = False) -> tuple[Candidate, ...]:
    """The candidates that differ on this mesh: every registered layout
    (``layouts.LAYOUT_CLASSES``) in each of the ways it says it differs here
    (``Layout.variants``: replicated always; layerwise where a batch axis is live;
    fsdp and owner over ``fsdp`` where a ZeRO-3 axis is; owner over ``data+fsdp``
    where that group has another live axis; and with ``prefetch``, each owner also
    prefetched where only batch axes are live)."""
    return tuple(Candidate(name, **options) for name, cls in LAYOUT_CLASSES.items()
                 for options in cls.variants(mesh_shape, rules, prefetch))


def _leaves(params, layout: Layout, mesh_shape: Mapping[str, int], cost: MatrixFlops,
            routing: Routing) -> list[tuple[LeafTraffic, bool]]:
    """(leaf, is_matrix) for every trained leaf of ``params`` under ``layout``."""
    zero3 = ax.mesh_axes_of(ax.EMBED, layout.rules)   # split element-wise (or by owner)
    tokens = [a for a in ax.axis_roles(layout.rules).tokens if mesh_shape.get(a, 1) > 1]
    sizes = dict(mesh_shape)
    out = []
    for path, node in jax.tree.flatten_with_path(params, is_leaf=_is_variable)[0]:
        leaf = routed(path, node, routing)
        if leaf.route is None:
            continue
        logical = leaf.logical or (None,) * len(leaf.shape)
        spec = [a for entry in layout.param_spec(logical) for a in ax.spec_axes(entry)]
        is_matrix = leaf.route.kind == MATRIX
        flops = (sum(p.count * cost(p.fan_in, p.fan_out) for p in leaf.route.spec.pieces(
            leaf.shape)) if is_matrix else 0.0)
        elements, layers = math.prod(leaf.shape), _layers(leaf.shape, logical)
        owners = _owners(layout, leaf, logical, is_matrix)
        compute, summed = ax.compute_dtype_of(node), ax.grad_dtype_of(node)
        masters = layout.masters_on_owners(compute, summed, owners, layers % owners > 0)
        out.append((LeafTraffic(elements, elements / math.prod(sizes.get(a, 1) for a in spec)
                                / (owners if masters else 1),
                                tuple(a for a in spec if a in zero3 and sizes.get(a, 1) > 1),
                                tuple(a for a in tokens if a not in spec), sizes,
                                jax.tree.leaves(node)[0].dtype.itemsize,
                                compute.itemsize, summed.itemsize, layers, flops, owners,
                                masters),
                    is_matrix))
    return out


def _is_variable(node) -> bool:
    return isinstance(node, nnx.Variable)


def _layers(shape, logical) -> int:
    """Layers stacked on the leaf's leading dims ([L, ...] or [L/g, g, ...]); 1: none."""
    stacked = [n for n, name in zip(shape, logical[:2]) if name in (ax.LAYERS, ax.LAYER_GROUPS)]
    return math.prod(stacked) if stacked else 1


def _owners(layout: Layout, leaf, logical, is_matrix: bool) -> int:
    """Ranks a stack's layers are dealt to: the owner layout's group of layers, the
    layerwise layout's owners of a matrix stack (its placement); else 1."""
    if _layers(leaf.shape, logical) == 1:
        return 1
    if layout.layer_group > 1:
        return layout.layer_group
    return place(leaf, layout).owners if is_matrix and leaf.logical else 1


def estimate(params, mesh_shape: Mapping[str, int], hw: Hardware | str,
             layouts: Sequence[str | Candidate] | None = None, cost: MatrixFlops | None = None,
             routing: Routing = Routing(), rules: ax.Rules = ax.DEFAULT_RULES,
             keep_gathered: bool = False, state_bytes: tuple[int, int] = STATE_BYTES,
             prefetch: bool = False, tokens: float = 0.0) -> list[LayoutEstimate]:
    """Each candidate's modelled step, shortest first (those that fit first).

    Args:
      params: the params (abstract is enough: shapes, logical axes and compute
        dtypes are read), stacked [L, ...] or grouped [L/g, g, ...].
      mesh_shape: axis name -> size, in the mesh's order (``mesh.shape``).
      hw: a ``cost_model.Hardware`` or the name of a preset.
      layouts: the layouts (names) or candidates to compare; None:
        ``candidates(mesh_shape, rules, prefetch)``.
      cost: the optimizer's FLOPs of one matrix, ``(fan_in, fan_out) -> FLOPs``
        (the registry's ``matrix_flops``); None: no matrix optimizer (AdamW).
      routing: which leaves are matrices.
      rules: the logical-to-mesh rules the layouts are built on.
      keep_gathered: the owner backward reuses the forward's gathered weights
        (no prefetch then).
      state_bytes: optimizer state per element, (matrices, other leaves).
      prefetch: also model each owner candidate prefetched (dense stacks only).
      tokens: tokens per device in one forward and backward pass (a microbatch),
        which prefetch's overlap needs (0: nothing hidden; nor where ``hw`` does
        not overlap collectives with compute).

    Returns:
      One ``LayoutEstimate`` per candidate: those that fit first, then by seconds,
      then by memory.
    """
    hw = hardware(hw) if isinstance(hw, str) else hw
    cost = cost or (lambda fan_in, fan_out: 0)
    todo = layouts or candidates(mesh_shape, rules, prefetch and not keep_gathered)
    out = []
    for candidate in (c if isinstance(c, Candidate) else Candidate(c) for c in todo):
        layout = candidate.make(mesh_shape, rules)
        manual = layout.sums_gradients_manually(mesh_shape)
        run = RunOptions(keep_gathered, candidate.prefetch, manual)
        transfers, stacks, flops, memory = [], [], 0.0, 0.0
        for leaf, is_matrix in _leaves(params, layout, mesh_shape, cost, routing):
            sent = layout.traffic(leaf, run)
            transfers += sent
            slots = leaf.padding / leaf.owners   # of the stack, on the busiest rank
            split = leaf.used / leaf.elements   # tensor and expert splits
            flops += leaf.matrix_flops * split * slots
            # Params and gradients as stored (and the model's copy of masters on
            # owners); state on the leaf's owners only.
            memory += 2 * leaf.local * leaf.master + (
                state_bytes[0] if is_matrix else state_bytes[1]) * min(leaf.local,
                                                                       leaf.used * slots)
            memory += leaf.used * leaf.wire if leaf.masters_on_owners else 0
            if run.prefetch and leaf.owners > 1:   # a prefetched stack: one group more whole
                stacks.append((leaf, sent))
                memory += leaf.used * leaf.padding / leaf.groups * leaf.wire
        memory_ok = memory <= MEMORY_SHARE * hw.hbm_gb * 1e9
        if not (hw.reduce_scatters or manual):
            transfers = [_all_reduced(t) for t in transfers]
        out.append(LayoutEstimate(candidate, flops / hw.flops_per_s,
                                  comm_cost(transfers, mesh_shape, hw), memory, memory_ok,
                                  _hidden(stacks, tokens, mesh_shape, hw)))
    return sorted(out, key=lambda e: (not e.fits, e.seconds, e.memory_bytes))


def preset_of(device) -> tuple[str, str]:
    """The ``cost_model`` preset that models ``device`` (a ``jax.Device``), and its name
    as the choice's line states it (an unknown accelerator says so)."""
    preset, known = preset_for(device.platform, device.device_kind)
    return preset, preset if known else f"{preset} (no preset for {device.device_kind!r})"


def choose(params, mesh: jax.sharding.Mesh, rules: ax.Rules = ax.DEFAULT_RULES,
           cost: MatrixFlops | None = None, routing: Routing = Routing()) -> Layout:
    """``make_plan(..., layout="auto")``: the layout with the shortest modelled step on
    the preset of ``mesh``'s devices among those ``params`` are stacked for (owner
    needs block weights grouped [L/f, f, ...], f its group's size: build the model
    with the owner layout's ``stack_fields`` for it to be considered)."""
    preset, _ = preset_of(mesh.devices.flat[0])
    ranked = [e.candidate.make(mesh.shape, rules)
              for e in estimate(params, mesh.shape, preset, cost=cost, routing=routing,
                                rules=rules)]
    return next(layout for layout in ranked if _stacked_for(layout, params, routing))


def _stacked_for(layout: Layout, params, routing: Routing) -> bool:
    """Whether every matrix leaf of ``params`` can live under ``layout``, its layers
    grouped as the layout runs them."""
    for leaf in leaf_routes(params, routing):
        if leaf.route.kind == MATRIX and leaf.logical:
            try:
                layout.check_matrix(leaf.path, leaf.logical)
            except ValueError:
                return False
            grouped = ax.LAYER_GROUPS in leaf.logical[:2]
            group = leaf.shape[leaf.logical.index(ax.LAYERS)] if grouped else 1
            if group != layout.layer_group:
                return False
    return True
