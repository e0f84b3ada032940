"""The matrix optimizers a run can train with, one entry each.

An entry names the option groups of ``TrainConfig`` the optimizer reads (the
resume contract keeps them; ``--muon.*``, ``--soap.*`` ...), builds its
transformation from the run's config, and counts its matmul FLOPs per step.
The CLI's ``--optim`` choices, ``TrainConfig.optimizer_groups``,
``MATRIX_OPTIMIZERS`` and the FLOP accounting all read this table, so a new
optimizer is its module under ``jmegatron.optim`` plus one entry here; a name
with no entry is refused when the command line is parsed.

Builders and FLOP counts take the run's ``TrainConfig`` (read by field, so this
module needs nothing of ``jmegatron.train.config``, which imports it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import optax

from jmegatron.optim import (DION2_COEFFICIENTS, Routing, adaptive_muon, coefficient_set, dion2,
                             mop, muon, muon_bp, ns_flops, rekls, soap)
from jmegatron.optim.dion2 import selected_count, selection_axis
from jmegatron.optim.mop import mop_matrix_flops
from jmegatron.optim.newton_schulz import syrk_backend
from jmegatron.optim.nordion2 import nordion2
from jmegatron.optim.rekls import rekls_matrix_flops
from jmegatron.optim.routing import MatrixFlops, flops_over_matrices
from jmegatron.optim.soap import soap_matrix_flops

# (cfg, schedule, common) -> the transformation: ``common`` holds what every matrix
# optimizer takes (weight decay and its method, the plan, the AdamW of the other leaves).
Build = Callable[..., optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One ``--optim``: its option groups, its transformation, its FLOPs per matrix.

    ``matrix_flops(cfg)`` gives ``(fan_in, fan_out) -> FLOPs`` of one block's step:
    summed over the blocks it is the run's FLOP count (``flops``), and it is the
    cost by which the balanced assignment spreads whole matrices over their owners
    (``make_plan(cost=...)``).
    """

    groups: tuple[str, ...]
    build: Build
    matrix_flops: Callable[..., MatrixFlops]
    newton_schulz: bool = False   # runs Muon's Newton-Schulz (its tensor-parallel modes)
    # (cfg) -> P: one step in P takes the true branch of the step's conditionals (MuonBP's
    # full step), the others the false one; benchmarks average bytes and time over P steps.
    period: Callable[..., int] = lambda cfg: 1

    def flops(self, cfg, params, routing: Routing) -> int:
        """Matmul FLOPs of one step on the matrices of ``params``, each counted whole."""
        return flops_over_matrices(params, routing, self.matrix_flops(cfg))


def _newton_schulz(cfg) -> dict:
    """Muon's Newton-Schulz options, as muon() and adaptive_muon() take them."""
    m = cfg.muon
    return dict(coefficients=m.ns_coefficients, steps=m.ns_steps, scale=m.scale,
                rms_factor=m.rms_factor, matmul_dtype=jnp.dtype(m.ns_dtype),
                tp_mode=m.tp_mode, syrk=m.syrk, ns_method=m.ns_method)


def _ns_flops(cfg) -> MatrixFlops:
    m = cfg.muon
    steps = coefficient_set(m.ns_coefficients).default_steps if m.ns_steps is None else m.ns_steps
    # SYRK's tile count only where the kernel runs (auto: jnp products on CPU).
    kernel = m.syrk and syrk_backend(True) != "jnp"
    return lambda fan_in, fan_out: ns_flops(fan_in, fan_out, steps, kernel, m.ns_method)


def _selected_flops(d, axis: int | None = None) -> MatrixFlops:
    """The orthogonalization of the selected submatrix: slices along ``axis``, or along
    Dion2's shorter side (``selection_axis``) where None."""
    cset = DION2_COEFFICIENTS if d.coefficients == "dion2" else coefficient_set(d.coefficients)

    def per_matrix(fan_in, fan_out):
        if (axis or selection_axis(fan_in, fan_out)) == -1:
            return ns_flops(fan_in, selected_count(d.fraction, fan_out), cset.default_steps)
        return ns_flops(selected_count(d.fraction, fan_in), fan_out, cset.default_steps)
    return per_matrix


