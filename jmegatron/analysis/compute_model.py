"""The compute side of a calibrated step projection: a dense decoder's matmuls at
the efficiency their shapes allow on a GPU, and its element-wise work at memory
speed. Pure Python (no JAX); ``cost_model`` holds the hardware and the
collectives.

Per device and training step (``dense_step_work`` lists the work, ``seconds``
prices it):

  matmul        flops / (rate * wave_efficiency(m, n)). A GEMM's [m, n] output is
                cut into 256 x 128 tiles; each SM computes one tile at a time, so
                the tiles run in waves of one tile per SM, and a last partial wave
                (or a partly filled tile) leaves SMs idle. Source: NVIDIA, "Matrix
                Multiplication Background User's Guide" (docs.nvidia.com/
                deeplearning/performance), sections "Typical tile dimensions in
                cuBLAS and performance" (256 x 128 the most efficient tile) and
                "Dimension quantization effects" (tile and wave quantization). The
                model takes that one tile for every GEMM: cuBLAS's heuristics pick
                smaller tiles or split K for some shapes, which the model does not
                know.
  element-wise  bytes / (HBM bandwidth * HBM_EFFICIENCY), nothing overlapped with
                the matmuls. The bytes are counted from the layer (``_layer_memory``):
                the norms and residual adds on the whole [tokens, D] activation,
                which tensor parallelism does not split, and the SwiGLU product and
                the softmax on their tensor-split activations.
  rate          the speed of a full-wave matmul: one constant per device, set by
                ``calibrate`` from a measured step of a one-device run (the
                baseline a scaling efficiency is relative to).

The collectives come from the compiled program (``cost_model.comm_cost``).
"""

from __future__ import annotations

import dataclasses
import math

TILE = (256, 128)
# The share of its HBM bandwidth a streaming kernel reaches: 750 of 900 GB/s
# measured on V100 (Jia et al. 2018, "Dissecting the NVIDIA Volta GPU Architecture
# via Microbenchmarking", arXiv:1804.06826, global memory throughput).
HBM_EFFICIENCY = 750 / 900
# Memory accesses per element in one forward pass (reads + writes), from the layer's
# code (jmegatron.models.layers): two RMSNorms (read, write) and two residual adds
# (two reads, a write) on the [tokens, D] activation; silu(gate) * up (two reads, a
# write) on [tokens, F / t]; the softmax (read, write) on [B, heads / t, T, T].
UNSPLIT_ACCESSES = 2 * 2 + 2 * 3
SWIGLU_ACCESSES = 3
SOFTMAX_ACCESSES = 2
# The backward pass's element-wise traffic over the forward's: each op reads its
# saved input and the incoming gradient and writes the outgoing one.
BACKWARD_MEMORY = 2
# Bytes per element of GPTConfig.dtype, the activations' dtype.
ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Gemm:
    """``count`` launches per step of ``batch`` matmuls [m, k] x [k, n] each (a batched
    matmul's tiles share its waves)."""

    m: int
    k: int
    n: int
    count: int
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count * self.batch

    def efficiency(self, sms: int) -> float:
        return wave_efficiency(self.m, self.n, sms, self.batch)


@dataclasses.dataclass(frozen=True)
class Work:
    """A step's work on one device: its matmuls and its element-wise HBM traffic."""

    gemms: tuple[Gemm, ...]
    memory_bytes: float

    @property
    def flops(self) -> float:
        return sum(g.flops for g in self.gemms)


def wave_efficiency(m: int, n: int, sms: int, batch: int = 1,
                    tile: tuple[int, int] = TILE) -> float:
    """The share of the SM time of ``batch`` GEMMs with [m, n] outputs, launched
    together, spent on real output elements: batch m n / (tile area x sms x waves)."""
    tiles = batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    waves = math.ceil(tiles / sms)
    return batch * m * n / (waves * sms * tile[0] * tile[1])


