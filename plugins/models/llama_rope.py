"""The Llama family's rotary frequencies: the textbook default, every scaled variant
through ``transformers``' own rope initialisation functions (not a copy of them)."""

from __future__ import annotations

import math
from typing import Any

import torch

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.plugin_system.protocols import RotaryCache

# rope types implemented ("dynamic" only up to max_position_embeddings: see check_max_model_len)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[head_size/2]`` in float32, the factor cos and sin are scaled by).

    The default rope is the textbook formula (as transformers writes it); every
    scaled variant calls transformers' own ``ROPE_INIT_FUNCTIONS``. GGUF
    ``rope_freqs`` divide the result, as llama.cpp does.
    """
    dim = cfg.head_size
    rope_type = cfg.rope_type
    if rope_type == "default":
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq, attention_scaling = 1.0 / (cfg.rope_theta**exponent), 1.0
    elif rope_type in SUPPORTED_ROPE_TYPES:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](_hf_rope_config(cfg), "cpu")
        inv_freq = inv_freq.float()
    else:
        raise ModelLoadError(
            f"rope_type={rope_type!r} is not supported; pitstop implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if cfg.rope_freq_factors is not None:
        if len(cfg.rope_freq_factors) != dim // 2:
            raise ModelLoadError(
                f"rope_freqs has {len(cfg.rope_freq_factors)} factors; head size {dim} needs {dim // 2}"
            )
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    if not bool(torch.isfinite(inv_freq).all()) or not math.isfinite(attention_scaling):
        raise ModelLoadError(
            f"the rope parameters {cfg.rope_scaling!r} give non-finite frequencies"
        )
    return inv_freq, float(attention_scaling)


def _hf_rope_config(cfg: ModelConfig) -> Any:
    """A transformers config that carries ``cfg``'s rope, for ROPE_INIT_FUNCTIONS."""
    import transformers

    scaling = {k: v for k, v in (cfg.rope_scaling or {}).items() if k != "type"}
    common: dict[str, Any] = dict(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_size,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    if hasattr(transformers.LlamaConfig, "standardize_rope_params"):  # transformers >= 5
        return transformers.LlamaConfig(
            **common, rope_parameters={"rope_theta": cfg.rope_theta, **scaling}
        )
    return transformers.LlamaConfig(**common, rope_theta=cfg.rope_theta, rope_scaling=scaling)


def rotary_cache(cfg: ModelConfig, max_positions: int, device: torch.device) -> RotaryCache:
    """cos/sin tables ``[max_positions, head_size/2]`` in float32, with the model's rope scaling.

    ``max_positions`` is the engine's ``max_model_len``: a model that would compute
    something else than transformers at that length is refused here
    (:meth:`ModelConfig.check_max_model_len`), before any weight loads.
    """
    cfg.check_max_model_len(max_positions)
    inv_freq, attention_scaling = rope_frequencies(cfg)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if attention_scaling != 1.0:  # yarn scales q and k through cos and sin, as transformers does
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return RotaryCache(cos=cos.to(device), sin=sin.to(device))
