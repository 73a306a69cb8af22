"""The Llama family's named shapes for ``dummy:<preset>`` models (random weights, for benchmarks).

Speed does not depend on the values of the weights, so a benchmark can run a
model of the exact shape of a real checkpoint without downloading it. Each
shape is copied from the model's published ``config.json``. The family
registers each with its architecture (``Architecture.presets``), and the
loader finds them through the registry.
"""

from __future__ import annotations

from pitstop.ground.model_config import ModelConfig

# Qwen3 ends a chat turn with <|im_end|> (151645); <|endoftext|> (151643) ends a document.
_QWEN3_EOS = (151645, 151643)


def _qwen3(**shape: int | bool) -> ModelConfig:
    """A Qwen3 shape: what the family shares, plus the sizes that differ."""
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        num_kv_heads=8,
        head_size=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        bos_token_id=151643,
        eos_token_ids=_QWEN3_EOS,
        **shape,
    )


PRESETS: dict[str, ModelConfig] = {
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": _qwen3(
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": _qwen3(
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-32B
    "qwen3-32b": _qwen3(
        hidden_size=5120,
        intermediate_size=25600,
        num_layers=64,
        num_heads=64,
        tie_word_embeddings=False,
    ),
    # meta-llama/Llama-3.1-8B-Instruct (the llama3 rope scaling arrived with 3.1)
    "llama3-8b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
}