def _with_backward(forward: list[Gemm], passes: int) -> list[Gemm]:
    """Each forward GEMM ``passes`` times (2 under full remat) and its two backward
    GEMMs: the input gradient [m, n] x [n, k] and the weight gradient [k, m] x [m, n]."""
    out = []
    for g in forward:
        out += [dataclasses.replace(g, count=g.count * passes),
                dataclasses.replace(g, k=g.n, n=g.k), dataclasses.replace(g, m=g.k, k=g.m)]
    return out


def dense_step_work(cfg, batch: int, seq: int, tensor: int = 1) -> Work:
    """The matmuls and element-wise bytes of one training step of ``cfg`` (a dense
    ``GPTConfig``) on one of ``tensor`` tensor-parallel ranks that see ``batch``
    sequences of ``seq`` tokens (Megatron's split: heads, d_ff and the vocabulary
    over ``tensor``)."""
    if any(cfg.moe_layers):
        raise ValueError("dense_step_work models dense layers only; this config has MoE layers")
    d, f, h = cfg.d_model, cfg.d_ff, cfg.resolved_head_dim
    heads, kv = cfg.n_heads // tensor, cfg.n_kv_heads // tensor
    tokens, layers = batch * seq, cfg.n_layers
    passes = 2 if cfg.remat == "full" else 1
    layer = [Gemm(tokens, d, (heads + 2 * kv) * h, layers),      # fused q, k, v
             Gemm(seq, h, seq, layers, batch * heads),           # scores
             Gemm(seq, seq, h, layers, batch * heads),           # weighted values
             Gemm(tokens, heads * h, d, layers),                 # attention out
             Gemm(tokens, d, 2 * f // tensor, layers),           # fused gate, up
             Gemm(tokens, f // tensor, d, layers)]               # down
    head = [Gemm(tokens, d, cfg.vocab // tensor, 1)]
    gemms = _with_backward(layer, passes) + _with_backward(head, 1)
    return Work(tuple(gemms), _layer_memory(cfg, batch, seq, heads, tensor) * layers
                * (passes + BACKWARD_MEMORY))


def _layer_memory(cfg, batch: int, seq: int, heads: int, tensor: int) -> float:
    """One layer's element-wise HBM bytes in one forward pass (see the access counts)."""
    tokens = batch * seq
    elements = (UNSPLIT_ACCESSES * tokens * cfg.d_model
                + SWIGLU_ACCESSES * tokens * cfg.d_ff // tensor
                + SOFTMAX_ACCESSES * batch * heads * seq * seq)
    return ITEMSIZE[cfg.dtype] * elements


def matmul_seconds(work: Work, rate: float, sms: int) -> float:
    """The matmuls of ``work`` at ``rate`` FLOP/s per full wave, each slowed by its
    wave efficiency."""
    return sum(g.flops / (rate * g.efficiency(sms)) for g in work.gemms)


def memory_seconds(work: Work, hbm_bytes_per_s: float) -> float:
    return work.memory_bytes / (hbm_bytes_per_s * HBM_EFFICIENCY)


def seconds(work: Work, rate: float, hw) -> float:
    """Compute time of ``work`` on ``hw`` (a ``cost_model.Hardware``): matmuls, then
    element-wise work (no overlap)."""
    return (matmul_seconds(work, rate, hw.sms)
            + memory_seconds(work, hw.hbm_gb_s * 1e9))


def calibrate(work: Work, measured_seconds: float, hw) -> float:
    """The full-wave matmul rate that makes ``seconds(work, rate, hw)`` equal a
    measured step of ``work``; raises ValueError when the element-wise time alone
    exceeds it."""
    left = measured_seconds - memory_seconds(work, hw.hbm_gb_s * 1e9)
    if left <= 0:
        raise ValueError(f"the element-wise work alone takes longer than the measured "
                         f"{measured_seconds:.3g} s")
    return matmul_seconds(work, 1.0, hw.sms) / left
