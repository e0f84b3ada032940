"""MuonBP: Muon whose blocks are orthogonalized where they lie, the whole matrix every P steps.

Under model parallelism no device holds a whole matrix, and Muon's
Newton-Schulz must gather it (FSDP) or communicate inside every iteration
(tensor parallelism). MuonBP (Khaled et al. 2025) orthogonalizes each
device's own block of the momentum on most steps ("block steps": no
collective) and the whole matrix every ``period`` steps ("full steps"),
exactly as Muon does under the layout (its tensor-parallel modes included).

The block is what the device holds of the momentum under the layout
(``LeafPlan.held``): under ``fsdp`` its fsdp shard (and tensor shard), under
``owner``, ``layerwise`` and ``replicated`` the whole matrix (its tensor
shard where the matrix is split over ``tensor``: Muon's ``blockwise`` mode).
So MuonBP depends on the sharding by design; where a device holds whole
matrices it is Muon.

Two step sizes, as the paper's analysis prescribes: each block's update is
scaled by ``update_scale`` of the block's own shape (RMS matching: a
spectral-scaled block has the RMS of a spectral-scaled whole matrix), times
``block_lr_ratio`` (the block step size over the full one).

Full steps are the steps whose count (1 at the first update) is a multiple
of ``period``; the choice is a ``lax.cond`` on the count, so one compiled
program holds both, and only the full branch communicates
(``tests/test_muon_bp.py`` checks the HLO branch by branch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jmegatron.optim import checks
from jmegatron.optim.coefficients import CoefficientSet
from jmegatron.optim.matrix import (AdamW, PlanLike, PlanSource, WeightDecayMethod, descend,
                                    held_zeros, scale_by_matrix_optimizer, with_adamw)
from jmegatron.optim.muon import (MuonState, ScaleMode, check_momentum_args, momentum_step,
                                  newton_schulz_blocks, scaled_orthogonal, update_scale)
from jmegatron.optim.newton_schulz import NSMethod, newton_schulz
from jmegatron.optim.plan import LeafPlan
from jmegatron.optim.routing import from_matrices, to_matrices
from jmegatron.optim.tensor_parallel import TPMode
from jmegatron.sharding.rules import spec_axes


def block_orthogonal(ns: dict, scale: ScaleMode, rms_factor: float | None,
                     mesh: jax.sharding.Mesh | None):
    """``f(u, leaf)``: each device's own block of ``u`` (as held: ``leaf.held``)
    orthogonalized and scaled by its own shape, in ``jax.shard_map``; no collective.
    Without a mesh the block is the whole leaf."""

    def local(u: jax.Array, spec) -> jax.Array:
        scaled = [newton_schulz(stack, **ns) * update_scale(scale, *stack.shape[-2:], rms_factor)
                  for stack in to_matrices(u, spec)]
        return from_matrices(scaled, spec, u.shape)

    def orthogonalize(u: jax.Array, leaf: LeafPlan) -> jax.Array:
        spec = leaf.route.spec
        if mesh is None or leaf.held is None:
            return local(u, spec)
        held = leaf.held
        if spec.split_axis is not None and spec.split_axis < len(held) and \
                spec_axes(held[spec.split_axis]):
            raise ValueError(f"muon_bp: {leaf.path} is split over "
                             f"{spec_axes(held[spec.split_axis])} along its fused blocks' axis "
                             f"{spec.split_axis}; a device's block would mix them")
        return jax.shard_map(lambda x: local(x, spec), mesh=mesh, in_specs=held,
                             out_specs=held)(u)
    return orthogonalize


def scale_by_muon_bp(*, period: int = 5, block_lr_ratio: float = 1.0,
                     coefficients: str | CoefficientSet | tuple = "quintic",
                     steps: int | None = None, beta: float = 0.95, nesterov: bool = True,
                     momentum_dtype=None, scale: ScaleMode = "spectral",
                     rms_factor: float | None = None, matmul_dtype="float32",
                     tp_mode: TPMode = "auto", syrk: bool | str = False,
                     ns_method: NSMethod = "standard", plan: PlanLike = None
                     ) -> optax.GradientTransformation:
    """MuonBP's direction: Muon's momentum, orthogonalized by blocks, whole every P steps.

    Momentum as ``scale_by_muon``'s EMA (Nesterov by default). On a full step (the
    count a multiple of ``period``) the direction is Muon's under the layout; on the
    others each device orthogonalizes its own block of it (module docstring), scaled
    by ``update_scale`` of the block's shape times ``block_lr_ratio``. ``period=1``
    is Muon. The state is ``MuonState``: a Muon checkpoint resumes as MuonBP and back.
    Arguments are checked here (one-line ValueError).

    Args:
      period: P, a full step every P steps (an int >= 1).
      block_lr_ratio: the block steps' step size over the full steps' (> 0).
      coefficients: Newton-Schulz's per-iteration (a, b, c) (see ``scale_by_muon``).
      steps: Newton-Schulz iterations; None: the set's ``default_steps``.
      beta: the momentum's decay.
      nesterov: orthogonalize the Nesterov look-ahead instead of the momentum.
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      scale: the multiplier of each orthogonalized block (``update_scale``), of the
        whole matrix's shape on full steps and of the block's on block steps.
      rms_factor: a factor on ``scale``; None: 0.2 for "spectral", 1 otherwise.
      matmul_dtype: the dtype of Newton-Schulz's matmul operands.
      tp_mode: the full steps' Newton-Schulz of matrices split over the tensor axis
        (see ``scale_by_muon``); block steps are blockwise.
      syrk: Newton-Schulz's symmetric products on the SYRK kernel.
      ns_method: "standard", "gram" or "auto" (see ``newton_schulz``).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.

    Returns:
      An ``optax.GradientTransformation`` (state ``MuonState``).

    References:
      Khaled, Ozkara, Yu, Hong & Park, "MuonBP: Faster Muon via Block-Periodic
        Orthogonalization", arXiv:2510.16981, 2025.
    """
    checks.integer("period", period, 1)
    checks.positive("block_lr_ratio", block_lr_ratio)
    check_momentum_args(beta, rms_factor, momentum_dtype)
    source = PlanSource.of(plan)
    full = scaled_orthogonal(newton_schulz_blocks(coefficients, steps, matmul_dtype, syrk,
                                                  ns_method, tp_mode, source.placed_on),
                             scale, rms_factor)
    ns = dict(steps=steps, coefficients=coefficients, matmul_dtype=jnp.dtype(matmul_dtype),
              syrk=syrk, method=ns_method)
    block = block_orthogonal(ns, scale, rms_factor, source.placed_on)

    def init_stack(x, leaf):
        return (held_zeros(x, leaf, momentum_dtype or x.dtype),)

    def update_stack(g, fields, count, leaf):
        (m,) = fields
        m32, direction = momentum_step(g, m.astype(jnp.float32), count, beta, "ema", nesterov,
                                        False)
        if period == 1:
            return full(direction, leaf), (m32.astype(m.dtype),)
        update = jax.lax.cond(count % period == 0, lambda d: full(d, leaf),
                              lambda d: block_lr_ratio * block(d, leaf), direction)
        return update, (m32.astype(m.dtype),)

    return scale_by_matrix_optimizer("scale_by_muon_bp", MuonState, init_stack, update_stack,
                                     source)


def muon_bp(learning_rate: optax.ScalarOrSchedule, *, period: int = 5,
            block_lr_ratio: float = 1.0, coefficients: str | CoefficientSet | tuple = "quintic",
            steps: int | None = None, beta: float = 0.95, nesterov: bool = True,
            momentum_dtype=None, scale: ScaleMode = "spectral", rms_factor: float | None = None,
            weight_decay: float = 0.0, weight_decay_method: WeightDecayMethod = "decoupled",
            matmul_dtype="float32", tp_mode: TPMode = "auto",
            syrk: bool | str = False, ns_method: NSMethod = "standard", plan: PlanLike = None,
            adamw: AdamW = AdamW()) -> optax.GradientTransformation:
    """MuonBP for hidden matrices, AdamW for every other leaf.

    Matrices get ``-lr * scale_by_muon_bp(...)`` with weight decay by
    ``weight_decay_method`` (``jmegatron.optim.matrix.descend``); the other leaves
    ``adamw``'s. Arguments as ``scale_by_muon_bp`` and ``muon``.

    Args:
      learning_rate: a number or an optax schedule of the step (the full steps'; block
        steps take ``block_lr_ratio`` times it); also AdamW's unless
        ``adamw.learning_rate`` is set.
      period: a full step every ``period`` steps.
      block_lr_ratio: the block steps' step size over the full steps'.
      coefficients: Newton-Schulz's coefficient set.
      steps: Newton-Schulz iterations; None: the set's default.
      beta: the momentum's decay.
      nesterov: orthogonalize the Nesterov look-ahead.
      momentum_dtype: the momentum's storage dtype; None: the param's.
      scale: the multiplier of each orthogonalized block (``update_scale``).
      rms_factor: a factor on ``scale``.
      weight_decay: the matrices' weight decay coefficient (0: none).
      weight_decay_method: "decoupled", "independent", "l2" or "palm".
      matmul_dtype: the dtype of Newton-Schulz's matmul operands.
      tp_mode: the full steps' tensor-parallel mode.
      syrk: the SYRK kernel for Newton-Schulz's symmetric products.
      ns_method: "standard", "gram" or "auto".
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules) to make one from each tree
        the transformation sees; None: ``PlanSpec()``, one device.
      adamw: the AdamW of the other leaves (``AdamW``).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "muon_bp") and the AdamW leaves.

    References:
      Khaled et al., "MuonBP: Faster Muon via Block-Periodic Orthogonalization",
        arXiv:2510.16981, 2025.
    """
    direction = scale_by_muon_bp(
        period=period, block_lr_ratio=block_lr_ratio, coefficients=coefficients, steps=steps,
        beta=beta, nesterov=nesterov, momentum_dtype=momentum_dtype, scale=scale,
        rms_factor=rms_factor, matmul_dtype=matmul_dtype, tp_mode=tp_mode,
        syrk=syrk, ns_method=ns_method, plan=plan)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method)
    return with_adamw("muon_bp", matrix, plan, learning_rate, adamw)
