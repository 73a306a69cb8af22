"""The Llama family's checkpoint names and shapes: Hugging Face tensor names -> the
model's parameters (merged q/k/v and gate/up or not), every tensor's expected shape,
and the seeded dummy weights the benchmarks use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import ModelConfig


def expected_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor a checkpoint of ``cfg`` holds
    (``lm_head.weight`` only when the head is not tied)."""
    h, d, f = cfg.hidden_size, cfg.head_size, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            layer |= {
                "self_attn.q_proj.bias": (q,),
                "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.bias": (kv,),
            }
        if cfg.o_proj_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            layer |= {
                "mlp.gate_proj.bias": (f,),
                "mlp.up_proj.bias": (f,),
                "mlp.down_proj.bias": (h,),
            }
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        shapes |= {p + name: shape for name, shape in layer.items()}
    return shapes


def ignored_checkpoint_tensor(name: str) -> bool:
    """Tensors a checkpoint may carry that hold nothing the model needs (transformers
    skips them too): the rotary ``inv_freq`` buffers, recomputed from the config."""
    return name.endswith("rotary_emb.inv_freq")


def map_hf_name(cfg: ModelConfig, merged: bool, name: str) -> tuple[str | None, int | None]:
    """HF name -> (parameter name, row offset into a merged weight or None); (None, None)
    for a name the model has no place for. ``merged``: q/k/v and gate/up are one weight each."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens", None
    if name == "model.norm.weight":
        return "norm", None
    if name == "lm_head.weight":
        return (None, None) if cfg.tie_word_embeddings else ("lm_head", None)
    if not name.startswith("model.layers."):
        return None, None
    rest = name[len("model.layers.") :]
    idx, _, local = rest.partition(".")
    p = f"layers.{idx}."
    q_size = cfg.num_heads * cfg.head_size
    kv_size = cfg.num_kv_heads * cfg.head_size
    f = cfg.intermediate_size
    table = {
        "input_layernorm.weight": ("input_layernorm", None),
        "post_attention_layernorm.weight": ("post_attention_layernorm", None),
        "self_attn.o_proj.weight": ("self_attn.o_proj", None),
        "self_attn.o_proj.bias": ("self_attn.o_bias", None),
        "self_attn.q_norm.weight": ("self_attn.q_norm", None),
        "self_attn.k_norm.weight": ("self_attn.k_norm", None),
        "mlp.down_proj.weight": ("mlp.down_proj", None),
        "mlp.down_proj.bias": ("mlp.down_bias", None),
    }
    if merged:
        table |= {
            "self_attn.q_proj.weight": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj", q_size),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj", q_size + kv_size),
            "self_attn.q_proj.bias": ("self_attn.qkv_bias", 0),
            "self_attn.k_proj.bias": ("self_attn.qkv_bias", q_size),
            "self_attn.v_proj.bias": ("self_attn.qkv_bias", q_size + kv_size),
            "mlp.gate_proj.weight": ("mlp.gate_up_proj", 0),
            "mlp.up_proj.weight": ("mlp.gate_up_proj", f),
            "mlp.gate_proj.bias": ("mlp.gate_up_bias", 0),
            "mlp.up_proj.bias": ("mlp.gate_up_bias", f),
        }
    else:
        table |= (
            {f"self_attn.{x}_proj.weight": (f"self_attn.{x}_proj", None) for x in "qkv"}
            | {f"self_attn.{x}_proj.bias": (f"self_attn.{x}_bias", None) for x in "qkv"}
            | {f"mlp.{x}_proj.weight": (f"mlp.{x}_proj", None) for x in ("gate", "up")}
            | {f"mlp.{x}_proj.bias": (f"mlp.{x}_bias", None) for x in ("gate", "up")}
        )
    if local not in table:
        return None, None
    target, offset = table[local]
    return p + target, offset


def dummy_weights(
    shapes: dict[str, tuple[int, ...]], seed: int, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random tensors of ``shapes`` (name -> shape), drawn in order from one seeded generator:
    norm weights are ones, every other tensor N(0, 0.02). The same shapes and seed give the
    same values, whichever part of each tensor a tensor-parallel rank then keeps."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():
        if len(shape) == 1 and not name.endswith("bias"):
            yield name, torch.ones(shape, dtype=dtype, device=device)  # norm weights
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            yield name, t.normal_(0.0, 0.02, generator=gen)


def _same_tensor(resident: Any, weight: torch.Tensor) -> bool:
    """Whether a weight format handed ``weight`` back as it is (kept dense)."""
    return (
        isinstance(resident, torch.Tensor)
        and resident.data_ptr() == weight.data_ptr()
        and resident.shape == weight.shape
        and resident.dtype == weight.dtype
    )


def check_tied_head(tied_head: torch.Tensor, embed: torch.Tensor) -> None:
    """A tied checkpoint's ``lm_head.weight`` must equal the embedding it is tied to."""
    same = tuple(tied_head.shape) == tuple(embed.shape) and torch.equal(
        tied_head.to(device=embed.device, dtype=embed.dtype), embed.data
    )
    if not same:
        raise ModelLoadError(
            "the config ties the output head to the embedding (tie_word_embeddings=true), "
            "but the checkpoint's lm_head.weight differs from model.embed_tokens.weight; "
            "fix tie_word_embeddings in config.json"
        )
