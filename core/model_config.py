"""`ModelConfig`: the shape of a Llama-family model, read from a checkpoint or a preset."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Architecture and shape of a decoder-only model.

    ``architecture`` is the name a checkpoint's ``config.json`` gives
    (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``); the
    plugin manager maps it to a model factory.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_params(self) -> int:
        """Parameter count, embeddings included (output head counted once when tied)."""
        attn = self.hidden_size * self.head_size * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in elements (multiply by the dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        model_type = cfg.get("model_type", "")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_size=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get(
                "rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            ),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(
                cfg.get("attention_bias", model_type == "qwen2" or arch == "Qwen2ForCausalLM")
            ),
            qk_norm=arch == "Qwen3ForCausalLM" or model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
