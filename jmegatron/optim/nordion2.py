"""NorDion2: Dion2's sparse orthogonalized update with NorMuon's per-neuron normalization.

What the reference does (microsoft/dion, ``dion/nordion2.py``, also exported as
``Dion3`` by ``dion/__init__.py``, and the helpers it imports; read at commit
0a059a4), single device (no process group), and what this module does:

- **Defaults** (``NorDion2.__init__``, nordion2.py:67-86): lr 0.01, fraction
  0.25, mu 0.95, muon_beta2 0.95, weight_decay 0.01, epsilon 1e-8,
  adjust_lr "spectral_norm", use_polar_express True. ``betas`` are only for its
  AdamW/Lion groups. Here: ``fraction=0.25, ef_decay=0.95, muon_beta2=0.95,
  weight_decay=0.01, epsilon=1e-8, scale="unit_rms"``.
- **Momentum.** ``dion2_pre_orthogonalize`` (dion2.py:439; called at
  nordion2.py:350): ``M <- M + G`` (no decay factor; G cast to M's dtype, M
  zeros in the param's dtype). Here: the same sum in fp32, stored in
  ``momentum_dtype`` (default the param's).
- **Selection.** ``select_dim = -2`` always (nordion2.py:269): the rows of the
  torch weight [out, in], i.e. output neurons, whatever the shape (Dion2 picks
  the shorter side). Ranked by L1 norm over the row (``M.norm(p=1, dim=-1)``),
  top ``k = max(1, ceil(fraction * out))`` (``torch.topk``, unsorted;
  ``k_override`` only on the row-sharded path). Here: jmegatron's matrices are
  [fan_in, fan_out], so the reference's rows are our fan_out columns (slices
  along axis -1); the same L1 norms and ``selected_count``; ``jax.lax.top_k``
  breaks ties by the lower index.
- **Error feedback.** The selected rows are copied out, then scaled in M by
  ``ef_decay``, which NorDion2 passes as its ``mu`` (``momentum=mu``,
  nordion2.py:175, ``ef_decay=momentum`` at :354). Here: ``ef_decay`` (0.95).
- **Orthogonalization.** As Dion2 (the submatrix cast to bf16 for the
  megabatch, ``polar_express`` with ``epsilon``): here Dion2's ``orthogonalizer``
  (``coefficients="dion2"``, ``DION2_COEFFICIENTS``, ``matmul_dtype`` bf16 by
  default; see ``jmegatron.optim.dion2``).
- **Per-neuron normalization** (``nordion2_normalize_selected_stacked``,
  nordion2.py:430, calling ``normuon.py``'s ``_normuon_normalization_core``,
  normuon.py:374), on the orthogonalized [k, in] submatrix O only: the selected
  rows' second moments are gathered from V (one entry per output row, zeros in
  the param's dtype, nordion2.py:142) and upcast to fp32, O cast to fp32;
  ``n = ||O||_F``; ``v_sel <- lerp(v_sel, mean(O^2 over the row), 1 - muon_beta2)``;
  ``O' = O / (sqrt(v_sel) + 1e-8)`` (a fixed 1e-8, not ``epsilon``);
  ``O' *= n / max(||O'||_F, 1e-8)``; the new v_sel is scattered back into V
  (cast to V's dtype): unselected rows keep their V. Here: the same, in fp32,
  V stored per matrix block as [*stack, fan_out] in ``variance_dtype`` (default
  the param's, as the reference); ``NORM_EPS`` is the fixed 1e-8.
- **Scale.** ``adjust_lr="spectral_norm"`` (default): ``sqrt(out / in)`` of the
  whole param (``adjust_lr_spectral_norm``, megabatch_base.py); "rms_norm":
  ``0.2 sqrt(max(out, in))``; None: 1, applied after the normalization
  (nordion2.py:392-426). Here: Muon's ``update_scale`` (default
  ``scale="unit_rms"``, the same sqrt(fan_out / fan_in)); "spectral" is
  "rms_norm", "none" is None.
- **Weight decay and the step.** ``dion2_post_orthogonalize``: ``X *= 1 - lr *
  weight_decay`` on every entry with the base lr, then ``X[selected rows] +=
  -adjusted_lr * O'``. Here: ``descend`` with decoupled decay, ``-lr * (scale *
  O'_scattered + wd * X)``, X the weights before the step, the same.
- **Not followed.** The reference's row-sharded FSDP2 path (``selection_scope``
  "local"/"global", per-shard top-k) and its refusal of params sharded along
  dim -1 have no counterpart: here every matrix is orthogonalized whole on its
  owners (below). Fused QKV/SwiGLU leaves are split into blocks as Muon splits
  them, each selected, normalized and scaled on its own (the reference refuses
  ``split_sizes`` for NorDion2 and scales by the whole param).

Under a mesh: the skeleton (``scale_by_matrix_optimizer(..., whole_matrices=True)``)
runs each block's step as single-device code on whole matrices on the devices
holding its state (``matrix.on_owners``). Owner, layerwise and replicated layouts
move nothing in the optimizer step; under the ``fsdp`` layout (matrices split)
the whole matrices are gathered first, as Muon on fsdp (r s t per matrix), not
only the selection as ``dion2`` does: there is no sharded NorDion2 path.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from jmegatron.optim import checks
from jmegatron.optim.coefficients import CoefficientSet
from jmegatron.optim.dion2 import check_fraction, orthogonalizer, select_rows
from jmegatron.optim.matrix import (AdamW, PlanLike, PlanSource, WeightDecayMethod, descend,
                                    held_zeros, scale_by_matrix_optimizer, with_adamw)
from jmegatron.optim.muon import ScaleMode, update_scale
from jmegatron.optim.plan import BLOCKS, HELD, matrix_state
from jmegatron.optim.routing import from_matrices, to_matrices

NORM_EPS = 1e-8   # normuon.py's fixed epsilon (denominator) and clamp of the rescale


@matrix_state(momentum=HELD, variance=BLOCKS)
class NorDion2State(NamedTuple):
    """The state of ``scale_by_nordion2``.

    Attributes:
      count: the steps taken, an int32 scalar.
      momentum: the error-feedback momentum, a tree mirroring the params; each
        matrix leaf held as its owners hold it, in ``momentum_dtype``.
      variance: the per-neuron second moment; per matrix leaf a tuple, one array
        [*stack, fan_out] per matrix block, in ``variance_dtype``.
    """

    count: jax.Array
    momentum: optax.Updates
    variance: optax.Updates


def _frobenius(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))


def normalize_neurons(o: jax.Array, v: jax.Array, muon_beta2: float
                      ) -> tuple[jax.Array, jax.Array]:
    """NorMuon's per-neuron normalization of an orthogonalized stack [..., k, t] (fp32).

    Args:
      o: the orthogonalized selected rows (neurons), fp32.
      v: their second moments [..., k], fp32.
      muon_beta2: the second moment's EMA factor.

    Returns:
      (the normalized rows, rescaled to ``o``'s Frobenius norm; the new v).
    """
    v = v + (1.0 - muon_beta2) * (jnp.mean(jnp.square(o), axis=-1) - v)   # torch.lerp
    normed = o / (jnp.sqrt(v)[..., None] + NORM_EPS)
    normed = normed * (_frobenius(o) / jnp.maximum(_frobenius(normed), NORM_EPS))
    return normed, v


def nordion2_block(g: jax.Array, m: jax.Array, v: jax.Array, fraction: float,
                   ef_decay: float, muon_beta2: float,
                   orthogonalize: Callable[[jax.Array], jax.Array]
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One NorDion2 step of a block stack [..., fan_in, fan_out] (fp32).

    ``M <- M + G``; the ``selected_count(fraction, fan_out)`` columns (output
    neurons) with the largest L1 norms are orthogonalized as one [k, fan_in]
    submatrix per matrix, normalized per neuron (``normalize_neurons``, their
    second moments only) and scaled by ``ef_decay`` in the momentum.

    Args:
      g: the gradient stack, fp32.
      m: the momentum stack, fp32.
      v: the per-neuron second moments [..., fan_out], fp32.
      fraction: the fraction of neurons selected.
      ef_decay: the decay of the selected neurons of the momentum.
      muon_beta2: the second moment's EMA factor.
      orthogonalize: the orthogonalization of the submatrix stack.

    Returns:
      (the update: the normalized rows in place, zeros elsewhere, unscaled; the
      new momentum; the new second moments).
    """
    picked = select_rows(jnp.swapaxes(m + g, -1, -2), fraction, ef_decay)  # neurons as rows
    rows, v_sel = normalize_neurons(orthogonalize(picked.sub),
                                    jnp.take_along_axis(v, picked.idx, axis=-1), muon_beta2)
    v = jnp.put_along_axis(v, picked.idx, v_sel, axis=-1, inplace=False)
    return (jnp.swapaxes(picked.place(rows), -1, -2), jnp.swapaxes(picked.decayed, -1, -2), v)


def scale_by_nordion2(*, fraction: float = 0.25, ef_decay: float = 0.95,
                      muon_beta2: float = 0.95,
                      coefficients: str | CoefficientSet | tuple = "dion2",
                      steps: int | None = None, matmul_dtype="bfloat16", epsilon: float = 1e-8,
                      scale: ScaleMode = "unit_rms", rms_factor: float | None = None,
                      momentum_dtype=None, variance_dtype=None, plan: PlanLike = None
                      ) -> optax.GradientTransformation:
    """NorDion2's direction: Dion2 on output neurons, normalized per neuron.

    Per matrix block [fan_in, fan_out] (module docstring): ``M <- M + G``; the
    ``max(1, ceil(fraction * fan_out))`` output neurons (columns) with the largest
    L1 norms form a submatrix that is orthogonalized, divided per neuron by
    ``sqrt(v) + 1e-8`` (v their EMA of the mean square, updated only where
    selected), rescaled to its Frobenius norm and placed back (zeros elsewhere),
    times ``update_scale``; those neurons of M are multiplied by ``ef_decay``.
    Fused QKV/SwiGLU leaves are split into blocks as ``scale_by_muon`` splits
    them; stacks [L, ...] select per matrix. Each block's step runs on whole
    matrices on their owners (under fsdp they are gathered). Arguments are
    checked here (one-line ValueError), leaves and ``plan`` at init.

    Args:
      fraction: alpha, the fraction of output neurons orthogonalized, in (0, 1]
        (a Python number: it fixes the submatrix's shape).
      ef_decay: the error-feedback decay of the selected neurons of the momentum
        (the reference's ``mu``), in [0, 1).
      muon_beta2: the per-neuron second moment's EMA factor, in [0, 1).
      coefficients: "dion2": the reference's Polar Express; else a coefficient
        set for Muon's ``newton_schulz`` (see ``scale_by_dion2``).
      steps: the iterations; None: the set's default (5 for "dion2").
      matmul_dtype: the dtype of the orthogonalization's matmul operands
        (accumulation fp32): "bfloat16" as the reference, or "float32".
      epsilon: added to the scaled norm in the "dion2" orthogonalization (the
        normalization's epsilon is the reference's fixed ``NORM_EPS``).
      scale: the multiplier of each block's update (``update_scale``): "unit_rms"
        (the reference's "spectral_norm"), "spectral" (its "rms_norm"), "shape"
        or "none".
      rms_factor: a factor on ``scale``; None: ``update_scale``'s default.
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      variance_dtype: the dtype the second moment is stored in; None: the
        param's (as the reference).
      plan: where the matrices live: a ``ShardingPlan`` (``make_plan``), or a
        ``PlanSpec`` (routing, mesh, layout, rules); None: ``PlanSpec()``, one
        device.

    Returns:
      An ``optax.GradientTransformation`` (state ``NorDion2State``) whose updates
      are the scaled sparse normalized directions, before the learning rate and sign.

    References:
      Ahn, Amsel & Langford, "Dion2: A Simple Method to Shrink Matrix in Muon",
        arXiv:2512.16928, 2025.
      Li et al., "NorMuon: Making Muon more efficient and scalable",
        arXiv:2510.05491, 2025.
      microsoft/dion, ``dion/nordion2.py`` and ``dion/normuon.py``.
    """
    check_fraction(fraction)
    checks.fraction("ef_decay", ef_decay)
    checks.fraction("muon_beta2", muon_beta2)
    checks.one_of("scale", scale, get_args(ScaleMode))
    checks.positive("rms_factor", rms_factor, optional=True)
    checks.float_dtype("momentum_dtype", momentum_dtype, optional=True)
    checks.float_dtype("variance_dtype", variance_dtype, optional=True)
    orthogonalize = orthogonalizer(coefficients, steps, matmul_dtype, epsilon)
    source = PlanSource.of(plan)

    def init_stack(x, leaf):
        momentum = held_zeros(x, leaf, momentum_dtype or x.dtype)
        dtype = variance_dtype or x.dtype
        return momentum, tuple(jnp.zeros((*b.shape[:-2], b.shape[-1]), dtype)
                               for b in to_matrices(momentum, leaf.route.spec))

    def update_stack(g, fields, count, leaf):
        m, variance = fields
        spec = leaf.route.spec
        done = []
        for gb, mb, vb in zip(to_matrices(g, spec), to_matrices(m.astype(jnp.float32), spec),
                              variance):
            update, mb, new = nordion2_block(gb, mb, vb.astype(jnp.float32), fraction,
                                             ef_decay, muon_beta2, orthogonalize)
            scaled = update * update_scale(scale, *gb.shape[-2:], rms_factor)
            done.append((scaled, mb, new.astype(vb.dtype)))
        update = from_matrices([u for u, _, _ in done], spec, g.shape)
        m = from_matrices([n for _, n, _ in done], spec, m.shape).astype(m.dtype)
        return update, (m, tuple(v for _, _, v in done))

    return scale_by_matrix_optimizer("scale_by_nordion2", NorDion2State, init_stack,
                                     update_stack, source, whole_matrices=True)


def nordion2(learning_rate: optax.ScalarOrSchedule, *, fraction: float = 0.25,
             ef_decay: float = 0.95, muon_beta2: float = 0.95,
             coefficients: str | CoefficientSet | tuple = "dion2",
             steps: int | None = None, matmul_dtype="bfloat16", epsilon: float = 1e-8,
             scale: ScaleMode = "unit_rms", rms_factor: float | None = None,
             weight_decay: float = 0.01, weight_decay_method: WeightDecayMethod = "decoupled",
             momentum_dtype=None, variance_dtype=None, plan: PlanLike = None,
             adamw: AdamW = AdamW()) -> optax.GradientTransformation:
    """NorDion2 for hidden matrices, AdamW for every other leaf.

    Matrices get ``-lr * (scale * O + weight_decay * W)`` by default (decoupled
    decay on every entry with the base learning rate, as the reference's
    ``dion2_post_orthogonalize``; other methods: ``descend``), O the sparse
    normalized update of ``scale_by_nordion2``; the other leaves get ``adamw``'s.
    Defaults are the reference's (fraction 0.25, mu 0.95, muon_beta2 0.95, its
    Polar Express in bf16, spectral-norm lr adjustment, weight decay 0.01).

    Args:
      learning_rate: a number or an optax schedule of the step; also AdamW's
        unless ``adamw.learning_rate`` is set.
      fraction: alpha, the fraction of output neurons orthogonalized, in (0, 1].
      ef_decay: the error-feedback decay of the selected neurons (the
        reference's ``mu``), in [0, 1).
      muon_beta2: the per-neuron second moment's EMA factor, in [0, 1).
      coefficients: "dion2" (the reference's Polar Express) or a coefficient set
        for Muon's ``newton_schulz``.
      steps: the iterations; None: the set's default.
      matmul_dtype: the dtype of the orthogonalization's matmul operands.
      epsilon: added to the scaled norm in the "dion2" orthogonalization.
      scale: the multiplier of each block's update (``update_scale``); default
        "unit_rms", the reference's "spectral_norm".
      rms_factor: a factor on ``scale``; None: ``update_scale``'s default.
      weight_decay: the matrices' weight decay coefficient (0: none); the other
        leaves take ``adamw.weight_decay``.
      weight_decay_method: "decoupled", "independent", "l2" or "palm" (see
        ``descend``).
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      variance_dtype: the dtype the second moment is stored in; None: the param's.
      plan: where the matrices live: a ``ShardingPlan`` or a ``PlanSpec``; None:
        ``PlanSpec()``, one device.
      adamw: the AdamW of the other leaves (``AdamW``).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "nordion2") and the AdamW leaves.

    References:
      Ahn, Amsel & Langford, "Dion2: A Simple Method to Shrink Matrix in Muon",
        arXiv:2512.16928, 2025.
      Li et al., "NorMuon: Making Muon more efficient and scalable",
        arXiv:2510.05491, 2025.
      microsoft/dion, ``dion/nordion2.py``.
    """
    direction = scale_by_nordion2(
        fraction=fraction, ef_decay=ef_decay, muon_beta2=muon_beta2, coefficients=coefficients,
        steps=steps, matmul_dtype=matmul_dtype, epsilon=epsilon, scale=scale,
        rms_factor=rms_factor, momentum_dtype=momentum_dtype, variance_dtype=variance_dtype,
        plan=plan)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method)
    return with_adamw("nordion2", matrix, plan, learning_rate, adamw)
