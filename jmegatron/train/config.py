"""Typed configuration of a training run (the CLI is generated from these)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jmegatron.models.config import ConfigError, GPTConfig
from jmegatron.sharding.layouts import LAYOUT_CLASSES
from jmegatron.sharding.mesh import MeshConfig
from jmegatron.sharding.schedules import repeats_refusal
from jmegatron.train.registry import OPTIMIZERS, optimizer_names

def require(flag: str, value, ok: bool, want: str) -> None:
    """Raises ConfigError naming the flag, its value and what it must be."""
    if not ok:
        raise ConfigError(f"--{flag} {value!r}: must be {want}")


def positive(v) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def non_negative(v) -> bool:
    return v is not None and math.isfinite(v) and v >= 0


def beta(v) -> bool:
    """A decay rate of an exponential moving average."""
    return v is not None and 0 <= v < 1


def fraction(v) -> bool:
    return v is not None and 0 <= v <= 1


def _folder_name(name: str) -> bool:
    """A single path component: no separator, not '', '.' or '..'."""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    path: str | None = None
    """Folder or glob of UTF-8 text files, a single text file, or a token folder/.bin
    made by `python -m experiments.prepare_data`. Default: the Python stdlib sources."""
    val_fraction: float = 0.05
    """Share of files (or of the token stream) held out for validation."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer.json or model folder that encodes the text and decodes
    the samples; the model's vocab_size becomes its size (default: bytes; a token folder
    uses the tokenizer its meta.json names)."""

    def __post_init__(self):
        require("data.val-fraction", self.val_fraction, 0 < self.val_fraction < 1,
                "between 0 and 1 (exclusive)")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then a decay."""

    kind: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Decay after warmup: cosine, linear, warmup-stable-decay, or none."""
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_fraction: float = 0.2
    """wsd only: the share of steps spent decaying at the end."""

    def __post_init__(self):
        require("schedule.warmup-steps", self.warmup_steps, self.warmup_steps >= 0, ">= 0")
        require("schedule.min-lr-ratio", self.min_lr_ratio, fraction(self.min_lr_ratio),
                "in [0, 1]")
        require("schedule.decay-fraction", self.decay_fraction,
                fraction(self.decay_fraction) and self.decay_fraction > 0, "in (0, 1]")


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """AdamW: every parameter under --optim adamw; the non-matrix ones under Muon."""

    lr: float | None = None
    """Peak learning rate of the AdamW group (default: --lr)."""
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8

    def __post_init__(self):
        require("adamw.lr", self.lr, self.lr is None or positive(self.lr), "a finite number > 0")
        for name in ("b1", "b2"):
            require(f"adamw.{name}", getattr(self, name), beta(getattr(self, name)), "in [0, 1)")
        require("adamw.eps", self.eps, non_negative(self.eps), "a finite number >= 0")


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """Muon's options (used with --optim muon)."""

    momentum: float = 0.95
    """Momentum decay (an EMA, Nesterov style)."""
    ns_coefficients: Literal["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4",
                             "cubic"] = "quintic"
    """Newton-Schulz coefficient set."""
    ns_steps: int | None = None
    """Newton-Schulz iterations (default: the coefficient set's own, 5 for most)."""
    ns_dtype: Literal["float32", "bfloat16"] = "float32"
    """Matmul dtype inside Newton-Schulz (accumulation is always fp32)."""
    scale: Literal["spectral", "shape", "unit_rms", "none"] = "spectral"
    """Update scale by matrix shape; spectral x rms_factor 0.2 matches AdamW's RMS."""
    rms_factor: float | None = None
    """Extra update factor (default: 0.2 for spectral, Moonlight; 1 otherwise)."""
    split_qkv: bool = True
    """Orthogonalize Q, K, V (and gate, up) blocks of fused weights separately."""
    per_head: bool = False
    """Orthogonalize each attention head's block on its own."""
    tp_mode: Literal["auto", "duplicated", "distributed", "gathered", "blockwise"] = "auto"
    """Newton-Schulz of tensor-parallel matrices: exact duplicated, distributed or
    gathered, approximate blockwise, or auto (cheapest exact mode per matrix)."""
    syrk: bool = False
    """Newton-Schulz's symmetric products (X X^T, A A) on the Pallas SYRK kernel, lower
    tiles only (GPU; elsewhere the plain jnp products run and FLOPs count as such)."""
    ns_method: Literal["standard", "gram", "auto"] = "standard"
    """Newton-Schulz on X (standard) or on the short side's Gram with one multiply by X
    at the end (gram); auto: gram wherever it does fewer FLOPs."""

    def __post_init__(self):
        require("muon.momentum", self.momentum, beta(self.momentum), "in [0, 1)")
        require("muon.ns-steps", self.ns_steps, self.ns_steps is None or self.ns_steps >= 1,
                ">= 1")
        require("muon.rms-factor", self.rms_factor,
                self.rms_factor is None or positive(self.rms_factor), "a finite number > 0")


