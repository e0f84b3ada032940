"""A cost model for compiled programs: FLOPs at a stated MFU, collectives by NCCL's
ring model over stated links, each term with its source.

Pure Python (no JAX): a collective is anything with the attributes of
``jmegatron.analysis.hlo.Collective`` (``kind``, ``axes``, ``group_size``,
``bytes_per_device``, ``executions``), and a mesh is its shape, a mapping of
axis name -> size in the mesh's axis order.

The model, per device (every number is an assumption of the preset, see
``HARDWARE``, or of ``NCCL_RING``):

  compute    flops / (mfu * peak_flops); ``compute_model`` prices a dense
             decoder's matmuls by shape and its element-wise work instead, from
             a calibrated rate
  collective executions * the preset's ``links`` timing of one execution:
             ``NcclRing`` on GPUs: NCCL's ring model, base + steps * hop latency
             + bus bytes / (bus efficiency * link bandwidth), the faster of its
             LL and Simple protocols; ``Flat`` on the CPU preset: one measured
             latency + bytes / bandwidth
             link: NVLink where every device group of the collective stays inside
             one NVLink domain (node), else InfiniBand (the slowest link of a ring
             sets its pace: no hierarchical algorithm is credited)
  step       serial:  compute + every collective (nothing overlapped)
             overlap: max(compute, collectives) (perfectly hidden; a lower bound)

Devices map to nodes by the mesh's row-major order: flat index i (over the
mesh axes in order, the last axis fastest) is GPU rank i, on node
i // gpus_per_node. ``jax.make_mesh`` orders devices this way on GPUs, so the
last mesh axes (tensor, then expert) stay inside a node first.

Bandwidths are per direction per GPU, at line rate (a ring sends and receives at
once, so its time is the bytes one device sends, its bus bytes, over the
bandwidth NCCL reaches on that link).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Mapping, Protocol


class CollectiveLike(Protocol):
    kind: str
    axes: tuple[str, ...] | None
    group_size: int
    executions: int

    @property
    def bytes_per_device(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class Flat:
    """A measured fixed cost per collective, and the link's full bandwidth."""

    latency_us: float

    def seconds(self, kind: str, group: int, nodes: int, bus_bytes: float,
                bandwidth: float) -> float:
        return 1e-6 * self.latency_us + bus_bytes / bandwidth


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One of NCCL's protocols: its latencies (us) and share of the bus bandwidth."""

    name: str
    base_us: float
    nvlink_hop_us: float
    net_hop_us: float
    bandwidth_share: float


@dataclasses.dataclass(frozen=True)
class NcclRing:
    """NCCL's ring algorithm, timed the way NCCL's own tuner does (src/graph/tuning.cc,
    github.com/NVIDIA/nccl, read at 2.x, June 2026): one execution over n ranks takes
    ``base + steps * hop`` microseconds (steps: 2(n - 1) for an all-reduce, n - 1 for
    the others; the hops between nodes at the network's latency), plus its bus bytes
    over the bus bandwidth; NCCL picks the faster protocol for each size.

    Bus efficiency, the share of a link's line rate NCCL's busbw reaches on large
    messages: ``nvlink`` 370 / 450 GB/s ("450GB/s is the line rate. With the protocol
    overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s", NCCL's
    maintainer on H100, github.com/NVIDIA/nccl-tests/issues/212; an 8-GPU A100
    all-reduce measured 232.5 of 300 GB/s, nccl-tests issue 175), taken for every
    NVLink generation; ``net`` 24 / 25 GB/s per HDR NIC ("24 (what we see ourselves
    in general on perfect setups)", nccl-tests issue 160).
    """

    protocols: tuple[Protocol, ...]
    nvlink_efficiency: float
    net_efficiency: float

    def seconds(self, kind: str, group: int, nodes: int, bus_bytes: float,
                bandwidth: float) -> float:
        steps = ring_steps(kind, group)
        net_steps = 0 if nodes <= 1 else min(steps, ring_steps(kind, nodes))
        efficiency = self.nvlink_efficiency if nodes <= 1 else self.net_efficiency
        return min(1e-6 * (p.base_us + (steps - net_steps) * p.nvlink_hop_us
                           + net_steps * p.net_hop_us)
                   + bus_bytes / (p.bandwidth_share * efficiency * bandwidth)
                   for p in self.protocols)


