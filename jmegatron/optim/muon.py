"""Muon: momentum orthogonalized by Newton-Schulz, as optax transformations."""

from __future__ import annotations

import math
from typing import Callable, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from jmegatron.optim import checks
from jmegatron.optim.coefficients import CoefficientSet, coefficient_set
from jmegatron.optim.newton_schulz import NS_METHODS, NSMethod, newton_schulz, ns_flops
from jmegatron.optim.matrix import (AdamW, PlanLike, PlanSource, WeightDecayMethod, descend,
                                    held_zeros, scale_by_matrix_optimizer, with_adamw)
from jmegatron.optim.plan import HELD, LeafPlan, matrix_state
from jmegatron.optim.routing import (Routing, flops_over_matrices, from_matrices,
                                     to_matrices)
from jmegatron.optim.tensor_parallel import TP_MODES, TensorParallel, TPMode, tp_newton_schulz

ScaleMode = Literal["spectral", "shape", "unit_rms", "none"]
MOONLIGHT_RMS = 0.2   # spectral x 0.2 gives updates with AdamW's typical RMS


@matrix_state(momentum=HELD)
class MuonState(NamedTuple):
    """The state of ``scale_by_muon`` (and of ``scale_by_mop``).

    Attributes:
      count: the steps taken, an int32 scalar.
      momentum: the momentum, a tree mirroring the params; each matrix leaf held as
        its owners hold it (the stack padded under layerwise), in ``momentum_dtype``.
    """

    count: jax.Array              # int32 scalar
    momentum: optax.Updates       # mirrors the params, each held as its owners hold it


def update_scale(mode: ScaleMode, fan_in: int, fan_out: int,
                 rms_factor: float | None = None) -> float:
    """Multiplier of an orthogonalized fan_in x fan_out update.

    spectral: sqrt(max(fan_in, fan_out)), unit RMS; shape: sqrt(max(1, fan_out /
    fan_in)) (Keller Jordan's Muon); unit_rms: sqrt(fan_out / fan_in) (unit
    RMS-to-RMS operator norm); none: 1. Times ``rms_factor``, by default 0.2
    for spectral (Moonlight: AdamW's update RMS) and 1 for the others.

    Args:
      mode: "spectral", "shape", "unit_rms" or "none" (above).
      fan_in: the matrix's input dim (rows of jmegatron's [fan_in, fan_out]).
      fan_out: the matrix's output dim.
      rms_factor: a factor on top; None: ``MOONLIGHT_RMS`` (0.2) for "spectral",
        1 for the others.

    Returns:
      The multiplier, a float.

    References:
      Liu et al., "Muon is Scalable for LLM Training", arXiv:2502.16982, 2025.
    """
    if rms_factor is None:
        rms_factor = MOONLIGHT_RMS if mode == "spectral" else 1.0
    base = {"spectral": math.sqrt(max(fan_in, fan_out)),
            "shape": math.sqrt(max(1.0, fan_out / fan_in)),
            "unit_rms": math.sqrt(fan_out / fan_in),
            "none": 1.0}
    if mode not in base:
        raise ValueError(f"unknown scale mode {mode!r}; one of {sorted(base)}")
    return base[mode] * rms_factor


def momentum_step(g, m, count, beta, momentum, nesterov, bias_correction):
    """New momentum and the direction to orthogonalize (fp32)."""
    if momentum == "ema":
        m = beta * m + (1 - beta) * g
        if bias_correction:
            look_ahead = beta * m / (1 - beta ** (count + 1)) + (1 - beta) * g / (1 - beta ** count)
            return m, look_ahead if nesterov else m / (1 - beta ** count)
        return m, beta * m + (1 - beta) * g if nesterov else m
    if momentum == "sum":
        m = beta * m + g
        return m, g + beta * m if nesterov else m
    raise ValueError(f"momentum must be 'ema' or 'sum', got {momentum!r}")


def check_momentum_args(beta, rms_factor, momentum_dtype) -> None:
    """The arguments Muon, MOP and adaptive Muon share, refused at construction."""
    checks.fraction("beta", beta)
    checks.positive("rms_factor", rms_factor, optional=True)
    checks.float_dtype("momentum_dtype", momentum_dtype, optional=True)


OrthogonalBlocks = Callable[[jax.Array, LeafPlan], list[tuple[jax.Array, int, int]]]


