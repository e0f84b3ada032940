"""Flax NNX Transformer models, their sharded creation and losses."""

from jmegatron.models import hf
from jmegatron.models.config import GPTConfig, MoEConfig
from jmegatron.models.gpt import GPT
from jmegatron.models.loss import (TokenLoss, cross_entropy, dense_token_loss,
                                   vocab_parallel_token_loss)
from jmegatron.models.moe import MoE, MoEBlock, balance_expert_bias, moe_losses
from jmegatron.models.qk_clip import clip_scales, qk_clip, qk_clipper
from jmegatron.models.sharded import create_sharded, state_shardings, validate_sharding

__all__ = [
    "GPTConfig", "MoEConfig", "GPT", "cross_entropy", "dense_token_loss",
    "vocab_parallel_token_loss", "MoE", "MoEBlock", "moe_losses", "balance_expert_bias",
    "TokenLoss", "create_sharded", "state_shardings",
    "validate_sharding", "qk_clip", "qk_clipper", "clip_scales", "hf",
]
