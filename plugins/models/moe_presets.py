"""Named mixture-of-experts shapes for ``dummy:<preset>`` models (random weights, for benchmarks).

Each is copied from the model's published ``config.json``, as
:mod:`.llama_presets` does for the dense ones.
"""

from __future__ import annotations

from pitstop.plugins.models.moe_config import MoEModelConfig

PRESETS: dict[str, MoEModelConfig] = {
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active a token
    "qwen3-30b-a3b": MoEModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,  # the dense layers' width; it has none (mlp_only_layers=[])
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_size=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        bos_token_id=151643,
        # <|im_end|> ends a chat turn, <|endoftext|> a document (as the dense Qwen3 presets)
        eos_token_ids=(151645, 151643),
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        sparse_layers=tuple(range(48)),
    ),
    # mistralai/Mixtral-8x7B-Instruct-v0.1: 46.7B parameters, 12.9B active a token
    "mixtral-8x7b": MoEModelConfig(
        architecture="MixtralForCausalLM",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        norm_topk_prob=True,
        sparse_layers=tuple(range(32)),
        routing_weights_float32=True,
    ),
}