def newton_schulz_blocks(coefficients, steps: int | None, matmul_dtype, syrk: bool | str,
                         method: NSMethod, tp_mode: TPMode, mesh: jax.sharding.Mesh | None
                         ) -> OrthogonalBlocks:
    """``f(u, leaf)``: Newton-Schulz of every block of a leaf ``u`` (held as its owners
    hold it), as (orthogonal stack, fan_in, fan_out) with the fans of the matrices
    that were orthogonalized (under blockwise tensor parallelism: a shard's).
    Matrices split over the tensor axis use ``tp_mode``."""
    if method not in NS_METHODS:
        raise ValueError(f"unknown Newton-Schulz method {method!r}; one of {NS_METHODS}")
    checks.integer("steps", steps, 1, optional=True)
    checks.float_dtype("matmul_dtype", matmul_dtype)
    checks.one_of("tp_mode", tp_mode, TP_MODES)
    tp = None if mesh is None else TensorParallel(mesh, tp_mode)
    # A dtype name, not jnp.float32: optax.inject_hyperparams takes callables for schedules.
    ns = dict(steps=steps, coefficients=coefficients, matmul_dtype=jnp.dtype(matmul_dtype),
              syrk=syrk, method=method)
    n_steps = coefficient_set(coefficients).default_steps if steps is None else steps
    aol = coefficient_set(coefficients).normalization == "aol"

    def blocks(u: jax.Array, leaf: LeafPlan):
        where = leaf.placement
        side = None if where is None else tp.side(leaf.route.spec, where.state)
        out = []
        for stack in to_matrices(u, leaf.route.spec):
            fan_in, fan_out = stack.shape[-2:]
            if tp is None:
                out.append((newton_schulz(stack, **ns), fan_in, fan_out))
                continue
            mode = None if side is None else tp.mode_for(fan_in, fan_out, side, n_steps, aol)
            if mode == "blockwise":   # each block is a matrix of its own, scale included
                fan_in, fan_out = ((fan_in // tp.size, fan_out) if side == "in"
                                   else (fan_in, fan_out // tp.size))
            ortho = tp_newton_schulz(stack, side, mode, tp, **ns,
                                     batch_spec=() if where is None else where.stack,
                                     real=None if where is None else where.real_slots())
            out.append((ortho, fan_in, fan_out))
        return out
    return blocks


def scaled_orthogonal(orthogonal_blocks: OrthogonalBlocks, scale: ScaleMode,
                      rms_factor: float | None) -> Callable[[jax.Array, LeafPlan], jax.Array]:
    """``f(u, leaf)``: every block of ``u`` orthogonalized and times its ``update_scale``."""

    def orthogonalize(u: jax.Array, leaf: LeafPlan) -> jax.Array:
        scaled = [ortho * update_scale(scale, fan_in, fan_out, rms_factor)
                  for ortho, fan_in, fan_out in orthogonal_blocks(u, leaf)]
        return from_matrices(scaled, leaf.route.spec, u.shape)
    return orthogonalize


def scale_by_muon(*, coefficients: str | CoefficientSet | tuple = "quintic",
                  steps: int | None = None, beta: float = 0.95, nesterov: bool = True,
                  momentum: Literal["ema", "sum"] = "ema", bias_correction: bool = False,
                  momentum_dtype=None, scale: ScaleMode = "spectral",
                  rms_factor: float | None = None, matmul_dtype="float32",
                  tp_mode: TPMode = "auto", syrk: bool | str = False,
                  ns_method: NSMethod = "standard", plan: PlanLike = None
                  ) -> optax.GradientTransformation:
    """Muon's direction: momentum, Newton-Schulz orthogonalization, shape scale.

    Every leaf it sees must be a matrix (or a stack of them) under ``routing``;
    fused QKV/SwiGLU weights are split into blocks, each orthogonalized with
    its own scale. ``muon`` combines this with AdamW for the other leaves.
    Momentum is an EMA (``g`` weighted ``1 - beta``) or a sum; with
    ``bias_correction`` the EMA form equals ``optax.contrib.scale_by_muon``.

    With a ``mesh``, Newton-Schulz runs in ``jax.shard_map``: the ``layout``
    (a ``jmegatron.sharding.layouts.Layout`` or its name; default "fsdp",
    i.e. params placed by ``rules``) decides where each matrix's state lives
    and which device orthogonalizes it (see ``jmegatron.optim.placement``);
    ``plan`` (``jmegatron.optim.plan.make_plan``) gives all of that at once
    and replaces ``routing``, ``mesh``, ``layout`` and ``rules``. Matrices split
    over the tensor axis use ``tp_mode`` (duplicated, distributed, gathered,
    blockwise, or auto per matrix; see ``jmegatron.optim.tensor_parallel``). ``syrk`` runs
    Newton-Schulz's symmetric products on the SYRK kernel (see
    ``newton_schulz``), in every mode; ``ns_method`` "gram" iterates on the short
    side's Gram, "auto" wherever that saves FLOPs (``newton_schulz``).

    Bad arguments raise a one-line ValueError here (``jmegatron.optim.checks``;
    a schedule's values cannot be checked), and at init a matrix leaf that is
    not floating-point or has no elements, or a ``plan`` made for other params.
    Gradients are not checked: a NaN or an inf in a matrix block's gradient
    enters the momentum and, through Newton-Schulz, makes the block's whole
    update NaN, on that step and (the momentum keeps it) every later one; other
    blocks are unaffected. ``jmegatron.train``'s step skips non-finite steps
    itself; in your own chain, wrap the optimizer in ``optax.apply_if_finite``.

    Args:
      coefficients: Newton-Schulz's per-iteration (a, b, c): a set's name, tuples or
        a ``CoefficientSet`` (see ``coefficient_set``).
      steps: Newton-Schulz iterations; None: the set's ``default_steps``.
      beta: the momentum's decay.
      nesterov: orthogonalize the Nesterov look-ahead (``beta * m + (1 - beta) * g``
        for "ema", ``g + beta * m`` for "sum") instead of the momentum m.
      momentum: "ema" (``m <- beta * m + (1 - beta) * g``) or "sum"
        (``m <- beta * m + g``).
      bias_correction: divide the EMA by ``1 - beta^t`` ("ema" only). Newton-Schulz
        ignores the input's scale, so this changes only the Nesterov mix of m and g.
      momentum_dtype: the dtype the momentum is stored in; None: the param's. It
        is updated in fp32.
      scale: the multiplier of each orthogonalized block (``update_scale``):
        "spectral" (unit RMS, times ``rms_factor``), "shape", "unit_rms" or "none".
      rms_factor: a factor on ``scale``; None: 0.2 for "spectral" (Moonlight), 1
        for the others.
      matmul_dtype: the dtype of Newton-Schulz's matmul operands ("float32", or
        "bfloat16" with fp32 accumulation).
      tp_mode: Newton-Schulz of matrices split over the tensor axis:
        "duplicated", "distributed", "gathered", "blockwise" or "auto" (per
        matrix, by ``TPCostModel``); used only with a mesh.
      syrk: Newton-Schulz's symmetric products on the SYRK kernel: False, True or a
        backend name (see ``newton_schulz``).
      ns_method: "standard", "gram" or "auto" (see ``newton_schulz``).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.

    Returns:
      An ``optax.GradientTransformation`` (state ``MuonState``) whose updates are
      the scaled orthogonalized directions, before the learning rate and sign.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural
        networks", 2024 (kellerjordan.github.io/posts/muon).
      Liu et al., "Muon is Scalable for LLM Training", arXiv:2502.16982, 2025.
      Bernstein & Newhouse, "Old Optimizer, New Norm: An Anthology",
        arXiv:2409.20325, 2024.
    """
    check_momentum_args(beta, rms_factor, momentum_dtype)
    checks.one_of("momentum", momentum, ("ema", "sum"))
    checks.one_of("scale", scale, get_args(ScaleMode))
    source = PlanSource.of(plan)
    orthogonal_blocks = newton_schulz_blocks(coefficients, steps, matmul_dtype, syrk, ns_method,
                                             tp_mode, source.placed_on)

    orthogonalize = scaled_orthogonal(orthogonal_blocks, scale, rms_factor)

    def init_stack(x, leaf):
        return (held_zeros(x, leaf, momentum_dtype or x.dtype),)

    def update_stack(g, fields, count, leaf):
        (m,) = fields
        m32, direction = momentum_step(g, m.astype(jnp.float32), count, beta, momentum,
                                        nesterov, bias_correction)
        return orthogonalize(direction, leaf), (m32.astype(m.dtype),)

    return scale_by_matrix_optimizer("scale_by_muon", MuonState, init_stack, update_stack,
                                     source)


def muon(learning_rate: optax.ScalarOrSchedule, *,
         coefficients: str | CoefficientSet | tuple = "quintic", steps: int | None = None,
         beta: float = 0.95, nesterov: bool = True, momentum: Literal["ema", "sum"] = "ema",
         bias_correction: bool = False, momentum_dtype=None, scale: ScaleMode = "spectral",
         rms_factor: float | None = None, weight_decay: float = 0.0,
         weight_decay_method: WeightDecayMethod = "decoupled",
         matmul_dtype="float32", tp_mode: TPMode = "auto",
         syrk: bool | str = False, ns_method: NSMethod = "standard",
         plan: PlanLike = None, adamw: AdamW = AdamW()
         ) -> optax.GradientTransformation:
    """Muon for hidden matrices, AdamW for every other leaf.

    ``routing`` (or ``plan``) decides which leaves are matrices. Matrices get
    ``-lr * scale * NS(momentum)`` and weight decay by ``weight_decay_method``
    (default decoupled: ``- lr * weight_decay * W``; see
    ``jmegatron.optim.matrix.descend``); the other leaves get ``adamw``'s. With
    the default spectral scale x 0.2 (Moonlight), one learning rate suits both
    groups. ``describe(params, routing)`` prints who gets what.

    Args:
      learning_rate: a number or an optax schedule of the step; also AdamW's
        unless ``adamw.learning_rate`` is set.
      coefficients: Newton-Schulz's per-iteration (a, b, c): a set's name, tuples or
        a ``CoefficientSet`` (see ``coefficient_set``).
      steps: Newton-Schulz iterations; None: the set's ``default_steps``.
      beta: the momentum's decay.
      nesterov: orthogonalize the Nesterov look-ahead instead of the momentum.
      momentum: "ema" (``m <- beta * m + (1 - beta) * g``) or "sum"
        (``m <- beta * m + g``).
      bias_correction: divide the EMA by ``1 - beta^t`` ("ema" only).
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      scale: the multiplier of each orthogonalized block (``update_scale``):
        "spectral", "shape", "unit_rms" or "none".
      rms_factor: a factor on ``scale``; None: 0.2 for "spectral", 1 for the others.
      weight_decay: the matrices' weight decay coefficient (0: none); the other
        leaves take ``adamw.weight_decay``.
      weight_decay_method: "decoupled", "independent", "l2" or "palm" (see
        ``descend``).
      matmul_dtype: the dtype of Newton-Schulz's matmul operands.
      tp_mode: Newton-Schulz of matrices split over the tensor axis (see
        ``scale_by_muon``).
      syrk: Newton-Schulz's symmetric products on the SYRK kernel: False, True or a
        backend name.
      ns_method: "standard", "gram" or "auto" (see ``newton_schulz``).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.
      adamw: the AdamW of the other leaves (``AdamW``: b1 0.9, b2 0.95, eps 1e-8,
        no weight decay by default).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "muon") and the AdamW leaves.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural
        networks", 2024 (kellerjordan.github.io/posts/muon).
      Liu et al., "Muon is Scalable for LLM Training", arXiv:2502.16982, 2025.
    """
    direction = scale_by_muon(
        coefficients=coefficients, steps=steps, beta=beta, nesterov=nesterov, momentum=momentum,
        bias_correction=bias_correction, momentum_dtype=momentum_dtype, scale=scale,
        rms_factor=rms_factor, matmul_dtype=matmul_dtype, tp_mode=tp_mode,
        syrk=syrk, ns_method=ns_method, plan=plan)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method)
    return with_adamw("muon", matrix, plan, learning_rate, adamw)


def muon_flops(params, routing: Routing = Routing(), steps: int | None = None,
               coefficients: str | CoefficientSet | tuple = "quintic", syrk: bool = False,
               ns_method: NSMethod = "standard") -> int:
    """Newton-Schulz FLOPs of one Muon step on ``params``.

    Every matrix block is counted whole, by ``ns_flops``, on one device.

    Args:
      params: the params tree (real or abstract arrays, or an nnx.State; only the
        shapes and logical axes are read).
      routing: which leaves are matrices, as for ``muon``.
      steps: Newton-Schulz iterations; None: the set's ``default_steps``.
      coefficients: the coefficient set (only its default step count is read).
      syrk: count the symmetric products as the SYRK kernel's tiles.
      ns_method: "standard", "gram" or "auto", as run.

    Returns:
      The FLOPs, an int.
    """
    n = coefficient_set(coefficients).default_steps if steps is None else steps
    return flops_over_matrices(params, routing, lambda m, k: ns_flops(m, k, n, syrk, ns_method))
