"""Model configuration (sizes only; nothing here knows about meshes)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_PATHS = ("einsum", "flash")   # attention.ATTENTION has one function for each
CONTEXT_STRATEGIES = ("ring", "all_gather")   # context.CONTEXT_ATTENTION: one for each
CONTEXT_ORDERS = ("zigzag", "contiguous")     # context.chunks_of deals each


class ConfigError(Exception):
    """A setting no run accepts; the message is one line naming it. Not a ValueError on
    purpose: the CLI parser (tyro) boxes the ValueErrors of nested settings, and this
    should reach the user as one line."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _at_least(config, minimum: int, *names: str, prefix: str = "") -> None:
    """Each named integer field is at least ``minimum``."""
    for name in names:
        value = getattr(config, name)
        _require(value >= minimum, f"{prefix}{name}={value} must be >= {minimum}")


def _finite_positive(config, *names: str, prefix: str = "") -> None:
    for name in names:
        value = getattr(config, name)
        _require(math.isfinite(value) and value > 0,
                 f"{prefix}{name}={value} must be a finite number > 0")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (Qwen3-MoE style); ``n_experts=0`` keeps every layer dense.

    Attributes:
      n_experts: Routed experts E per MoE layer (0: a dense model).
      top_k: Experts each token is routed to (k).
      d_ff: Hidden width of each expert's SwiGLU.
      shared_d_ff: Hidden width of a shared expert every token passes through (0: none).
      first_dense: The first this many layers stay dense (DeepSeek's first_k_dense_replace).
      every: Then every this-many-th layer is MoE, the rest dense (Qwen3's
        decoder_sparse_step).
      scoring: Router scores: softmax over experts (Qwen3) or per-expert sigmoid
        (DeepSeek-V3).
      normalize_top_k: Rescale the k chosen scores to sum to 1 (Qwen3's norm_topk_prob).
      bias_rate: Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the
        scores for the choice only, moved by this much per step against each expert's load
        error (0: off).
      dispatch: dropless: every routed token is computed (sort by expert, grouped matmul);
        capacity: each expert takes at most capacity_factor * tokens * k / E per device, the
        rest is dropped.
      capacity_factor: Slots per expert relative to a perfectly even load (capacity
        dispatch).
      exchange: Token exchange between expert ranks: padded all_to_all (runs everywhere) or
        ragged_all_to_all (moves only real tokens; GPU/TPU only, XLA:CPU cannot run it).
      aux_loss: Weight of the load-balancing loss E * sum_i f_i P_i (Switch; 1 when
        balanced).
      z_loss: Weight of the router z-loss mean(logsumexp(router logits)^2) (ST-MoE).
    """

    n_experts: int = 0
    top_k: int = 2
    d_ff: int = 128
    shared_d_ff: int = 0
    first_dense: int = 0
    every: int = 1
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: bool = True
    bias_rate: float = 0.0
    dispatch: Literal["dropless", "capacity"] = "dropless"
    capacity_factor: float = 1.25
    exchange: Literal["padded", "ragged"] = "padded"
    aux_loss: float = 0.01
    z_loss: float = 0.001

    def __post_init__(self):
        _at_least(self, 0, "n_experts", "first_dense", "shared_d_ff", prefix="moe.")
        _at_least(self, 1, "d_ff", "every", prefix="moe.")
        _require(not self.n_experts or 1 <= self.top_k <= self.n_experts,
                 f"moe.top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        _finite_positive(self, "capacity_factor", prefix="moe.")
        for name in ("bias_rate", "aux_loss", "z_loss"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0,
                     f"moe.{name}={value} must be a finite number >= 0")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A pre-norm decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

    Attributes:
      vocab_size: Token ids the data can hold (byte tokenizer: 256 bytes + BOS/EOS/PAD).
      d_model: Model width D.
      n_layers: Number of decoder blocks L.
      n_heads: Query heads N.
      n_kv_heads: Key/value heads K (grouped-query attention; N must be a multiple).
      head_dim: Head width H (default d_model // n_heads).
      d_ff: SwiGLU hidden width F.
      rope_theta: RoPE's base: head dim pair i rotates at theta^(-2i/H) per position.
      rope_scaling: Llama 3's RoPE frequency scaling (factor, low_freq_factor,
        high_freq_factor, original context length); () for none.
      qk_norm: RMSNorm on queries and keys of each head (Qwen3).
      qkv_bias: A bias on the query, key and value projections (Qwen2).
      tie_embeddings: Use the embedding table as the output head.
      norm_eps: Added to the mean square in every RMSNorm.
      init_std: Standard deviation of the normal initialization of the embedding, the
        head, the input projections and the MoE router; the output projections (attention
        out, MLP down) use init_std / sqrt(2 L). Norm scales start at 1, the QKV bias at 0.
      dtype: Compute dtype of matmuls; parameters always stay fp32.
      grad_reduce_dtype: The dtype matmul weights' gradients are computed and summed in
        over devices: their compute dtype (as XLA and the runners do by default) or
        float32 (Megatron's fp32 main gradients: each device's product x^T dy keeps its
        fp32 accumulation, ``models.products``); the same for an fp32 model.
      remat: Activation recomputation in the backward pass: none, full, dots, dots_no_batch.
      attention: einsum (XLA's einsums, the [B, N, T, T] logits formed; its softmax row
        maxima give the largest logit) or flash (``jax.nn.dot_product_attention``:
        cuDNN's fused kernel on GPU, with a second blockwise pass over q k^T for the
        largest logit; see ``attention.flash_attention``).
      context_attention: Where a context mesh axis splits the sequence, how a rank's
        queries reach the other ranks' keys and values (``models.context``): ring
        (K/V blocks passed round the axis, combined by the online softmax: no rank
        holds the whole K/V) or all_gather (K/V gathered whole on every rank).
      context_order: How the sequence is dealt to the context ranks in 2C chunks:
        zigzag (rank i holds chunks i and 2C-1-i: every rank does the same causal
        attention work) or contiguous (chunks 2i and 2i+1: the plain split).
      vocab_multiple: The embedding table is padded to a multiple of this x tensor
        (Megatron).
      padded_vocab_size: Set by `pad_vocab` from vocab_multiple and the tensor size; leave
        unset.
      layer_group: Stack block weights as [G, g, ...], G = ceil(L / g), the last group
        padded with zero layers the forward skips (set by the owner layout to the fsdp
        size).
      stages: Split each block stack into this many contiguous pipeline stages,
        [S, ceil(L / S), ...], the last padded with zero layers (set from the mesh's
        stage axis).
      repeats: Circular pipelines: each stage holds this many interleaved chunks of
        c = ceil(L / (S * V)) layers, [S, V * c, ...], chunk j on stage j % S (set by
        the layout from --pipeline.repeats; 1: contiguous stages).
      prefetch: Grouped dense stacks (owner layout): issue group i+1's all-gather before
        group i runs, in both passes, so GPU/TPU schedulers can hide it; each group's
        layers are unrolled, and it holds at most one more group per device (see
        jmegatron.sharding.prefetch). Needs a mesh whose only live axes are batch
        axes (tensor 1).
      keep_gathered: Grouped stacks without prefetch (owner layout): the backward keeps
        each group's gathered weights instead of gathering them again (FSDP's
        reshard_after_forward=False): one all-gather per group fewer, and every
        group's weights whole on each device until the backward has used them.
      moe: Mixture-of-experts layers (none by default).
    """

    vocab_size: int = 259
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None
    d_ff: int = 384
    rope_theta: float = 10_000.0
    rope_scaling: tuple[float, ...] = ()
    qk_norm: bool = False
    qkv_bias: bool = False
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    init_std: float = 0.02
    dtype: Literal["float32", "bfloat16"] = "float32"
    grad_reduce_dtype: Literal["compute", "float32"] = "compute"
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    attention: Literal["einsum", "flash"] = "einsum"
    context_attention: Literal["ring", "all_gather"] = "ring"
    context_order: Literal["zigzag", "contiguous"] = "zigzag"
    vocab_multiple: int = 128
    padded_vocab_size: int | None = None
    layer_group: int = 1
    stages: int = 1
    repeats: int = 1
    prefetch: bool = False
    keep_gathered: bool = False
    moe: MoEConfig = MoEConfig()

    def __post_init__(self):
        object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))   # JSON gives lists
        _at_least(self, 1, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                  "vocab_multiple", "layer_group", "stages", "repeats")
        _finite_positive(self, "init_std", "norm_eps", "rope_theta")
        _require(not self.rope_scaling or (len(self.rope_scaling) == 4
                                           and 0 < self.rope_scaling[1] < self.rope_scaling[2]),
                 f"rope_scaling={self.rope_scaling} must be (factor, low_freq_factor, "
                 "high_freq_factor, original context) with low < high")
        _require(self.attention in ATTENTION_PATHS,
                 f"attention={self.attention!r}; choose one of {ATTENTION_PATHS}")
        _require(self.context_attention in CONTEXT_STRATEGIES,
                 f"context_attention={self.context_attention!r}; choose one of "
                 f"{CONTEXT_STRATEGIES}")
        _require(self.context_order in CONTEXT_ORDERS,
                 f"context_order={self.context_order!r}; choose one of {CONTEXT_ORDERS}")
        _require(self.grad_reduce_dtype in ("compute", "float32"),
                 f"grad_reduce_dtype={self.grad_reduce_dtype!r}; choose compute or float32")
        _require(self.remat in REMAT_POLICIES,
                 f"remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        _require(self.n_heads % self.n_kv_heads == 0,
                 f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        _require(self.head_dim is not None or self.d_model % self.n_heads == 0,
                 f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set "
                 "head_dim")
        _require(self.resolved_head_dim > 0 and self.resolved_head_dim % 2 == 0,
                 f"head_dim={self.resolved_head_dim} must be even and > 0 for RoPE")
        _require(not (self.prefetch and self.keep_gathered),
                 "prefetch gathers each group in both passes; keep_gathered needs prefetch off")
        _require(not (self.moe.n_experts and self.layer_group > 1 and self.moe.every > 1),
                 f"the owner layout (layer_group={self.layer_group}) gathers each stack group "
                 "by group, so it needs the dense and MoE layers in two runs (moe.every=1), "
                 f"not moe.every={self.moe.every}; use the fsdp, replicated or layerwise layout")
        _require(self.stages <= self.n_layers,
                 f"{self.stages} pipeline stages for {self.n_layers} layers: use at most one "
                 "stage per layer")
        _require(self.repeats == 1 or self.stages > 1,
                 f"repeats={self.repeats} chunks a stage needs pipeline stages (stages > 1)")
        _require(self.stages * self.repeats <= self.n_layers,
                 f"{self.stages} pipeline stages of {self.repeats} chunks for {self.n_layers} "
                 "layers: use at most one chunk per layer")
        _require(self.stages == 1 or not self.moe.n_experts or self.moe.every == 1,
                 f"pipeline stages ({self.stages}) run each layer stack whole, so they need "
                 "the dense and MoE layers in two runs (moe.every=1), not "
                 f"moe.every={self.moe.every}")
        _require(not self.moe.n_experts or any(self.moe_layers),
                 f"moe.first_dense={self.moe.first_dense} and moe.every={self.moe.every} leave "
                 f"no MoE layer among {self.n_layers}")
        _require(self.vocab >= self.vocab_size,
                 f"padded_vocab_size={self.padded_vocab_size} < vocab_size={self.vocab_size}")

    @property
    def weight_grad_dtype(self) -> str | None:
        """The dtype matmul weights' gradients are computed in where it is not their
        compute dtype (``grad_reduce_dtype``); None: the compute dtype."""
        wide = self.grad_reduce_dtype
        return None if wide in ("compute", self.dtype) else wide

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def vocab(self) -> int:
        """Rows of the embedding table (the padded vocabulary)."""
        return self.padded_vocab_size or self.vocab_size

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (G = N / K)."""
        return self.n_heads // self.n_kv_heads

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: True where the MLP is a mixture of experts."""
        m = self.moe
        return tuple(bool(m.n_experts) and i >= m.first_dense
                     and (i - m.first_dense + 1) % m.every == 0 for i in range(self.n_layers))

    @property
    def dense_layers(self) -> int:
        """Layers with a dense MLP (the ``blocks`` stack)."""
        return self.n_layers - sum(self.moe_layers)

    def pad_vocab(self, tensor: int = 1) -> "GPTConfig":
        """Pads the vocabulary to a multiple of ``vocab_multiple * tensor`` (Megatron)."""
        multiple = self.vocab_multiple * tensor
        padded = -(-self.vocab_size // multiple) * multiple
        return dataclasses.replace(self, padded_vocab_size=padded)

    def logical_dims(self) -> dict[str, int]:
        """Size of each logical parameter axis (for divisibility checks)."""
        m = self.moe
        # Every MLP width is split over the same axes; their gcd divides exactly when all do.
        widths = ([self.d_ff] if not all(self.moe_layers) else []) + (
            [m.d_ff] + ([m.shared_d_ff] if m.shared_d_ff else []) if m.n_experts else [])
        per_stage = -(-self.n_layers // self.stages)
        dims = {"stages": self.stages,
                "layer_groups": -(-per_stage // self.layer_group), "layers": self.layer_group,
                "embed": self.d_model, "mlp": math.gcd(*widths),
                "heads": self.n_heads, "kv_heads": self.n_kv_heads,
                "head_dim": self.resolved_head_dim, "vocab": self.vocab}
        return {**dims, "experts": m.n_experts} if m.n_experts else dims

    def param_count(self) -> int:
        """Number of parameters (the padded vocabulary included)."""
        d, f, h = self.d_model, self.d_ff, self.resolved_head_dim
        qkv = d * (self.n_heads + 2 * self.n_kv_heads) * h
        block = (qkv + self.n_heads * h * d + 2 * d + (2 * h if self.qk_norm else 0)
                 + ((self.n_heads + 2 * self.n_kv_heads) * h if self.qkv_bias else 0))
        m = self.moe
        moe_mlp = (m.n_experts * 3 * d * m.d_ff + d * m.n_experts + 3 * d * m.shared_d_ff
                   + (m.n_experts if m.bias_rate else 0))
        mlps = sum(moe_mlp if moe else 3 * d * f for moe in self.moe_layers)
        head = 0 if self.tie_embeddings else d * self.vocab
        return self.vocab * d + self.n_layers * block + mlps + d + head

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward = 3x forward matmuls).

        Counts the matmuls of the projections, the attention scores and values
        (causal half not subtracted, as PaLM's MFU counts it), and the head; an
        MoE layer counts its router and the k experts a token is routed to.
        """
        d, f, h, n = self.d_model, self.d_ff, self.resolved_head_dim, self.n_heads
        m = self.moe
        proj = d * (n + 2 * self.n_kv_heads) * h + n * h * d
        attn = 2 * n * h * seq_len
        moe_mlp = 3 * d * (m.top_k * m.d_ff + m.shared_d_ff) + d * m.n_experts
        mlps = sum(moe_mlp if moe else 3 * d * f for moe in self.moe_layers)
        forward = 2 * (self.n_layers * (proj + attn) + mlps + d * self.vocab)
        return 3 * forward