def ring_steps(kind: str, ranks: int) -> int:
    """Sequential steps of one ring collective over ``ranks``: 2(n - 1) for an
    all-reduce (reduce-scatter, then all-gather), 1 for a permute, n - 1 otherwise."""
    if kind == "all-reduce":
        return 2 * (ranks - 1)
    if kind == "collective-permute":
        return 1
    return ranks - 1


# NCCL's defaults (tuning.cc): LL moves half the bandwidth at low latency; Simple the
# full bandwidth. LL128 (between them) is left out.
NCCL_RING = NcclRing(
    protocols=(Protocol("LL", base_us=6.6, nvlink_hop_us=0.6, net_hop_us=2.7,
                        bandwidth_share=0.5),
               Protocol("Simple", base_us=8.4, nvlink_hop_us=3.4, net_hop_us=14.0,
                        bandwidth_share=1.0)),
    nvlink_efficiency=370 / 450, net_efficiency=24 / 25)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One kind of GPU cluster; every field is an assumption stated with its source."""

    name: str
    gpus_per_node: int          # GPUs in one NVLink domain
    nvlink_gb_s: float          # NVLink bandwidth per GPU per direction, GB/s (1e9 bytes)
    ib_gb_s: float              # scale-out (InfiniBand) bandwidth per GPU per direction, GB/s
    peak_tflops: float          # dense bf16/fp16 tensor-core peak, TFLOP/s
    mfu: float                  # fraction of peak the matmuls reach (model FLOPs)
    hbm_gb: float               # memory per GPU, GB
    hbm_gb_s: float             # memory bandwidth per GPU, GB/s (compute_model)
    sms: int                    # streaming multiprocessors (compute_model's waves)
    links: Flat | NcclRing      # how one collective execution is timed
    source: str                 # where the figures come from
    # Whether a collective can run while the device computes something it does not
    # feed: on GPUs XLA runs collectives asynchronously (start/done pairs on their
    # own streams) and its latency-hiding scheduler moves their starts ahead of
    # independent work (--xla_gpu_enable_latency_hiding_scheduler, which
    # docs.jax.dev's "GPU performance tips" recommend and NVIDIA's JAX containers
    # set); XLA:CPU runs each collective in its turn.
    overlaps: bool = True
    # Whether a gradient sum that XLA's SPMD partitioner places (sharding constraints,
    # not a shard_map's own psum_scatter) becomes a reduce-scatter. XLA:CPU's becomes
    # an all-reduce, twice the bytes: measured on the default run's compiled train
    # step (data 2 x fsdp 2 x tensor 2, 2026-12-05), layerwise and owner all-reduce
    # 2.76 MB over data and fsdp and reduce-scatter nothing.
    reduce_scatters: bool = True

    @property
    def flops_per_s(self) -> float:
        """Sustained FLOP/s: mfu * peak."""
        return self.mfu * self.peak_tflops * 1e12


_NCCL = ("collectives: NCCL's ring model (cost_model.NCCL_RING: its latencies and "
         "protocols, bus efficiency 0.82 on NVLink and 0.96 on InfiniBand, each with "
         "its source)")

HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", 8, 450.0, 50.0, 989.0, 0.40, 80.0, 3350.0, 132, NCCL_RING,
        "H100 SXM5 (NVIDIA H100 datasheet): 989 TFLOP/s dense bf16; NVLink 4 900 GB/s "
        "bidirectional = 450 GB/s per direction; 8 GPUs per HGX node; one 400 Gb/s "
        "ConnectX-7 NDR InfiniBand NIC per GPU = 50 GB/s; 80 GB HBM3 at 3.35 TB/s; 132 "
        "SMs; MFU 40% assumed (typical of large dense LLM training); " + _NCCL),
    "h200": Hardware(
        "h200", 8, 450.0, 50.0, 989.0, 0.40, 141.0, 4800.0, 132, NCCL_RING,
        "H200 SXM (NVIDIA H200 datasheet): H100's 989 TFLOP/s dense bf16, 132 SMs and "
        "NVLink 4 (450 GB/s per direction) with 141 GB HBM3e at 4.8 TB/s; 8 GPUs per HGX "
        "node; one 400 Gb/s ConnectX-7 NDR NIC per GPU = 50 GB/s; MFU 40% assumed; "
        + _NCCL),
    "gb300": Hardware(
        "gb300", 72, 900.0, 100.0, 2500.0, 0.40, 288.0, 8000.0, 160, NCCL_RING,
        "GB300 NVL72 (NVIDIA GB300 NVL72 specifications): 72 GPUs in one NVLink 5 domain, "
        "1.8 TB/s bidirectional = 900 GB/s per direction per GPU; ConnectX-8 800 Gb/s "
        "(XDR) per GPU = 100 GB/s; ~2.5 PFLOP/s dense bf16 per GPU; 288 GB HBM3e at 8 "
        "TB/s; 160 SMs (Blackwell Ultra); MFU 40% assumed; " + _NCCL),
    "a100": Hardware(
        "a100", 8, 300.0, 25.0, 312.0, 0.40, 80.0, 2039.0, 108, NCCL_RING,
        "A100 SXM4 80GB (NVIDIA A100 datasheet): 312 TFLOP/s dense bf16; NVLink 3 600 GB/s "
        "bidirectional = 300 GB/s per direction; 8 GPUs per DGX A100 node; one 200 Gb/s "
        "HDR InfiniBand NIC per GPU = 25 GB/s; 2,039 GB/s HBM2e; 108 SMs; MFU 40% "
        "assumed; " + _NCCL + "; used only for the MatrixFSDP anchor (measured on A100)"),
    "v100-dgx2h": Hardware(
        "v100-dgx2h", 16, 150.0, 6.25, 125.0, 0.312, 32.0, 900.0, 80, NCCL_RING,
        "DGX-2H as in Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, section 5): 16 "
        "V100 32 GB per node on NVSwitch, '300 GB/s' between GPUs, which is NVLink 2's "
        "bidirectional figure (6 links x 25 GB/s per direction = 150 GB/s per direction, "
        "used here); '100 GB/s between servers using 8 InfiniBand adapters' = 6.25 GB/s "
        "per GPU; 125 TFLOP/s fp16 peak, 900 GB/s HBM2 and 80 SMs (V100 datasheet); the "
        "paper's one-GPU baseline sustains 39 TFLOP/s = 31.2% of peak (the mfu here, and "
        "compute_model's calibration point); " + _NCCL),
    "cpu": Hardware(
        "cpu", 1024, 0.5, 0.5, 0.055, 1.0, 16.0, 0.0, 0, Flat(250.0),
        "virtual XLA:CPU devices of one process (all in one 'node'), measured on this "
        "project's 2-core machine with experiments.bench_cpu_links (2026-12-05): a 512^3 "
        "fp32 matmul on 8 devices at once runs at 55 GFLOP/s per device (the peak here, "
        "mfu 1); all-gathers and reduce-scatters of 64 MB send 0.41-0.48 GB/s per "
        "device (0.5 here; 2-3.5 GB/s at 4 MB, which fits in cache); a 4 KB one takes "
        "0.2-0.27 ms (the latency, per collective whatever its group); memory: 128 GB "
        "shared by 8 devices; no HBM or SM figures (compute_model does not apply); no "
        "overlap of collectives with compute; XLA's gradient sums all-reduced",
        overlaps=False, reduce_scatters=False),
}


# Substrings of a GPU's ``device_kind`` (e.g. "NVIDIA H100 80GB HBM3") -> its preset,
# the first match winning.
DEVICE_KINDS = (("GB300", "gb300"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def preset_for(platform: str, device_kind: str) -> tuple[str, bool]:
    """The preset modelling devices of ``platform`` (jax's ``Device.platform``) and
    ``device_kind``, and whether it is theirs: an accelerator none of
    ``DEVICE_KINDS`` names is modelled as an H100 (False)."""
    if platform == "cpu":
        return "cpu", True
    for part, name in DEVICE_KINDS:
        if part in device_kind:
            return name, True
    return "h100", False


def hardware(name: str) -> Hardware:
    """The preset ``name`` (a key of ``HARDWARE``); raises a one-line ValueError."""
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose one of {tuple(HARDWARE)}")
    return HARDWARE[name]


def nodes_spanned(axes: Iterable[str] | None, group_size: int,
                  mesh_shape: Mapping[str, int], gpus_per_node: int) -> int:
    """The most nodes one device group varying along ``axes`` (the others fixed)
    touches (see the module docstring for the device order). ``None`` (axes the HLO
    parser could not derive) counts as crossing nodes: the group over as many nodes
    as it needs, at least two."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    if math.prod(sizes) <= gpus_per_node:
        return 1
    if axes is None:
        return max(2, math.ceil(group_size / gpus_per_node))
    moving = [names.index(a) for a in axes]
    fixed = [i for i in range(len(names)) if i not in moving]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(names))]
    most = 1
    for base in itertools.product(*(range(sizes[i]) for i in fixed)):
        start = sum(b * strides[i] for b, i in zip(base, fixed))
        nodes = {(start + sum(o * strides[i] for o, i in zip(offs, moving))) // gpus_per_node
                 for offs in itertools.product(*(range(sizes[i]) for i in moving))}
        most = max(most, len(nodes))
    return most


