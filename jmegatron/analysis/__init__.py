"""Instruments: what a compiled program communicates (``hlo``), and what a cluster's
links (``cost_model``) and matmuls (``compute_model``) would make of it."""

from jmegatron.analysis.hlo import (Collective, CollectiveReport, hlo_collectives,
                                    parse_collectives)

__all__ = ["Collective", "CollectiveReport", "hlo_collectives", "parse_collectives"]