def _muon(cfg, schedule, common) -> optax.GradientTransformation:
    return muon(schedule, beta=cfg.muon.momentum, **_newton_schulz(cfg), **common)


def _adaptive_muon(cfg, schedule, common) -> optax.GradientTransformation:
    a = cfg.adaptive_muon
    return adaptive_muon(schedule, second_moment=a.second_moment, beta2=a.beta2, eps=a.eps,
                         beta=cfg.muon.momentum, nesterov=a.nesterov, **_newton_schulz(cfg),
                         **common)


def _nordion2(cfg, schedule, common) -> optax.GradientTransformation:
    d = cfg.dion2
    return nordion2(schedule, fraction=d.fraction, ef_decay=d.ef_decay,
                    muon_beta2=cfg.nordion2.beta2, coefficients=d.coefficients,
                    matmul_dtype=jnp.dtype(d.ns_dtype), scale=d.scale, **common)


def _muon_bp(cfg, schedule, common) -> optax.GradientTransformation:
    b = cfg.muon_bp
    return muon_bp(schedule, period=b.period, block_lr_ratio=b.block_lr_ratio,
                   beta=cfg.muon.momentum, **_newton_schulz(cfg), **common)


def _mop(cfg, schedule, common) -> optax.GradientTransformation:
    p = cfg.mop
    return mop(schedule, beta=p.momentum, nesterov=p.nesterov, scale=p.scale,
               rms_factor=p.rms_factor, **common)


def _soap(cfg, schedule, common) -> optax.GradientTransformation:
    s = cfg.soap
    return soap(schedule, b1=s.b1, b2=s.b2, shampoo_beta=s.shampoo_beta, eps=s.eps,
                precondition_frequency=s.precondition_frequency,
                max_precond_dim=s.max_precond_dim, **common)


def _rekls(cfg, schedule, common) -> optax.GradientTransformation:
    r = cfg.rekls
    return rekls(schedule, b1=r.b1, b2=r.b2, shampoo_beta=r.shampoo_beta, eps=r.eps,
                 max_precond_dim=r.max_precond_dim, **common)


def _dion2(cfg, schedule, common) -> optax.GradientTransformation:
    d = cfg.dion2
    return dion2(schedule, fraction=d.fraction, ef_decay=d.ef_decay, coefficients=d.coefficients,
                 matmul_dtype=jnp.dtype(d.ns_dtype), scale=d.scale, selection=d.selection,
                 **common)


OPTIMIZERS: dict[str, Entry] = {
    "muon": Entry(("muon",), _muon, _ns_flops, newton_schulz=True),
    # Full steps' FLOPs on every step: an upper bound (block steps orthogonalize smaller
    # matrices, how much smaller depends on the layout).
    "muon_bp": Entry(("muon_bp", "muon"), _muon_bp, _ns_flops, newton_schulz=True,
                     period=lambda cfg: cfg.muon_bp.period),
    "soap": Entry(("soap",), _soap, lambda cfg: lambda m, n: soap_matrix_flops(
        m, n, cfg.soap.precondition_frequency, cfg.soap.max_precond_dim)),
    "mop": Entry(("mop",), _mop, lambda cfg: mop_matrix_flops),
    "adaptive_muon": Entry(("adaptive_muon", "muon"), _adaptive_muon, _ns_flops,
                           newton_schulz=True),
    "rekls": Entry(("rekls",), _rekls, lambda cfg: lambda m, n: rekls_matrix_flops(
        m, n, cfg.rekls.max_precond_dim)),
    "dion2": Entry(("dion2",), _dion2, lambda cfg: _selected_flops(cfg.dion2)),
    # NorDion2 selects output neurons (fan_out columns) always.
    "nordion2": Entry(("nordion2", "dion2"), _nordion2,
                      lambda cfg: _selected_flops(cfg.dion2, axis=-1)),
}
def optimizer_names() -> tuple[str, ...]:
    """Every --optim: the matrix optimizers registered now, and AdamW on every leaf."""
    return (*OPTIMIZERS, "adamw")