def within_node(axes: Iterable[str] | None, mesh_shape: Mapping[str, int],
                gpus_per_node: int) -> bool:
    """True when every device group varying along ``axes`` lies in one node."""
    size = math.prod(mesh_shape[a] for a in axes) if axes is not None else 2
    return nodes_spanned(axes, size, mesh_shape, gpus_per_node) == 1


def collective_seconds(c: CollectiveLike, mesh_shape: Mapping[str, int],
                       hw: Hardware) -> tuple[float, bool]:
    """(seconds of all executions of ``c`` per call, whether it stays on NVLink)."""
    if c.group_size <= 1 or not c.executions:
        return 0.0, True
    nodes = nodes_spanned(c.axes, c.group_size, mesh_shape, hw.gpus_per_node)
    bandwidth = 1e9 * (hw.nvlink_gb_s if nodes == 1 else hw.ib_gb_s)
    one = hw.links.seconds(c.kind, c.group_size, nodes, c.bytes_per_device, bandwidth)
    return c.executions * one, nodes == 1


@dataclasses.dataclass(frozen=True)
class CommCost:
    """The collectives of one program on one preset, per device per call."""

    seconds: float          # bandwidth and latency terms together
    nvlink_bytes: float     # bytes sent over NVLink
    ib_bytes: float         # bytes sent over InfiniBand
    launches: int           # collective executions (each pays one latency)