@dataclasses.dataclass(frozen=True)
class SoapConfig:
    """SOAP's options (used with --optim soap); its Adam runs in Shampoo's eigenbasis."""

    b1: float = 0.95
    b2: float = 0.95
    shampoo_beta: float | None = None
    """EMA decay of the Kronecker factors (default: b2)."""
    eps: float = 1e-8
    precondition_frequency: int = 10
    """Refresh the eigenbases (power iteration + QR) every this many steps."""
    max_precond_dim: int = 10_000
    """A matrix side longer than this is not preconditioned (one-sided SOAP)."""

    def __post_init__(self):
        for name in ("b1", "b2", "shampoo_beta"):
            value = getattr(self, name)
            require(f"soap.{name.replace('_', '-')}", value,
                    (value is None and name == "shampoo_beta") or beta(value), "in [0, 1)")
        require("soap.eps", self.eps, non_negative(self.eps), "a finite number >= 0")
        require("soap.precondition-frequency", self.precondition_frequency,
                self.precondition_frequency >= 1, ">= 1")


@dataclasses.dataclass(frozen=True)
class MopConfig:
    """MOP's options (--optim mop): Muon's momentum, the exact polar factor by SVD."""

    momentum: float = 0.95
    nesterov: bool = False
    scale: Literal["nuclear_norm", "spectral", "shape", "unit_rms", "none"] = "nuclear_norm"
    """Update scale: the momentum's nuclear norm (PolarGrad) or one of Muon's."""
    rms_factor: float | None = None
    """Extra update factor (default: 1; 0.2 for spectral, as Muon's)."""

    def __post_init__(self):
        require("mop.momentum", self.momentum, beta(self.momentum), "in [0, 1)")
        require("mop.rms-factor", self.rms_factor,
                self.rms_factor is None or positive(self.rms_factor), "a finite number > 0")


@dataclasses.dataclass(frozen=True)
class AdaptiveMuonConfig:
    """Adaptive Muon's options (--optim adaptive_muon); Newton-Schulz, momentum and
    scale come from --muon.*."""

    second_moment: Literal["adamuon", "normuon", "namo"] = "adamuon"
    """adamuon: element-wise; normuon: per row or column; namo: one per matrix."""
    beta2: float = 0.95
    eps: float = 1e-8
    nesterov: bool = False

    def __post_init__(self):
        require("adaptive-muon.beta2", self.beta2, beta(self.beta2), "in [0, 1)")
        require("adaptive-muon.eps", self.eps, positive(self.eps), "a finite number > 0")


@dataclasses.dataclass(frozen=True)
class MuonBPConfig:
    """MuonBP's options (--optim muon_bp): each device orthogonalizes its own block of the
    momentum, the whole matrix every --muon-bp.period steps; Newton-Schulz, momentum and
    scale come from --muon.*."""

    period: int = 5
    """A full (whole-matrix, Muon's) step every this many steps; block steps between."""
    block_lr_ratio: float = 1.0
    """The block steps' step size over the full steps' (each block is scaled by its own
    shape already, so its update RMS equals a full step's)."""

    def __post_init__(self):
        require("muon-bp.period", self.period, isinstance(self.period, int) and self.period >= 1,
                "an integer >= 1")
        require("muon-bp.block-lr-ratio", self.block_lr_ratio, positive(self.block_lr_ratio),
                "a finite number > 0")


@dataclasses.dataclass(frozen=True)
class ReklsConfig:
    """REKLS's options (--optim rekls): SOAP with KL-Shampoo factors and eigh every step."""

    b1: float = 0.9
    b2: float = 0.95
    shampoo_beta: float = 0.95
    eps: float = 1e-8
    max_precond_dim: int = 10_000
    """A matrix side longer than this is not preconditioned."""

    def __post_init__(self):
        for name in ("b1", "b2", "shampoo_beta"):
            require(f"rekls.{name.replace('_', '-')}", getattr(self, name),
                    beta(getattr(self, name)), "in [0, 1)")
        require("rekls.eps", self.eps, positive(self.eps), "a finite number > 0")


