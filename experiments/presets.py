"""Named starting points for `python -m experiments.train --preset NAME`.

Presets are plain functions returning a TrainConfig; any field can then be
overridden on the command line.
"""

from jmegatron.models import GPTConfig, MoEConfig
from jmegatron.sharding import MeshConfig
from jmegatron.train import ScheduleConfig, TrainConfig


def tiny() -> TrainConfig:
    """The default: a small byte-level GPT on the Python stdlib, a few CPU minutes."""
    return TrainConfig(
        model=GPTConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384),
        steps=300, batch_size=32, seq_len=128, eval_every=100, lr=3e-3,
        schedule=ScheduleConfig(warmup_steps=30))


def gpt2_small() -> TrainConfig:
    """GPT-2 small sized (12 x 768, 12 heads), for accelerators."""
    return TrainConfig(
        model=GPTConfig(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048,
                        dtype="bfloat16"),
        steps=5000, batch_size=64, seq_len=1024, eval_every=500, eval_batches=8, lr=6e-4,
        schedule=ScheduleConfig(warmup_steps=200))


def dense_1b() -> TrainConfig:
    """A dense 0.89B Llama-shaped model (16 x 2048, GQA 16/8, SwiGLU 5632, a 32k
    vocabulary) for one accelerator: bf16 compute, activations recomputed but for
    the matmul outputs (remat dots)."""
    return TrainConfig(
        model=GPTConfig(vocab_size=32_000, d_model=2048, n_layers=16, n_heads=16,
                        n_kv_heads=8, d_ff=5632, dtype="bfloat16", remat="dots"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        steps=5000, batch_size=8, seq_len=2048, eval_every=500, eval_batches=4, lr=3e-4,
        schedule=ScheduleConfig(warmup_steps=200))


def qwen3_moe_small() -> TrainConfig:
    """A Qwen3-MoE shaped model for one accelerator (12 x 1024, QK-norm, GQA 16/4, 32
    experts of width 512, top-4, in every layer; a 32k vocabulary; 0.70B parameters,
    0.17B of them used per token, embeddings included), bf16 compute."""
    return TrainConfig(
        model=GPTConfig(vocab_size=32_000, d_model=1024, n_layers=12, n_heads=16,
                        n_kv_heads=4, d_ff=2816, qk_norm=True, dtype="bfloat16",
                        moe=MoEConfig(n_experts=32, top_k=4, d_ff=512, every=1)),
        mesh=MeshConfig(data=1, fsdp=1, expert=-1, tensor=1),
        steps=5000, batch_size=8, seq_len=2048, eval_every=500, eval_batches=4, lr=3e-4,
        schedule=ScheduleConfig(warmup_steps=200))


def bench() -> TrainConfig:
    """Fixed settings for throughput measurements (no evaluation in the timed steps)."""
    return TrainConfig(
        model=GPTConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768),
        steps=50, batch_size=32, seq_len=256, eval_every=1000, eval_batches=1, log_every=5,
        sample_tokens=16, progress=False)


def qwen3_moe_tiny() -> TrainConfig:
    """A small Qwen3-MoE style model (QK-norm; 8 experts, top-2, every second layer MoE)
    with data x expert parallelism (the expert axis takes the devices data leaves)."""
    return TrainConfig(
        model=GPTConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384,
                        qk_norm=True, moe=MoEConfig(n_experts=8, top_k=2, d_ff=128, every=2)),
        mesh=MeshConfig(data=2, fsdp=1, expert=-1, tensor=1),
        steps=300, batch_size=32, seq_len=128, eval_every=100, lr=3e-3,
        schedule=ScheduleConfig(warmup_steps=30))


PRESETS = {"tiny": tiny, "gpt2-small": gpt2_small, "dense-1b": dense_1b, "bench": bench,
           "qwen3-moe-tiny": qwen3_moe_tiny, "qwen3-moe-small": qwen3_moe_small}