def comm_cost(collectives: Iterable[CollectiveLike], mesh_shape: Mapping[str, int],
              hw: Hardware) -> CommCost:
    """Sums ``collective_seconds`` over a program's collectives.

    Args:
      collectives: e.g. ``parse_collectives(compiled.as_text(), mesh).collectives``.
      mesh_shape: the mesh's axis sizes in its axis order (``mesh.shape``).
      hw: the preset.
    """
    seconds = nvlink = ib = 0.0
    launches = 0
    for c in collectives:
        if c.group_size <= 1 or not c.executions:
            continue
        s, local = collective_seconds(c, mesh_shape, hw)
        seconds += s
        launches += c.executions
        moved = c.bytes_per_device * c.executions
        nvlink, ib = (nvlink + moved, ib) if local else (nvlink, ib + moved)
    return CommCost(seconds, nvlink, ib, launches)


def compute_seconds(flops: float, hw: Hardware) -> float:
    """Seconds for ``flops`` (per device) at the preset's mfu * peak."""
    return flops / hw.flops_per_s


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A projected step of one program on one preset (seconds, per device)."""

    compute: float
    comm: CommCost

    @property
    def serial(self) -> float:
        """Nothing overlapped: compute, then every collective."""
        return self.compute + self.comm.seconds

    @property
    def overlapped(self) -> float:
        """Collectives perfectly hidden behind compute (or the reverse)."""
        return max(self.compute, self.comm.seconds)


def project(flops: float, collectives: Iterable[CollectiveLike],
            mesh_shape: Mapping[str, int], hw: Hardware) -> StepCost:
    """The cost of one program: ``flops`` per device and its ``collectives``."""
    return StepCost(compute_seconds(flops, hw), comm_cost(collectives, mesh_shape, hw))
