"""How the Llama family (Llama, Qwen2, Qwen3) reads a GGUF file (llama.cpp's format).

llama.cpp names tensors ``blk.N.attn_q.weight`` and so on (:func:`hf_tensor_name`
maps them to Hugging Face names) and keeps the model's shape in
``{arch}.*`` metadata (:func:`config_from_gguf` reads every such field and refuses
one it does not implement). Its converter permutes the rows of a Llama model's
``attn_q`` and ``attn_k`` for its rotary layout; :func:`unpermute_rotary_rows`
undoes that (Qwen2 and Qwen3 GGUFs use the NeoX layout and are stored
unpermuted). Llama 3's rope scaling arrives as a ``rope_freqs`` tensor, read
into :attr:`ModelConfig.rope_freq_factors`.
"""

from __future__ import annotations

import re

import numpy as np

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import MAX_DIM, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, ModelConfig
from pitstop.plugin_system.architecture import GGUFRules
from pitstop.plugins.model_sources.gguf.file import GGUFModelFile
from pitstop.plugins.models.llama_config import HF_MODEL_TYPES, HeadFields
from pitstop.plugins.models.llama_config import head_size as checked_head_size

# general.architecture -> the Hugging Face architecture name the model registry knows
# (llama.cpp names the family's members as their config.json model_type does)
GGUF_ARCHITECTURES = dict(HF_MODEL_TYPES)
# Architectures whose q/k rows llama.cpp's converter permuted (the others keep HF order).
PERMUTED_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp's Llama 3 rope scaling: read into ModelConfig.rope_freq_factors, not a weight.
ROPE_FREQS = "rope_freqs.weight"

