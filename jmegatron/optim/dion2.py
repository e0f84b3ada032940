"""Dion2: orthogonalize only an alpha-fraction of the momentum's rows or columns.

What the reference does (microsoft/dion, ``dion/dion2.py`` and the helpers it
imports; read at commit 0a059a4), single device (no process group), and what
this module does:

- **Momentum.** ``dion2_pre_orthogonalize``: ``M <- M + G`` (no decay factor;
  ``G`` cast to M's dtype, M zeros in the param's dtype). The ``betas`` of
  ``Dion2`` are only for its AdamW/Lion parameter groups. Here: the same sum, in
  fp32, stored in ``momentum_dtype`` (default the param's).
- **Selection.** ``dion2_update_megabatch_async`` picks ``select_dim`` from the
  shape of the torch weight [out, in]: rows (dim -2) if ``num_rows <= num_cols``
  else columns, i.e. the slices along the shorter side, output neurons on ties
  (a sharded matrix instead selects along its shard dim). ``dion2_pre_orthogonalize``
  ranks the slices by their L1 norm (``M.norm(p=1)`` over the other dim) and
  keeps the top ``k = max(1, ceil(fraction * size))`` (``torch.topk``, unsorted);
  a 3-D param is a batch of matrices (``flatten=False``), each selecting its own.
  Here: jmegatron's matrices are [fan_in, fan_out] (``to_matrices``), so the
  reference's rows are our columns: the slices along fan_out (axis -1) when
  ``fan_out <= fan_in``, else along fan_in (axis -2); the same L1 norms and k
  (the same float expression). ``jax.lax.top_k`` breaks ties by the lower index,
  torch's order is unspecified.
- **Error feedback.** ``dion2_pre_orthogonalize`` copies the selected slices out
  for orthogonalization, then scales those slices of M in place by ``ef_decay``
  (default 0.95); the other slices keep accumulating undecayed. Here: the same.
- **Orthogonalization.** The default ``newton_schulz_func`` of
  ``DistributedOrthoBase`` (``dion/megabatch_base.py``, ``use_polar_express=True``)
  is ``polar_express`` (``dion/polar_express.py``): the submatrix in bf16 (the
  selection is cast to bf16 for communication), ``X / (1.02 ||X||_F + epsilon)``
  with Dion2's ``epsilon`` (1e-8), then five iterations with
  ``_POLAR_EXPRESS_COEFFS`` (Amsel et al., safety factor 1.02 folded into all but
  the last), ``A = X X^T, X <- a X + (b A + c A A) X`` on the short side (a tall
  matrix through ``X^T X`` and right products), every operation in bf16.
  Here, by default (``coefficients="dion2"``): those five tuples
  (``DION2_COEFFICIENTS``) and that normalization, computed in fp32 before any
  cast (the project's rule), with ``matmul_dtype`` bf16: bf16 operands, fp32
  accumulation, X kept in fp32 between iterations (the reference rounds X to bf16
  after every operation, so the two agree to bf16 round-off, not bitwise). Any
  other ``coefficients`` (a set's name, tuples, a ``CoefficientSet``) runs
  Muon's ``newton_schulz`` with that set, its ``steps`` and its own unit-Frobenius
  normalization; ``matmul_dtype="float32"`` makes either exact to fp32.
- **Scale.** ``adjust_lr="spectral_norm"`` (default), ``adjust_lr_spectral_norm``
  in ``dion/megabatch_base.py``: the update is multiplied by
  ``sqrt(fan_out / fan_in)`` of the whole param (``shape[-2:]`` of [out, in]);
  "rms_norm": ``0.2 sqrt(max(fan_out, fan_in))``; None: 1. Here: Muon's
  ``update_scale``, default ``scale="unit_rms"`` (the same sqrt(fan_out / fan_in));
  "spectral" with the default ``rms_factor`` is "rms_norm", "none" is None.
- **Weight decay and the step.** ``dion2_post_orthogonalize``: first
  ``X *= 1 - lr * weight_decay`` on every entry (the base lr, not the adjusted
  one; default weight_decay 0.01), then ``X[selected] += -adjusted_lr * O``
  (``scatter_add_``); unselected slices get only the decay. ``dion2`` is
  ``descend`` with decoupled decay: ``-lr * (scale * O_scattered + wd * X)``,
  X the weights before the step, the same.

Beyond the reference: fused QKV/SwiGLU leaves are split into blocks as Muon
splits them, each selected, orthogonalized and scaled on its own (the
reference refuses ``split_sizes`` for Dion2 and scales by the whole param).
Under a mesh each block runs in ``jax.shard_map`` on the devices that hold its
state (``matrix.on_owners``, as MOP): selection is always on whole matrices,
the reference's ``selection_scope="global"``; its default "local" takes a
per-shard top-k along the FSDP2 shard dim, which depends on the sharding.

NorDion2 (``dion/nordion2.py``, also exported as ``Dion3``) is not built here.
It always selects rows of [out, in] (output neurons, our fan_out columns),
even when sharded; its ``ef_decay`` is its ``mu`` (0.95); after orthogonalizing
it applies NorMuon's per-neuron normalization to the selected rows only
(``nordion2_normalize_selected_stacked``): a per-row second moment
``v <- lerp(v, mean(O^2 over the row), 1 - muon_beta2)`` (stored for every
row, updated only where selected), ``O / (sqrt(v) + 1e-8)`` rescaled to O's
Frobenius norm, then the same scale, weight decay and scatter. It needs a
second state field shaped [..., fan_out] and its own reference test: a
follow-up, not a few lines.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from jmegatron.optim import checks
from jmegatron.optim.coefficients import CoefficientSet, coefficient_set
from jmegatron.optim.matrix import (AdamW, PlanSource, WeightDecayMethod, descend, held_zeros,
                                    on_owners, scale_by_matrix_optimizer, with_adamw)
from jmegatron.optim.muon import ScaleMode, update_scale
from jmegatron.optim.newton_schulz import newton_schulz, ns_flops, ns_step
from jmegatron.optim.plan import HELD, ShardingPlan, matrix_state
from jmegatron.optim.routing import Routing, from_matrices, matrix_pieces, to_matrices
from jmegatron.sharding.layouts import Layout
from jmegatron.sharding.rules import DEFAULT_RULES, Rules

# dion/polar_express.py's _POLAR_EXPRESS_COEFFS: Polar Express for 5 iterations,
# safety factor 2e-2 (1.02 folded into all but the last), cushion 2.
DION2_COEFFICIENTS = CoefficientSet("dion2", (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
))
SAFETY = 1.02   # the reference divides by 1.02 ||X||_F before the first iteration


@matrix_state(momentum=HELD)
class Dion2State(NamedTuple):
    """The state of ``scale_by_dion2``.

    Attributes:
      count: the steps taken, an int32 scalar.
      momentum: the error-feedback momentum, a tree mirroring the params; each
        matrix leaf held as its owners hold it, in ``momentum_dtype``.
    """

    count: jax.Array              # int32 scalar
    momentum: optax.Updates       # mirrors the params, each held as its owners hold it


def selection_axis(fan_in: int, fan_out: int) -> int:
    """The axis of a [fan_in, fan_out] matrix whose slices Dion2 selects.

    The shorter side's; fan_out (the reference's rows of its [out, in] weight)
    when square.

    Args:
      fan_in: the matrix's rows (input dim).
      fan_out: its columns (output dim).

    Returns:
      -1 (select columns, i.e. output neurons) or -2 (select rows).
    """
    return -1 if fan_out <= fan_in else -2


def selected_count(fraction: float, size: int) -> int:
    """How many of ``size`` slices Dion2 orthogonalizes: ``max(1, ceil(fraction * size))``.

    Args:
      fraction: the fraction alpha in (0, 1].
      size: the number of slices along the selection axis.

    Returns:
      k, an int in [1, size].
    """
    return min(size, max(1, int(math.ceil(fraction * size))))


def reference_polar_express(x: jax.Array, *, steps: int | None = None, matmul_dtype="bfloat16",
                            epsilon: float = 1e-8) -> jax.Array:
    """The reference's orthogonalization of a stack [..., m, n] (fp32 result).

    ``X / (1.02 ||X||_F + epsilon)`` in fp32, then ``DION2_COEFFICIENTS``'
    iterations ``X <- a X + (b A + c A A) X``, ``A = X X^T`` on the short side
    (tall inputs transposed), matmul operands in ``matmul_dtype`` with fp32
    accumulation. A zero matrix gives zero.

    Args:
      x: a matrix or a stack of matrices [..., m, n].
      steps: iterations; None: 5 (the reference's), more repeat the last tuple.
      matmul_dtype: the dtype of the matmul operands (accumulation is fp32).
      epsilon: added to the scaled Frobenius norm (the reference's Dion2 1e-8).

    Returns:
      The orthogonalized x, fp32, of x's shape.

    References:
      Amsel et al., "The Polar Express: Optimal Matrix Sign Methods and Their
        Application to the Muon Algorithm", arXiv:2505.16932, 2025.
      microsoft/dion, ``dion/polar_express.py``.
    """
    schedule = DION2_COEFFICIENTS.schedule(DION2_COEFFICIENTS.default_steps
                                           if steps is None else steps)
    tall = x.shape[-2] > x.shape[-1]
    x = jnp.swapaxes(x, -1, -2) if tall else x
    x = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    x = x / (SAFETY * norm + epsilon)
    for coeffs in schedule:
        x = ns_step(x, coeffs, jnp.dtype(matmul_dtype))
    return jnp.swapaxes(x, -1, -2) if tall else x


def orthogonalizer(coefficients, steps: int | None, matmul_dtype, epsilon: float
                   ) -> Callable[[jax.Array], jax.Array]:
    """``f(submatrix stack) -> orthogonalized`` for ``scale_by_dion2``'s options.

    Args:
      coefficients: "dion2" (``reference_polar_express``) or anything
        ``coefficient_set`` takes (Muon's ``newton_schulz``).
      steps: iterations; None: the set's default.
      matmul_dtype: the dtype of the matmul operands.
      epsilon: the reference normalization's epsilon ("dion2" only).

    Returns:
      The function, fp32 results.
    """
    checks.integer("steps", steps, 1, optional=True)
    checks.float_dtype("matmul_dtype", matmul_dtype)
    checks.positive("epsilon", epsilon)
    dtype = jnp.dtype(matmul_dtype)
    if isinstance(coefficients, str) and coefficients == "dion2":
        return lambda x: reference_polar_express(x, steps=steps, matmul_dtype=dtype,
                                                 epsilon=epsilon)
    try:   # an unknown name or bad tuples, refused here
        coefficient_set(coefficients)
    except ValueError as err:
        raise ValueError(f"coefficients: {err}, or 'dion2' (the reference's Polar "
                         "Express)") from None
    return lambda x: newton_schulz(x, steps=steps, coefficients=coefficients, matmul_dtype=dtype)


def dion2_block(g: jax.Array, m: jax.Array, fraction: float, ef_decay: float,
                orthogonalize: Callable[[jax.Array], jax.Array]
                ) -> tuple[jax.Array, jax.Array]:
    """One Dion2 step of a block stack [..., fan_in, fan_out] (fp32).

    ``M <- M + G``; the ``selected_count`` slices along ``selection_axis`` with
    the largest L1 norms are orthogonalized (as one submatrix per matrix) and
    scaled by ``ef_decay`` in the momentum.

    Args:
      g: the gradient stack, fp32.
      m: the momentum stack, fp32.
      fraction: the fraction of slices selected.
      ef_decay: the decay of the selected slices of the momentum.
      orthogonalize: the orthogonalization of the submatrix stack.

    Returns:
      (the update: the orthogonalized slices in place, zeros elsewhere, unscaled;
      the new momentum).
    """
    axis = selection_axis(*g.shape[-2:])
    rows = lambda a: a if axis == -2 else jnp.swapaxes(a, -1, -2)   # selected slices as rows
    m = rows(m + g)                                                  # [..., s, t]
    k = selected_count(fraction, m.shape[-2])
    _, idx = jax.lax.top_k(jnp.sum(jnp.abs(m), axis=-1), k)          # [..., k]
    where = jnp.broadcast_to(idx[..., None], (*idx.shape, m.shape[-1]))
    sub = jnp.take_along_axis(m, where, axis=-2)                     # [..., k, t]
    chosen = jnp.any(idx[..., :, None] == jnp.arange(m.shape[-2]), axis=-2)[..., None]
    decayed = jnp.where(chosen, ef_decay * m, m)
    update = jnp.put_along_axis(jnp.zeros_like(m), where, orthogonalize(sub), axis=-2,
                                inplace=False)
    return rows(update), rows(decayed)


def check_fraction(fraction) -> None:
    """``fraction`` must be a number in (0, 1] (it fixes a shape: never traced)."""
    checks.share("fraction", fraction)


def scale_by_dion2(*, fraction: float = 0.25, ef_decay: float = 0.95,
                   coefficients: str | CoefficientSet | tuple = "dion2",
                   steps: int | None = None, matmul_dtype="bfloat16", epsilon: float = 1e-8,
                   scale: ScaleMode = "unit_rms", rms_factor: float | None = None,
                   momentum_dtype=None, routing: Routing = Routing(),
                   mesh: jax.sharding.Mesh | None = None, layout: Layout | str | None = None,
                   rules: Rules = DEFAULT_RULES, plan: ShardingPlan | None = None
                   ) -> optax.GradientTransformation:
    """Dion2's direction: sum momentum, a fraction of its slices orthogonalized.

    Per matrix block [fan_in, fan_out] (module docstring): ``M <- M + G``; the
    ``max(1, ceil(fraction * s))`` slices along the shorter side (s of them;
    fan_out when square) with the largest L1 norms form a submatrix that is
    orthogonalized and placed back (zeros elsewhere), times ``update_scale``;
    those slices of M are multiplied by ``ef_decay``. Fused QKV/SwiGLU leaves are
    split into blocks as ``scale_by_muon`` splits them; stacks [L, ...] select
    per matrix. ``dion2`` combines this with weight decay and AdamW.

    With a ``mesh``, each block's step runs in ``jax.shard_map`` on the devices
    holding its state (``layout``, ``plan`` as for ``scale_by_muon``): the owner
    layout's step needs no collective; elsewhere whole matrices are gathered
    (duplicated work). Arguments are checked here (one-line ValueError), leaves
    and ``plan`` at init. A non-finite gradient enters the momentum for good.

    Args:
      fraction: alpha, the fraction of slices orthogonalized, in (0, 1]
        (a Python number: it fixes the submatrix's shape).
      ef_decay: the error-feedback decay of the selected slices of the momentum,
        in [0, 1).
      coefficients: "dion2": the reference's Polar Express (``DION2_COEFFICIENTS``,
        ``X / (1.02 ||X||_F + epsilon)``); else a coefficient set's name, tuples or
        a ``CoefficientSet`` run by Muon's ``newton_schulz``.
      steps: the iterations; None: the set's default (5 for "dion2").
      matmul_dtype: the dtype of the orthogonalization's matmul operands
        (accumulation fp32): "bfloat16" as the reference, or "float32".
      epsilon: added to the scaled norm in the "dion2" normalization.
      scale: the multiplier of each block's update (``update_scale``): "unit_rms"
        (``sqrt(fan_out / fan_in)``, the reference's "spectral_norm"), "spectral"
        (its "rms_norm"), "shape" or "none".
      rms_factor: a factor on ``scale``; None: ``update_scale``'s default.
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      routing: which leaves are matrices and how each splits into blocks
        (``Routing``); every leaf this transformation sees must be a matrix.
      mesh: the device mesh; None: no ``shard_map``.
      layout: a ``Layout`` or its name; None: "fsdp" (with a mesh).
      rules: the logical-to-mesh axis rules a layout given by name (or None) is
        built on.
      plan: a ``ShardingPlan`` replacing ``routing``, ``mesh``, ``layout`` and
        ``rules`` (see ``scale_by_muon``).

    Returns:
      An ``optax.GradientTransformation`` (state ``Dion2State``) whose updates are
      the scaled sparse orthogonalized directions, before the learning rate and sign.

    References:
      Ahn, Amsel & Langford, "Dion2: A Simple Method to Shrink Matrix in Muon",
        arXiv:2512.16928, 2025.
      Amsel et al., "The Polar Express", arXiv:2505.16932, 2025.
      microsoft/dion, ``dion/dion2.py``.
    """
    check_fraction(fraction)
    checks.fraction("ef_decay", ef_decay)
    checks.one_of("scale", scale, get_args(ScaleMode))
    checks.positive("rms_factor", rms_factor, optional=True)
    checks.float_dtype("momentum_dtype", momentum_dtype, optional=True)
    orthogonalize = orthogonalizer(coefficients, steps, matmul_dtype, epsilon)
    source = PlanSource(plan, routing, mesh, layout, rules)
    mesh = source.placed_on

    def block_step(pair):
        g, m = pair
        update, m = dion2_block(g, m, fraction, ef_decay, orthogonalize)
        return update * update_scale(scale, *g.shape[-2:], rms_factor), m

    def init_stack(x, leaf):
        return (held_zeros(x, leaf, momentum_dtype or x.dtype),)

    def update_stack(g, fields, count, leaf):
        (m,) = fields
        spec = leaf.route.spec
        pairs = zip(to_matrices(g, spec), to_matrices(m.astype(jnp.float32), spec))
        done = [on_owners(block_step, pair, leaf.placement, mesh) for pair in pairs]
        update = from_matrices([u for u, _ in done], spec, g.shape)
        return update, (from_matrices([n for _, n in done], spec, m.shape).astype(m.dtype),)

    return scale_by_matrix_optimizer("scale_by_dion2", Dion2State, init_stack, update_stack,
                                     source)


def dion2(learning_rate: optax.ScalarOrSchedule, *, fraction: float = 0.25,
          ef_decay: float = 0.95, coefficients: str | CoefficientSet | tuple = "dion2",
          steps: int | None = None, matmul_dtype="bfloat16", epsilon: float = 1e-8,
          scale: ScaleMode = "unit_rms", rms_factor: float | None = None,
          weight_decay: float = 0.01, weight_decay_method: WeightDecayMethod = "decoupled",
          momentum_dtype=None, routing: Routing = Routing(),
          mesh: jax.sharding.Mesh | None = None, layout: Layout | str | None = None,
          rules: Rules = DEFAULT_RULES, plan: ShardingPlan | None = None,
          adamw: AdamW = AdamW()) -> optax.GradientTransformation:
    """Dion2 for hidden matrices, AdamW for every other leaf.

    Matrices get ``-lr * (scale * O + weight_decay * W)`` by default (decoupled
    decay on every entry, with the base learning rate, as the reference's
    ``dion2_post_orthogonalize``; other methods: ``descend``), O the sparse
    orthogonalized update of ``scale_by_dion2``; the other leaves get ``adamw``'s.
    Defaults are the reference's (fraction 0.25, ef_decay 0.95, its Polar Express
    in bf16, spectral-norm lr adjustment, weight decay 0.01).

    Args:
      learning_rate: a number or an optax schedule of the step; also AdamW's
        unless ``adamw.learning_rate`` is set.
      fraction: alpha, the fraction of slices orthogonalized, in (0, 1].
      ef_decay: the error-feedback decay of the selected slices, in [0, 1).
      coefficients: "dion2" (the reference's Polar Express) or a coefficient set
        for Muon's ``newton_schulz`` (see ``scale_by_dion2``).
      steps: the iterations; None: the set's default.
      matmul_dtype: the dtype of the orthogonalization's matmul operands.
      epsilon: added to the scaled norm in the "dion2" normalization.
      scale: the multiplier of each block's update (``update_scale``); default
        "unit_rms", the reference's "spectral_norm".
      rms_factor: a factor on ``scale``; None: ``update_scale``'s default.
      weight_decay: the matrices' weight decay coefficient (0: none); the other
        leaves take ``adamw.weight_decay``.
      weight_decay_method: "decoupled", "independent", "l2" or "palm" (see
        ``descend``).
      momentum_dtype: the dtype the momentum is stored in; None: the param's.
      routing: which leaves are matrices and how each splits into blocks.
      mesh: the device mesh; None: no ``shard_map``.
      layout: a ``Layout`` or its name; None: "fsdp" (with a mesh).
      rules: the logical-to-mesh axis rules a layout given by name (or None) is
        built on.
      plan: a ``ShardingPlan`` replacing ``routing``, ``mesh``, ``layout`` and
        ``rules``.
      adamw: the AdamW of the other leaves (``AdamW``).

    Returns:
      An ``optax.GradientTransformation``: an ``optax.partition`` of the matrices
      (label "dion2") and the AdamW leaves.

    References:
      Ahn, Amsel & Langford, "Dion2: A Simple Method to Shrink Matrix in Muon",
        arXiv:2512.16928, 2025.
      microsoft/dion, ``dion/dion2.py``.
    """
    direction = scale_by_dion2(
        fraction=fraction, ef_decay=ef_decay, coefficients=coefficients, steps=steps,
        matmul_dtype=matmul_dtype, epsilon=epsilon, scale=scale, rms_factor=rms_factor,
        momentum_dtype=momentum_dtype, routing=routing, mesh=mesh, layout=layout, rules=rules,
        plan=plan)
    matrix = descend(direction, learning_rate, weight_decay, weight_decay_method)
    return with_adamw("dion2", matrix, PlanSource(plan, routing, mesh, layout, rules),
                      learning_rate, adamw)


def dion2_flops(params, routing: Routing = Routing(), fraction: float = 0.25,
                coefficients: str | CoefficientSet | tuple = "dion2",
                steps: int | None = None) -> int:
    """Orthogonalization FLOPs of one Dion2 step on ``params``.

    Per matrix block, the submatrix of its ``selected_count`` slices along
    ``selection_axis`` through ``ns_flops`` (the reference's Polar Express and
    Muon's Newton-Schulz iterate the same products); the selection's norms and
    top-k are not matmuls.

    Args:
      params: the params tree (real or abstract arrays, or an nnx.State; only the
        shapes and logical axes are read).
      routing: which leaves are matrices, as for ``dion2``.
      fraction: alpha, the fraction of slices selected.
      coefficients: "dion2" or a coefficient set (only its default step count is
        read).
      steps: the iterations; None: the set's default (5 for "dion2").

    Returns:
      The FLOPs, an int.
    """
    cset = DION2_COEFFICIENTS if coefficients == "dion2" else coefficient_set(coefficients)
    n = cset.default_steps if steps is None else steps
    total = 0
    for p in matrix_pieces(params, routing):
        rows, cols = ((p.fan_in, selected_count(fraction, p.fan_out))
                      if selection_axis(p.fan_in, p.fan_out) == -1
                      else (selected_count(fraction, p.fan_in), p.fan_out))
        total += p.count * ns_flops(rows, cols, n)
    return total
