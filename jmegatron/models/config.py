"""Model configuration (sizes only; nothing here knows about meshes)."""

from __future__ import annotations

import dataclasses
from typing import Literal

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A pre-norm decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

    vocab_size: int = 259
    """Token ids the data can hold (byte tokenizer: 256 bytes + BOS/EOS/PAD)."""
    d_model: int = 128
    """Model width D."""
    n_layers: int = 2
    """Number of decoder blocks L."""
    n_heads: int = 4
    """Query heads N."""
    n_kv_heads: int = 2
    """Key/value heads K (grouped-query attention; N must be a multiple)."""
    head_dim: int | None = None
    """Head width H (default d_model // n_heads)."""
    d_ff: int = 384
    """SwiGLU hidden width F."""
    rope_theta: float = 10_000.0
    qk_norm: bool = False
    """RMSNorm on queries and keys of each head (Qwen3)."""
    tie_embeddings: bool = False
    """Use the embedding table as the output head."""
    norm_eps: float = 1e-6
    init_std: float = 0.02
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of matmuls; parameters always stay fp32."""
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    """Activation recomputation in the backward pass: none, full, dots, dots_no_batch."""
    vocab_multiple: int = 128
    """The embedding table is padded to a multiple of this x tensor (Megatron)."""
    padded_vocab_size: int | None = None
    """Set by `pad_vocab` from vocab_multiple and the tensor size; leave unset."""
    layer_group: int = 1
    """Stack block weights as [L/g, g, ...] (set by the owner layout to the fsdp size)."""

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}; set head_dim")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim} must be even for RoPE")
        if self.layer_group < 1 or self.n_layers % self.layer_group:
            raise ValueError(f"n_layers={self.n_layers} is not divisible by layer_group="
                             f"{self.layer_group} (the owner layout groups one layer per fsdp "
                             "rank; use another layout or an fsdp size dividing n_layers)")
        if self.vocab < self.vocab_size:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} < "
                             f"vocab_size={self.vocab_size}")

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

    def pad_vocab(self, tensor: int = 1) -> "GPTConfig":
        """Pads the vocabulary to a multiple of ``vocab_multiple * tensor`` (Megatron)."""
        multiple = self.vocab_multiple * tensor
        padded = -(-self.vocab_size // multiple) * multiple
        return dataclasses.replace(self, padded_vocab_size=padded)

    def logical_dims(self) -> dict[str, int]:
        """Size of each logical parameter axis (for divisibility checks)."""
        return {"layer_groups": self.n_layers // self.layer_group, "layers": self.layer_group,
                "embed": self.d_model, "mlp": self.d_ff,
                "heads": self.n_heads, "kv_heads": self.n_kv_heads,
                "head_dim": self.resolved_head_dim, "vocab": self.vocab}

    def param_count(self) -> int:
        """Number of parameters (the padded vocabulary included)."""
        d, f, h = self.d_model, self.d_ff, self.resolved_head_dim
        qkv = d * (self.n_heads + 2 * self.n_kv_heads) * h
        block = qkv + self.n_heads * h * d + 3 * d * f + 2 * d + (2 * h if self.qk_norm else 0)
        head = 0 if self.tie_embeddings else d * self.vocab
        return self.vocab * d + self.n_layers * block + d + head

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward = 3x forward matmuls).

        Counts the matmuls of the projections, the attention scores and values
        (causal half not subtracted, as PaLM's MFU counts it), and the head.
        """
        d, f, h, n = self.d_model, self.d_ff, self.resolved_head_dim, self.n_heads
        proj = d * (n + 2 * self.n_kv_heads) * h + n * h * d + 3 * d * f
        attn = 2 * n * h * seq_len
        forward = 2 * (self.n_layers * (proj + attn) + d * self.vocab)
        return 3 * forward