@dataclasses.dataclass(frozen=True)
class Dion2Config:
    """Dion2's options (--optim dion2): a summed momentum of which only a fraction of the
    rows or columns (the largest by L1 norm) is orthogonalized, with error feedback."""

    fraction: float = 0.25
    """The fraction of each matrix's slices (along its shorter side) orthogonalized."""
    ef_decay: float = 0.95
    """The decay of the selected slices of the momentum after each step."""
    coefficients: str = "dion2"
    """dion2: the reference's Polar Express; or a Newton-Schulz set (see --muon.ns-coefficients)."""
    ns_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Matmul operands of the orthogonalization (the reference's bf16)."""
    scale: Literal["spectral", "shape", "unit_rms", "none"] = "spectral"
    """Update scale; spectral (0.2 sqrt(max side), as --muon.scale) lets one --lr fit the
    AdamW leaves too; the reference's default is unit_rms (sqrt(fan_out / fan_in))."""
    selection: Literal["global", "local"] = "global"
    """Where matrices are split (--layout fsdp, and tensor): global, the top slices of
    the whole matrix (as one device); local, where one side is split, each shard its
    own top fraction along it (the reference's default; fewer bytes, depends on the
    sharding; global where both sides are split)."""

    def __post_init__(self):
        require("dion2.fraction", self.fraction, positive(self.fraction) and self.fraction <= 1,
                "in (0, 1]")
        require("dion2.ef-decay", self.ef_decay, beta(self.ef_decay), "in [0, 1)")


@dataclasses.dataclass(frozen=True)
class NorDion2Config:
    """NorDion2's options (--optim nordion2): Dion2 on the output neurons with NorMuon's
    per-neuron normalization; fraction, error feedback, orthogonalization and scale
    come from --dion2.* (its selection does not apply: whole matrices on their owners)."""

    beta2: float = 0.95
    """The decay of each output neuron's second moment (the reference's muon_beta2)."""

    def __post_init__(self):
        require("nordion2.beta2", self.beta2, beta(self.beta2), "in [0, 1)")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How the pipeline stages (--mesh.stage S) run the M microbatches."""

    schedule: Literal["gpipe", "circular", "1f1b", "interleaved-1f1b"] = "gpipe"
    """gpipe: S contiguous stages, all forward then all backward, bubble
    (S-1)/(M+S-1), every microbatch's activations kept; circular: each stage holds
    --pipeline.repeats V interleaved chunks of layers and every microbatch goes around
    the stages V times, bubble (S-1)/(V M+S-1) (needs M >= S); 1f1b: one forward and
    one backward a tick, what the forwards of at most 2S-1 microbatches keep (as
    --model.remat says) whatever M, bubble (S-1)/(M+S-1); interleaved-1f1b: 1f1b over
    V chunks a stage (M a multiple of S), bubble (S-1)/(V M+S-1), what at most
    2S-1+(V-1)S chunks' forwards keep."""
    repeats: int = 1
    """Chunks of layers per stage V (circular, interleaved-1f1b: >= 2; gpipe, 1f1b: 1)."""

    def __post_init__(self):
        reason = repeats_refusal(self.schedule, self.repeats)
        if reason:
            raise ConfigError(reason)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When and how many checkpoints are written."""

    every: int = 0
    """Save every this many steps (0: only at the end of the run)."""
    keep: int = 3
    """Keep the last this many checkpoints."""
    keep_period: int | None = None
    """Also keep every checkpoint whose step is a multiple of this."""
    async_save: bool = True
    """Write in the background while training continues."""
    verify: bool = True
    """Read each finished checkpoint back and compare its checksums before older ones are
    rotated out (costs one read of the checkpoint; without it, written checkpoints count
    as unverified and the newest verified one is kept as well)."""

    def __post_init__(self):
        require("checkpoint.every", self.every, self.every >= 0, ">= 0 (0: only at the end)")
        require("checkpoint.keep", self.keep, self.keep >= 1,
                ">= 1 (the newest checkpoint is always kept)")
        require("checkpoint.keep-period", self.keep_period,
                self.keep_period is None or self.keep_period >= 1, ">= 1")


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """Several processes (hosts) under jax.distributed: give coordinator, num-processes
    and process-id on every process, or --dist.auto under SLURM / Open MPI / TPU (automatic
    for an srun or mpirun of several tasks)."""

    coordinator: str | None = None
    """HOST:PORT of process 0, where it serves the coordinator (the same on all processes)."""
    num_processes: int | None = None
    """Processes in the run (usually one per host)."""
    process_id: int | None = None
    """This process's index, 0 .. num_processes-1 (0 hosts the coordinator)."""
    auto: bool = False
    """Take what is not given from the environment jax.distributed understands
    (SLURM, Open MPI, TPU, JAX_COORDINATOR_ADDRESS, JAX_LOCAL_DEVICE_IDS)."""
    detect: bool = True
    """Without --dist flags, act as --dist.auto when the environment shows one of several
    processes (SLURM_NTASKS > 1 under srun, OMPI_COMM_WORLD_SIZE > 1, or
    JAX_COORDINATOR_ADDRESS set); --dist.no-detect runs a single process regardless."""
    init_timeout: int = 300
    """Seconds to wait for the coordinator and every process at start-up, then fail."""
    heartbeat_timeout: int = 60
    """Seconds without a heartbeat after which a process counts as dead and the others
    exit with an error."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run: model, mesh, data, optimizer and loop settings."""

    model: GPTConfig = GPTConfig()
    mesh: MeshConfig = MeshConfig(data=2, fsdp=-1, tensor=2)
    """Device mesh (-1: the rest of the devices)."""
    fit_mesh: bool = True
    """Shrink the mesh to the devices present (off once any --mesh.* flag is given)."""
    layout: str = "auto"
    """Where params and matrix-optimizer state live: replicated (data parallel),
    layerwise (Megatron: state of each matrix on one data rank), fsdp (ZeRO-3,
    element-wise), owner (MatrixFSDP: each matrix whole on one fsdp rank), or another
    registered layout (jmegatron.sharding.layouts.LAYOUT_CLASSES); auto: the one with
    the shortest modelled step on this mesh and hardware (printed at start)."""
    owner_group: Literal["fsdp", "data+fsdp"] | None = None
    """owner: the ranks that each hold whole matrices of every group of layers: fsdp (the
    data ranks hold copies, as hybrid-sharded FSDP) or data+fsdp (one group over both);
    unset: --layout auto chooses it, --layout owner takes fsdp."""
    assignment: Literal["round_robin", "balanced"] = "round_robin"
    """layerwise: which data rank owns each matrix: round_robin (continuing from one
    stack to the next) or balanced (heaviest stacks first, evening the per-rank
    Newton-Schulz load where the ranks do not divide a stack)."""
    pipeline: PipelineConfig = PipelineConfig()
    data: DataConfig = DataConfig()
    optim: str = "muon"
    """A matrix optimizer for hidden matrices and AdamW for the rest (muon, muon_bp, soap, mop,
    adaptive_muon, rekls, dion2, nordion2: every entry of jmegatron.train.registry.OPTIMIZERS,
    checked when parsed); adamw: AdamW for all."""
    lr: float = 3e-3
    """Peak learning rate (Muon's updates are scaled to AdamW's RMS, so one rate fits both)."""
    weight_decay: float = 0.1
    """Weight decay on matrices and embeddings (never on norm scales)."""
    weight_decay_method: Literal["decoupled", "independent", "l2", "palm"] = "decoupled"
    """How a matrix optimizer decays its matrices: p -= lr*wd*p (decoupled), p -= wd*p
    (independent), g += wd*p (l2), p -= lr^2*wd*p (palm); AdamW's are decoupled."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    schedule: ScheduleConfig = ScheduleConfig()
    adamw: AdamWConfig = AdamWConfig()
    muon: MuonConfig = MuonConfig()
    soap: SoapConfig = SoapConfig()
    mop: MopConfig = MopConfig()
    adaptive_muon: AdaptiveMuonConfig = AdaptiveMuonConfig()
    muon_bp: MuonBPConfig = MuonBPConfig()
    rekls: ReklsConfig = ReklsConfig()
    dion2: Dion2Config = Dion2Config()
    nordion2: NorDion2Config = NorDion2Config()
    checkpoint: CheckpointConfig = CheckpointConfig()
    dist: DistConfig = DistConfig()
    stop_after: int | None = None
    """Stop (with a checkpoint) after this step, keeping the schedule of --steps: for jobs
    with a time limit, continued later with --resume."""
    resume: bool = False
    """Continue from the latest checkpoint in this run's folder (out_dir/name)."""
    resume_from: str | None = None
    """Start from a checkpoint folder (run/checkpoints) or one step of it (run/checkpoints/200),
    possibly written on another mesh or layout."""
    init_from: str | None = None
    """Start from a Hugging Face model folder, hf:PATH (Llama, Qwen3, Qwen3-MoE: see
    jmegatron.models.hf): its config.json sets the architecture (--model.* shape flags
    are replaced; dtype, remat and the MoE training options stay) and its weights the
    initial params."""
    overwrite: bool = False
    """Delete what the run folder out_dir/name holds (checkpoints first) and start afresh."""
    allow_change: tuple[str, ...] = ()
    """On resume, settings that may differ from the checkpoint's run (e.g. steps lr
    schedule.kind; a group such as muon or model allows all its fields); every other
    change of model, optimizer, seed, batch, sequence length or schedule is refused."""
    max_skipped: int = 10
    """Stop the run after this many consecutive skipped (non-finite) steps."""
    steps: int = 300
    """Optimizer steps to take."""
    batch_size: int = 32
    """Global batch in sequences (split over data x fsdp x expert)."""
    seq_len: int = 128
    """Tokens per training sequence T."""
    microbatches: int = 1
    """Gradient accumulation: the batch is processed in this many pieces."""
    z_loss: float = 0.0
    """Weight of the log-partition penalty z_loss * log(Z)^2 (PaLM)."""
    qk_clip: float = 0.0
    """QK-clip threshold tau (MuonClip, Kimi K2): after each step, attention heads whose
    largest logit in the batch exceeded it get W_q, W_k rescaled to bring it to tau
    (0: off; not with --model.qk-norm, which undoes the rescaling)."""
    qk_clip_alpha: float = 0.5
    """Share of each QK-clip put on the queries (the rest on the keys)."""
    eval_every: int = 100
    """Evaluate on the validation split and print samples every this many steps."""
    eval_batches: int = 4
    """Fixed validation batches per evaluation."""
    log_every: int = 10
    """Write a metrics line every this many steps."""
    sample_prompt: str = "def "
    """Text the samples continue."""
    sample_tokens: int = 100
    """Length of each sample in tokens (bytes); 0: no samples."""
    top_k: int = 10
    """Top-k sampling for the second sample (the first is greedy)."""
    seed: int = 0
    """Seeds the initialization, the batch order and the samples."""
    out_dir: str = "runs"
    """Folder that holds the run folders."""
    name: str | None = None
    """Run folder name under out_dir (default: a timestamp)."""
    cpu_devices: int = 8
    """Virtual devices when running on CPU, per process (set before JAX starts)."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self):
        require("optim", self.optim, self.optim in optimizer_names(),
                f"one of {', '.join(optimizer_names())} (jmegatron.train.registry)")
        require("layout", self.layout, self.layout in ("auto", *LAYOUT_CLASSES),
                f"one of auto, {', '.join(LAYOUT_CLASSES)} (jmegatron.sharding.layouts)")
        for name in ("steps", "batch_size", "seq_len", "microbatches", "eval_every",
                     "eval_batches", "log_every", "max_skipped", "top_k", "cpu_devices"):
            require(name.replace("_", "-"), getattr(self, name), getattr(self, name) >= 1, ">= 1")
        require("stop-after", self.stop_after, self.stop_after is None or self.stop_after >= 1,
                ">= 1")
        require("lr", self.lr, positive(self.lr), "a finite number > 0")
        for name in ("weight_decay", "grad_clip", "z_loss"):
            require(name.replace("_", "-"), getattr(self, name),
                    non_negative(getattr(self, name)), "a finite number >= 0")
        require("sample-tokens", self.sample_tokens, self.sample_tokens >= 0, ">= 0")
        require("qk-clip", self.qk_clip, non_negative(self.qk_clip), "a finite number >= 0")
        require("qk-clip", self.qk_clip, not (self.qk_clip and self.model.qk_norm),
                "0 with --model.qk-norm (normalized queries and keys undo its rescaling)")
        require("init-from", self.init_from,
                self.init_from is None or self.init_from.startswith("hf:"),
                "hf:PATH (a Hugging Face model folder)")
        require("qk-clip-alpha", self.qk_clip_alpha, fraction(self.qk_clip_alpha), "in [0, 1]")
        require("microbatches", self.microbatches, self.batch_size % self.microbatches == 0,
                f"a divisor of --batch-size {self.batch_size}")
        if self.overwrite and self.resume:
            raise ConfigError("--overwrite with --resume: one deletes the run the other "
                              "continues; give one of them")
        require("name", self.name, self.name is None or _folder_name(self.name),
                "one folder name (no '/', '..' or absolute path): run folders stay inside "
                "--out-dir")
        if self.optim == "adaptive_muon" and self.adaptive_muon.second_moment == "namo":
            require("weight-decay-method", self.weight_decay_method,
                    self.weight_decay_method != "l2", "not l2 with --adaptive-muon.second-moment "
                    "namo (its second moment would see the decayed gradient)")

    @property
    def optimizer_groups(self) -> tuple[str, ...]:
        """The option groups ``optim`` reads (besides adamw's; ``registry.OPTIMIZERS``)."""
        return OPTIMIZERS[self.optim].groups if self.optim in OPTIMIZERS else ()

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches
