"""Flax NNX Transformer models, their sharded creation and losses."""

from jmegatron.models.config import GPTConfig
from jmegatron.models.gpt import GPT
from jmegatron.models.loss import (TokenLoss, cross_entropy, dense_token_loss,
                                   vocab_parallel_token_loss)
from jmegatron.models.sharded import create_sharded, state_shardings, validate_sharding

__all__ = [
    "GPTConfig", "GPT", "cross_entropy", "dense_token_loss", "vocab_parallel_token_loss",
    "TokenLoss", "create_sharded", "state_shardings",
    "validate_sharding",
]
