"""How the Llama family (Llama, Qwen2, Qwen3) reads a Hugging Face ``config.json``.

The file is read through ``transformers``' own config classes
(:func:`config_from_hf`), and every field of them is decided: read into the
:class:`~pitstop.ground.model_config.ModelConfig` (and implemented), known to have no
effect at inference, or refused with an error that names the field, its value
and what is supported. A checkpoint the family accepts therefore computes what
``transformers`` computes; one it cannot compute exactly does not load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import (
    MAX_DIM,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    ModelConfig,
    positive_int,
)
from pitstop.plugins.models.llama_rope import SUPPORTED_ROPE_TYPES, rope_frequencies

# model_type of a config.json -> the architecture (model registry name) it describes
HF_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Fields of the transformers config classes that do not change what inference computes.
HF_FIELDS_WITHOUT_EFFECT = {
    "initializer_range": "weight initialisation (training only)",
    "attention_dropout": "dropout (training only)",
    "use_cache": "transformers' own KV cache switch",
    "pad_token_id": "padding (pitstop does not pad)",
    "pretraining_tp": "split matmuls of the same product (unused by transformers >= 5)",
    "max_window_layers": "read through layer_types / use_sliding_window",
    "use_sliding_window": "read through sliding_window and layer_types",
}
# Fields read into ModelConfig (each one implemented or refused by a check below).
HF_FIELDS_READ = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",  # transformers >= 5
    "rope_theta",  # transformers 4
    "rope_scaling",  # transformers 4
    "partial_rotary_factor",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "quantization_config",
)

# config.json's shape fields and their bounds, checked on the raw JSON too (transformers'
# own constructors divide by some of them)
HF_SHAPE_LIMITS = {
    "vocab_size": MAX_VOCAB,
    "hidden_size": MAX_DIM,
    "intermediate_size": MAX_DIM,
    "num_hidden_layers": MAX_LAYERS,
    "num_attention_heads": MAX_DIM,
    "num_key_value_heads": MAX_DIM,
    "head_dim": MAX_DIM,
    "max_position_embeddings": MAX_POSITIONS,
}


def config_from_hf(raw: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
    """The :class:`ModelConfig` of a Llama, Qwen2 or Qwen3 ``config.json`` (as a dict;
    ``where`` names it in errors), read through transformers' config class of its
    ``model_type`` and decided field by field (see the module doc)."""
    _check_model_type(raw.get("model_type"), where)
    return config_from_transformers(transformers_config(raw, where, HF_SHAPE_LIMITS), where)


def transformers_config(raw: Mapping[str, Any], where: str, limits: Mapping[str, int]) -> Any:
    """transformers' config object of a ``config.json`` dict whose ``model_type`` the caller
    checked, after the shape fields ``limits`` names (field -> bound) are checked on the raw
    JSON (transformers' own constructors divide by some of them)."""
    for field, limit in limits.items():
        if raw.get(field) is not None:
            positive_int(raw[field], field, where, limit)
    try:
        from transformers import CONFIG_MAPPING

        # what AutoConfig.from_pretrained does with the file's dict, without reading it again
        return CONFIG_MAPPING[raw["model_type"]].from_dict(dict(raw))
    except Exception as exc:  # transformers raises OSError, ValueError, TypeError, ...
        raise ModelLoadError(
            f"transformers cannot read {where} ({type(exc).__name__}: {exc}); the file is "
            "corrupt or mangles a required field"
        ) from exc


def _check_model_type(model_type: Any, where: str) -> None:
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(
            f"{where} describes model_type={model_type!r}; pitstop's Llama family reads "
            f"{', '.join(HF_MODEL_TYPES)} ({', '.join(HF_MODEL_TYPES.values())})"
        )


def config_from_transformers(hf: Any, where: str = "config.json") -> ModelConfig:
    """The :class:`ModelConfig` of a ``transformers`` config object of the family."""
    model_type = getattr(hf, "model_type", "")
    _check_model_type(model_type, where)
    config = ModelConfig(**shared_fields(hf, where, HF_MODEL_TYPES[model_type]))
    check_rope(config, where)
    return config


# model types whose attention has Qwen3's per-head q/k RMSNorm
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


def shared_fields(hf: Any, where: str, arch: str, decided: Iterable[str] = ()) -> dict[str, Any]:
    """The :class:`ModelConfig` keywords of a transformers config of the Llama family or a
    model built on its decoder (``arch``: the architecture its ``model_type`` names): the
    attention shape, rope, norms, biases, window and special tokens, every field decided.
    ``decided``: the caller's own fields (read by it, or known to have no effect), which
    are not refused as undecided."""
    model_type = getattr(hf, "model_type", "")
    archs = list(getattr(hf, "architectures", None) or [arch])
    if archs != [arch]:
        raise ModelLoadError(
            f"{where} has architectures={archs!r} for model_type={model_type!r}; pitstop runs "
            f"{arch} only for that model type"
        )
    quant = getattr(hf, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        raise ModelLoadError(
            f"{where} has quantization_config (quant_method={method!r}); pitstop loads "
            "unquantized float32, float16 and bfloat16 checkpoints only (or a GGUF file)"
        )
    _refuse_unknown_fields(hf, where, decided)

    def get(field: str, default: Any = None) -> Any:
        return getattr(hf, field, default)

    act = get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(
            f"{where}: hidden_act={act!r} is not supported; pitstop implements 'silu' (SwiGLU)"
        )
    hidden = positive_int(get("hidden_size"), "hidden_size", where, MAX_DIM)
    layers = positive_int(get("num_hidden_layers"), "num_hidden_layers", where, MAX_LAYERS)
    heads = positive_int(get("num_attention_heads"), "num_attention_heads", where, MAX_DIM)
    kv_heads = positive_int(
        get("num_key_value_heads") or heads, "num_key_value_heads", where, MAX_DIM
    )
    given = get("head_dim")
    head_dim = head_size(
        where,
        HF_HEAD_FIELDS,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        given=given is not None,
        read=lambda derived: positive_int(
            derived if given is None else given, "head_dim", where, MAX_DIM
        ),
    )
    eps = get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise ModelLoadError(f"{where}: rms_norm_eps={eps!r} is not a number in (0, 1)")
    theta, scaling = _hf_rope(hf, where)
    eos = get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
    return dict(
        architecture=arch,
        vocab_size=positive_int(get("vocab_size"), "vocab_size", where, MAX_VOCAB),
        hidden_size=hidden,
        intermediate_size=positive_int(
            get("intermediate_size"), "intermediate_size", where, MAX_DIM
        ),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_dim,
        rms_norm_eps=float(eps),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=positive_int(
            get("max_position_embeddings", 4096), "max_position_embeddings", where, MAX_POSITIONS
        ),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        **_biases(hf, model_type),
        qk_norm=model_type in QK_NORM_MODEL_TYPES,
        sliding_window=_hf_sliding_window(hf, layers, where) if model_type != "llama" else None,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _biases(hf: Any, model_type: str) -> dict[str, bool]:
    """Which projections carry a bias: transformers' Qwen2 always has q/k/v biases and never
    o/MLP ones; Qwen3 (and Qwen3-MoE) may have them on the attention (``attention_bias``);
    Llama on the attention and the MLP (``mlp_bias``); a config without the fields none."""
    if model_type == "qwen2":
        return dict(attention_bias=True, o_proj_bias=False, mlp_bias=False)
    attention = bool(getattr(hf, "attention_bias", False))
    mlp = bool(getattr(hf, "mlp_bias", False)) if model_type == "llama" else False
    return dict(attention_bias=attention, o_proj_bias=attention, mlp_bias=mlp)


@attrs.frozen
class HeadFields:
    """How a checkpoint format names the attention shape's fields, for its error messages."""

    hidden: str  # the model width
    heads: str  # query heads
    kv_heads: str  # key/value heads
    head_size_absent: str  # "no head size given", in the format's words
    odd: str  # the message of an odd head size, ``{}`` the size


HF_HEAD_FIELDS = HeadFields(
    hidden="hidden_size",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
    head_size_absent="head_dim is not given",
    odd="head_dim={} is odd; rotary embeddings need it even",
)


def head_size(
    where: str,
    fields: HeadFields,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    given: bool,
    read: Callable[[int], int],
) -> int:
    """The attention head size of a checkpoint, checked: the query heads a multiple of the
    key/value heads, the size given (``read`` reads and range-checks it, from the width
    over the heads when not ``given``) and even (rotary embeddings rotate pairs)."""
    if heads % kv_heads:
        raise ModelLoadError(
            f"{where}: {fields.heads}={heads} is not a multiple of {fields.kv_heads}={kv_heads}"
        )
    if not given and hidden % heads:
        raise ModelLoadError(
            f"{where}: {fields.hidden}={hidden} is not a multiple of {fields.heads}={heads} "
            f"and {fields.head_size_absent}"
        )
    size = read(hidden // heads)
    if size % 2:
        raise ModelLoadError(f"{where}: {fields.odd.format(size)}")
    return size


def check_rope(config: ModelConfig, where: str) -> None:
    """A rope that cannot be computed fails now, at load, not in the runner."""
    try:
        rope_frequencies(config)
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers' rope functions raise KeyError, TypeError, ...
        raise ModelLoadError(
            f"{where}: the rope parameters {config.rope_scaling!r} cannot be computed "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _refuse_unknown_fields(hf: Any, where: str, extra: Iterable[str] = ()) -> None:
    """A field the config class knows but pitstop has not decided, set to a non-default
    value, is refused: it may change the output (a newer transformers may add such fields).
    Keys the class does not know are ignored, as transformers' model ignores them."""
    import transformers

    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    generic = set(base().to_dict())
    decided = generic | set(HF_FIELDS_READ) | set(HF_FIELDS_WITHOUT_EFFECT) | set(extra)
    defaults = type(hf)().to_dict()
    values = hf.to_dict()
    for field in sorted(set(defaults) - decided):
        if field in values and values[field] != defaults[field]:
            raise ModelLoadError(
                f"{where}: {field}={values[field]!r} is a {type(hf).__name__} field pitstop does "
                f"not implement (supported only at its default, {defaults[field]!r})"
            )


def _hf_rope(hf: Any, where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the other rope parameters or None) of transformers 5's rope_parameters
    or transformers 4's rope_theta + rope_scaling; unsupported types are refused."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # transformers 4
        params = {"rope_theta": getattr(hf, "rope_theta", 10000.0)}
        params.update(getattr(hf, "rope_scaling", None) or {})
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(
            f"{where}: rope_parameters holds one set of parameters per layer type ({params!r}); "
            "pitstop supports a single rope for every layer"
        )
    theta = params.pop("rope_theta", None)
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 1:
        raise ModelLoadError(f"{where}: rope_theta={theta!r} is not a number above 1")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: rope_type={rope_type!r} is not supported; pitstop implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(
            f"{where}: partial_rotary_factor={partial!r} is not supported; pitstop rotates the "
            "whole head (1.0)"
        )
    params.pop("partial_rotary_factor", None)
    params.pop("type", None)
    params["rope_type"] = rope_type
    if rope_type == "default":
        return float(theta), None
    return float(theta), params


def _hf_sliding_window(hf: Any, num_layers: int, where: str) -> int | None:
    """The window of the layers that use one, or None (Qwen2/Qwen3 use_sliding_window)."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        window = None  # transformers 4 keeps the value but ignores it
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        max_window = getattr(hf, "max_window_layers", 0) or 0
        layer_types = [
            "sliding_attention" if window is not None and i >= max_window else "full_attention"
            for i in range(num_layers)
        ]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ModelLoadError(
            f"{where}: layer_types has {unknown!r}; pitstop supports 'full_attention' "
            "(and 'sliding_attention' with a window of at least max_model_len)"
        )
    if "sliding_attention" not in layer_types or window is None:
        return None
    return positive_int(window, "sliding_window", where, MAX_POSITIONS)
