"""A tiny third-party model architecture: ``BigramForCausalLM``.

Each token's logits depend on that token alone: ``logits = lm_head(embed(token))``.
It has no attention, so it reads neither the rotary tables nor the KV cache the
runner hands it; it exists to show what a model plugin provides: a factory,
and an :class:`~pitstop.plugin_system.architecture.Architecture` that says how its
``config.json`` and its GGUF files are read and which tensors its checkpoint holds.

``config.json``: ``{"model_type": "bigram", "architectures":
["BigramForCausalLM"], "vocab_size": V, "hidden_size": H}``; tensors
``model.embed_tokens.weight`` and ``lm_head.weight``, both ``[V, H]``.

A GGUF file: ``general.architecture = "bigram"``, ``bigram.embedding_length = H``
(and optionally ``bigram.context_length``), a tokenizer in the usual
``tokenizer.ggml.*`` fields, tensors ``token_embd.weight`` and ``output.weight``
(llama.cpp's names for the two), each ``[V, H]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.plugin_system.architecture import Architecture, GGUFRules
from pitstop.plugin_system.protocols import RotaryCache
from pitstop.plugins.model_sources.gguf.file import GGUFModelFile

ARCHITECTURE = "BigramForCausalLM"


GGUF_ARCHITECTURE = "bigram"  # general.architecture of its GGUF files
MAX_SIZE = 2**20
# llama.cpp's names of its two tensors -> the Hugging Face names the model loads
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
}
GGUF_KEYS = (f"{GGUF_ARCHITECTURE}.embedding_length", f"{GGUF_ARCHITECTURE}.context_length")


def _bigram_config(
    vocab: int, hidden: int, max_positions: int, eos: tuple[int, ...], bos: int | None = None
) -> ModelConfig:
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=1,
        num_layers=1,  # the runner sizes a KV cache by these; the model never reads it
        num_heads=1,
        num_kv_heads=1,
        head_size=2,
        max_position_embeddings=max_positions,
        bos_token_id=bos,
        eos_token_ids=eos,
    )


def config_from_hf(raw: Mapping[str, Any], where: str) -> ModelConfig:
    """The shape of a bigram model from its ``config.json``; a missing or bad size is an error."""
    sizes = {}
    for key in ("vocab_size", "hidden_size"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            raise ModelLoadError(
                f"{where}: {key} must be an integer from 1 to 2**20, got {value!r}"
            )
        sizes[key] = value
    return _bigram_config(
        sizes["vocab_size"],
        sizes["hidden_size"],
        int(raw.get("max_position_embeddings", 4096)),
        tuple(raw.get("eos_token_id") or ()),
    )


def config_from_gguf(file: GGUFModelFile) -> ModelConfig:
    """The shape of a bigram model from a GGUF file's metadata and its embedding's shape;
    a ``bigram.*`` field it does not read, or a size that disagrees, is an error."""
    for key in file.keys:
        if key.startswith(f"{GGUF_ARCHITECTURE}.") and key not in GGUF_KEYS:
            raise ModelLoadError(
                f"GGUF file {file.path}: {key} is not a bigram field; it reads {', '.join(GGUF_KEYS)}"
            )
    hidden = file.count(GGUF_KEYS[0], MAX_SIZE)
    shape = file.tensor_shapes.get("token_embd.weight")
    if shape is None or len(shape) != 2 or shape[1] != hidden or not 1 <= shape[0] <= MAX_SIZE:
        raise ModelLoadError(
            f"GGUF file {file.path}: token_embd.weight has shape {shape}, not "
            f"[vocabulary, {GGUF_KEYS[0]}={hidden}]"
        )
    max_positions = file.count(GGUF_KEYS[1], 2**31 - 1, default=4096)
    return _bigram_config(shape[0], hidden, max_positions, file.eos_token_ids, file.bos_token_id)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The two tensors of a bigram checkpoint."""
    shape = (config.vocab_size, config.hidden_size)
    return {"model.embed_tokens.weight": shape, "lm_head.weight": shape}


def no_rotary(config: ModelConfig, max_positions: int, device: torch.device) -> RotaryCache:
    """Empty tables: the model has no attention to rotate."""
    del config
    empty = torch.zeros(max_positions, 1, device=device)
    return RotaryCache(cos=empty, sin=empty)


class BigramForCausalLM(nn.Module):
    """``logits[t] = lm_head(embed(token[t]))``."""

    def __init__(self, config: ModelConfig, kernels: Any) -> None:
        super().__init__()
        self.config, self.kernels = config, kernels
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))

    def forward(self, input_ids: torch.Tensor, rotary: Any, kv_cache: Any, meta: Any) -> Any:
        """The hidden state of each input token: its embedding."""
        del rotary, kv_cache, meta
        return self.embed_tokens[input_ids]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the selected rows, through the kernel set's GEMM."""
        return self.kernels.linear(hidden, self.lm_head)

    def init_dummy(self, seed: int) -> None:
        """Seeded random weights."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in (self.embed_tokens, self.lm_head):
                p.copy_(torch.randn(p.shape, generator=generator))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's two tensors (the loader checked names and shapes)."""
        params = {"model.embed_tokens.weight": self.embed_tokens, "lm_head.weight": self.lm_head}
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)


def make_bigram(config: ModelConfig, kernels: Any) -> BigramForCausalLM:
    """A bigram language model: each token's logits depend on that token alone."""
    return BigramForCausalLM(config, kernels)


BIGRAM = Architecture(
    config_from_hf=config_from_hf,
    weight_shapes=weight_shapes,
    rotary=no_rotary,
    model_types=("bigram",),
    presets={"bigram-tiny": _bigram_config(64, 8, 4096, ())},  # dummy:bigram-tiny
    gguf=GGUFRules(
        architectures=(GGUF_ARCHITECTURE,),
        config=config_from_gguf,
        tensor_name=GGUF_TENSOR_NAMES.get,
    ),
)