# ``{arch}.`` metadata keys and what pitstop does with each; any other such key is refused.
_ARCH_KEYS_READ = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "vocab_size",
    "expert_count",
    "expert_used_count",
)
_ARCH_KEYS_WITHOUT_EFFECT = ("rope.scaling.finetuned",)
# GGUF rope scaling types implemented (llama.cpp's yarn differs from transformers' in details)
GGUF_ROPE_SCALING = ("none", "linear")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for a tensor the models do not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a q or k projection (weight or bias).

    llama.cpp's ``convert_hf_to_gguf.py`` turns each head's rows ``[first half,
    second half]`` (HF's rotate-half layout) into interleaved pairs: it views the
    rows as ``(heads, 2, head_size/2)`` and swaps the last two axes. The inverse
    views them as ``(heads, head_size/2, 2)`` and swaps back.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"a q/k tensor of {rows} rows does not split into {num_heads} heads")
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def unpermute_llama_qk(name: str, tensor: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A Llama GGUF's q and k projections back in Hugging Face row order (others unchanged)."""
    if ".self_attn.q_proj." in name:
        return unpermute_rotary_rows(tensor, config.num_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_rotary_rows(tensor, config.num_kv_heads)
    return tensor


def llama_qk_row_order(name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """The row order :func:`unpermute_llama_qk` gives a tensor of ``rows`` rows (None: it
    keeps the tensor as it is): a permutation of whole rows, so a weight kept in its
    quantized blocks is reordered exactly, without dequantizing."""
    if ".self_attn.q_proj." not in name and ".self_attn.k_proj." not in name:
        return None
    return unpermute_llama_qk(name, np.arange(rows), config)


def is_rope_freqs(gguf_name: str) -> bool:
    """llama.cpp's ``rope_freqs``: part of the config, not a weight."""
    return gguf_name == ROPE_FREQS


def config_from_gguf(file: GGUFModelFile) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama, Qwen2 or Qwen3 GGUF file, from its metadata
    and tensor shapes.

    Every metadata field that shapes the model is checked (present, a positive whole
    number below a bound, consistent with the others), and every other ``{arch}.``
    field is refused unless it is known to have no effect.
    """
    path, meta, arch = file.path, file.metadata, file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path} holds a model of architecture {arch!r}; pitstop's Llama family "
            f"reads {', '.join(GGUF_ARCHITECTURES)}"
        )
    tensors = file.tensor_shapes
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(
            f"GGUF file {path} has no token_embd.weight tensor; it is not a complete model"
        )
    known = {f"{arch}.{k}" for k in _ARCH_KEYS_READ + _ARCH_KEYS_WITHOUT_EFFECT}
    for key in file.keys:
        if key.startswith(f"{arch}.") and key not in known:
            value = meta.get(key, "<array>")
            raise ModelLoadError(
                f"GGUF file {path}: metadata field {key}={value!r} is not implemented by pitstop; "
                f"it reads {', '.join(sorted(known))}"
            )
    for key in (f"{arch}.expert_count", f"{arch}.expert_used_count"):
        if meta.get(key, 0) not in (0, None):
            raise ModelLoadError(
                f"GGUF file {path}: {key}={meta[key]!r}; pitstop does not run mixture-of-experts models"
            )

    k = f"{arch}."
    hidden = file.count(k + "embedding_length", MAX_DIM)
    heads = file.count(k + "attention.head_count", MAX_DIM)
    kv_heads = file.count(k + "attention.head_count_kv", MAX_DIM, default=heads)
    fields = HeadFields(
        hidden=f"{k}embedding_length",
        heads=f"{k}attention.head_count",
        kv_heads=f"{k}attention.head_count_kv",
        head_size_absent=f"{k}attention.key_length is absent",
        odd="the head size {} is odd",
    )
    head_size = checked_head_size(
        f"GGUF file {path}",
        fields,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        given=k + "attention.key_length" in meta,
        read=lambda derived: file.count(k + "attention.key_length", MAX_DIM, default=derived),
    )
    for other in ("attention.value_length", "rope.dimension_count"):
        if meta.get(k + other, head_size) != head_size:
            raise ModelLoadError(
                f"GGUF file {path}: {k}{other}={meta[k + other]!r} differs from the head size "
                f"{head_size}; pitstop supports only value heads of the key size, rotating the whole head"
            )
    layers = file.count(k + "block_count", MAX_LAYERS)
    ffn = file.count(k + "feed_forward_length", MAX_DIM)
    context = file.count(k + "context_length", MAX_POSITIONS, default=4096)
    vocab = _vocabulary(file, tensors["token_embd.weight"], hidden, k)

    rope_scaling = None
    scaling_type = meta.get(k + "rope.scaling.type") or "none"
    if scaling_type not in GGUF_ROPE_SCALING:
        raise ModelLoadError(
            f"GGUF file {path}: {k}rope.scaling.type={scaling_type!r} is not supported for GGUF "
            f"files (supported: {', '.join(GGUF_ROPE_SCALING)}); load the Hugging Face checkpoint"
        )
    if scaling_type == "linear":
        factor = file.number(k + "rope.scaling.factor", 1.0, 0.0, 1e6)
        rope_scaling = {"rope_type": "linear", "factor": factor}
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        rms_norm_eps=file.number(k + "attention.layer_norm_rms_epsilon", 1e-6, 0.0, 1.0),
        rope_theta=file.number(k + "rope.freq_base", 10000.0, 1.0, 1e12),
        rope_scaling=rope_scaling,
        rope_freq_factors=_rope_freq_factors(file, head_size),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=file.bos_token_id,
        eos_token_ids=file.eos_token_ids,
    )


def _vocabulary(file: GGUFModelFile, embd_shape: tuple[int, ...], hidden: int, k: str) -> int:
    """The vocabulary size: token_embd's rows, which every other count must agree with."""
    path = file.path
    if len(embd_shape) != 2 or embd_shape[1] != hidden:
        raise ModelLoadError(
            f"GGUF file {path}: token_embd.weight has shape {list(embd_shape)}, which is not "
            f"[vocabulary, {k}embedding_length={hidden}]"
        )
    vocab = embd_shape[0]
    if not 1 <= vocab <= MAX_VOCAB:
        raise ModelLoadError(f"GGUF file {path}: token_embd.weight claims {vocab:,} rows")
    claims = {
        k + "vocab_size": file.metadata.get(k + "vocab_size"),
        "tokenizer.ggml.tokens": file.array_length("tokenizer.ggml.tokens"),
    }
    for key, n in claims.items():
        if n is not None and n != vocab:
            raise ModelLoadError(
                f"GGUF file {path}: token_embd.weight has {vocab:,} rows but {key} counts "
                f"{n!r} tokens; the embedding must hold one row per token"
            )
    return vocab


def _rope_freq_factors(file: GGUFModelFile, head_size: int) -> tuple[float, ...] | None:
    """llama.cpp's ``rope_freqs`` (Llama 3 scaling) as factors, or None when absent."""
    shape = file.tensor_shapes.get(ROPE_FREQS)
    if shape is None:
        return None
    if list(shape) != [head_size // 2]:
        raise ModelLoadError(
            f"GGUF file {file.path}: rope_freqs.weight has shape {list(shape)}, not "
            f"[{head_size // 2}] (half the head size)"
        )
    values = file.read_tensor(ROPE_FREQS)
    if not np.isfinite(values).all() or (values <= 0).any():
        raise ModelLoadError(f"GGUF file {file.path}: rope_freqs.weight holds non-positive factors")
    return tuple(float(x) for x in values.reshape(-1))


def gguf_rules(gguf_architecture: str) -> GGUFRules:
    """The GGUF rules of one family member (``llama``, ``qwen2`` or ``qwen3``)."""
    permuted = gguf_architecture in PERMUTED_ARCHITECTURES
    return GGUFRules(
        architectures=(gguf_architecture,),
        config=config_from_gguf,
        tensor_name=hf_tensor_name,
        config_tensor=is_rope_freqs,
        **({"fix_tensor": unpermute_llama_qk, "fix_rows": llama_qk_row_order} if permuted else {}),
    )
