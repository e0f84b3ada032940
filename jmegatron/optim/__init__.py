"""Matrix optimizers (Muon, MuonBP, MOP, adaptive Muon, Dion2, NorDion2, SOAP, REKLS), Newton-Schulz and parameter routing, as optax transformations."""

from jmegatron.optim.adaptive_muon import adaptive_muon, scale_by_adaptive_muon
from jmegatron.optim.coefficients import COEFFICIENT_SETS, CoefficientSet, coefficient_set
from jmegatron.optim.dion2 import (DION2_COEFFICIENTS, Dion2State, dion2, dion2_flops,
                                   scale_by_dion2)
from jmegatron.optim.muon import (MOONLIGHT_RMS, MuonState, muon, muon_flops, scale_by_muon,
                                  update_scale)
from jmegatron.optim.matrix import (WEIGHT_DECAY_METHODS, AdamW, PlanSpec, descend,
                                    scale_by_matrix_optimizer)
from jmegatron.optim.muon_bp import muon_bp, scale_by_muon_bp
from jmegatron.optim.nordion2 import NorDion2State, nordion2, scale_by_nordion2
from jmegatron.optim.mop import mop, mop_flops, polar_factor, scale_by_mop
from jmegatron.optim.newton_schulz import newton_schulz, ns_flops
from jmegatron.optim.plan import (LeafPlan, ShardingPlan, make_plan, matrix_state,
                                  trainable_params)
from jmegatron.optim.rekls import rekls, rekls_block, rekls_flops, scale_by_rekls
from jmegatron.optim.routing import (ADAMW, MATRIX, LeafRoute, MatrixSpec, Piece, Route, Routing,
                                     describe, from_matrices, labels, leaf_routes, map_matrices,
                                     matrix_pieces, route, to_matrices)
from jmegatron.optim.soap import Factors, SoapState, scale_by_soap, soap, soap_flops
from jmegatron.optim.tensor_parallel import (TP_MODES, TensorParallel, TPCostModel,
                                             tp_newton_schulz)

__all__ = [
    "COEFFICIENT_SETS", "CoefficientSet", "coefficient_set",
    "newton_schulz", "ns_flops",
    "MuonState", "scale_by_muon", "muon", "muon_flops", "update_scale", "MOONLIGHT_RMS",
    "scale_by_muon_bp", "muon_bp",
    "scale_by_mop", "mop", "mop_flops", "polar_factor",
    "scale_by_adaptive_muon", "adaptive_muon",
    "Dion2State", "scale_by_dion2", "dion2", "dion2_flops", "DION2_COEFFICIENTS",
    "NorDion2State", "scale_by_nordion2", "nordion2",
    "SoapState", "Factors", "scale_by_soap", "soap", "soap_flops",
    "scale_by_rekls", "rekls", "rekls_block", "rekls_flops",
    "Routing", "Route", "MatrixSpec", "Piece", "route", "labels", "leaf_routes", "describe",
    "map_matrices", "to_matrices", "from_matrices", "matrix_pieces", "ADAMW", "MATRIX", "LeafRoute",
    "AdamW", "PlanSpec", "descend", "WEIGHT_DECAY_METHODS", "scale_by_matrix_optimizer", "ShardingPlan", "LeafPlan", "make_plan",
    "matrix_state", "trainable_params",
    "TP_MODES", "TensorParallel", "TPCostModel", "tp_newton_schulz",
]
