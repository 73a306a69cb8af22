"""Helpers of the rollout tests: SmolLM2 as a Hugging Face folder (import them:
``from helpers.rollout import ...``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from helpers.models import smollm2_tokenizer_dir

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def smollm2_weights() -> dict[str, torch.Tensor]:
    """SmolLM2-135M-Instruct's tensors in Hugging Face names (fp32, dequantized once)."""
    from safetensors.torch import load_file

    return load_file(str(smollm2_tokenizer_dir() / "model.safetensors"))


def smollm2_folder(dest: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A Hugging Face folder of SmolLM2 (config.json, tokenizer, model.safetensors) at
    ``dest``; ``tensors``: the weights to save instead of the original ones."""
    import transformers
    from safetensors.torch import save_file

    src = smollm2_tokenizer_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=9.999999747378752e-06,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    ).save_pretrained(dest)
    if tensors is None:
        shutil.copy(src / "model.safetensors", dest / "model.safetensors")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))
    return dest
