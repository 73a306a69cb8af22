"""`ModelConfig`: the shape of a Llama-family model, read from a checkpoint or a preset.

A Hugging Face ``config.json`` is read through ``transformers``' own config
classes (:meth:`ModelConfig.from_hf_config`), and every field of them is
decided: read into the config (and implemented), known to have no effect at
inference, or refused with an error that names the field, its value and what
is supported. A checkpoint pitstop accepts therefore computes what
``transformers`` computes; one it cannot compute exactly does not load.

The rotary frequencies come from ``transformers``' own rope initialisation
functions (:func:`rope_frequencies`), not from a copy of them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    import torch

# model_type of a config.json -> the architecture (model registry name) it describes
HF_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# rope types implemented ("dynamic" only up to max_position_embeddings: see check_max_model_len)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

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

# The largest value a shape field may claim (far above any released model): a larger
# one is a corrupt or hostile file, refused before anything of that size is allocated.
MAX_DIM = 2**20
MAX_LAYERS = 4096
MAX_VOCAB = 2**23
MAX_POSITIONS = 2**31 - 1


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
    # transformers' rope parameters besides rope_theta ({"rope_type": "yarn", "factor": 4.0, ...});
    # None is the default rope
    rope_scaling: dict[str, Any] | None = None
    # GGUF ``rope_freqs`` (llama.cpp's Llama 3 scaling): every inverse frequency is divided by one
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k and v (Qwen2; Llama and Qwen3 attention_bias)
    o_proj_bias: bool = False  # bias on o_proj (Llama and Qwen3 attention_bias)
    mlp_bias: bool = False  # bias on gate, up and down (Llama mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    # The attention window of the layers that have one (Qwen2/Qwen3 use_sliding_window);
    # pitstop runs such a model only where the window never cuts: max_model_len <= window.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_type(self) -> str:
        """The rope variant: ``default``, ``linear``, ``dynamic``, ``yarn`` or ``llama3``."""
        scaling = self.rope_scaling or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    @property
    def num_params(self) -> int:
        """Parameter count, embeddings included (output head counted once when tied)."""
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        attn = self.hidden_size * (2 * q + 2 * kv)
        attn += (q + 2 * kv) * self.attention_bias + self.hidden_size * self.o_proj_bias
        mlp = 3 * self.hidden_size * self.intermediate_size
        mlp += (2 * self.intermediate_size + self.hidden_size) * self.mlp_bias
        norms = 2 * self.hidden_size + (2 * self.head_size if self.qk_norm else 0)
        per_layer = attn + mlp + norms
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in elements (multiply by the dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a ``max_model_len`` at which this model would compute something other
        than ``transformers`` does (a :class:`ConfigError` that names the fix)."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ConfigError(
                f"the model uses sliding-window attention (sliding_window={self.sliding_window}), "
                f"shorter than max_model_len={max_model_len}; pitstop does not implement attention "
                f"windows, so it runs this model only where the window never cuts: use "
                f"max_model_len <= {self.sliding_window}"
            )
        if self.rope_type == "dynamic" and max_model_len > self.max_position_embeddings:
            raise ConfigError(
                f"rope_type='dynamic' (dynamic NTK) recomputes its frequencies once a sequence grows "
                f"past max_position_embeddings={self.max_position_embeddings}, and transformers then "
                f"makes them depend on the longest sequence of the batch; pitstop implements it "
                f"exactly up to there only: use max_model_len <= {self.max_position_embeddings}"
            )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary (through transformers' class)."""
        try:
            from transformers import AutoConfig

            model_type = cfg.get("model_type", "")
            if model_type not in HF_MODEL_TYPES:
                raise ModelLoadError(
                    f"{where} has model_type={model_type!r}; pitstop supports "
                    f"{', '.join(HF_MODEL_TYPES)}"
                )
            fields = {k: v for k, v in cfg.items() if k != "model_type"}
            hf = AutoConfig.for_model(model_type, **fields)
        except (TypeError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{where} cannot be read by transformers: {exc}") from exc
        return cls.from_hf_config(hf, where)

    @classmethod
    def from_hf_config(cls, hf: Any, where: str = "config.json") -> ModelConfig:
        """Build from a ``transformers`` config object, deciding every field (see the module doc)."""
        return _from_hf_config(cls, hf, where)


# ---------------------------------------------------------------------- HF config fields
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


def check_hf_shape_fields(raw: dict[str, Any], where: str) -> None:
    """Every shape field present in a raw ``config.json`` is a whole number in range."""
    for field, limit in HF_SHAPE_LIMITS.items():
        if raw.get(field) is not None:
            _positive_int(raw[field], field, where, limit)


def _positive_int(value: Any, field: str, where: str, limit: int) -> int:
    """``value`` as an int in [1, limit]; anything else is a ModelLoadError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ModelLoadError(
            f"{where}: {field}={value!r} is not a whole number between 1 and {limit:,}; "
            "the file is corrupt or describes no model pitstop can run"
        )
    return value


def _from_hf_config(cls: type[ModelConfig], hf: Any, where: str) -> ModelConfig:
    model_type = getattr(hf, "model_type", "")
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(
            f"{where} describes model_type={model_type!r}; pitstop supports "
            f"{', '.join(HF_MODEL_TYPES)} ({', '.join(HF_MODEL_TYPES.values())})"
        )
    arch = HF_MODEL_TYPES[model_type]
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
    _refuse_unknown_fields(hf, where)

    def get(field: str, default: Any = None) -> Any:
        return getattr(hf, field, default)

    act = get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(
            f"{where}: hidden_act={act!r} is not supported; pitstop implements 'silu' (SwiGLU)"
        )
    vocab = _positive_int(get("vocab_size"), "vocab_size", where, MAX_VOCAB)
    hidden = _positive_int(get("hidden_size"), "hidden_size", where, MAX_DIM)
    inter = _positive_int(get("intermediate_size"), "intermediate_size", where, MAX_DIM)
    layers = _positive_int(get("num_hidden_layers"), "num_hidden_layers", where, MAX_LAYERS)
    heads = _positive_int(get("num_attention_heads"), "num_attention_heads", where, MAX_DIM)
    kv_heads = _positive_int(
        get("num_key_value_heads") or heads, "num_key_value_heads", where, MAX_DIM
    )
    if heads % kv_heads:
        raise ModelLoadError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ModelLoadError(
                f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                "and head_dim is not given"
            )
        head_dim = hidden // heads
    head_dim = _positive_int(head_dim, "head_dim", where, MAX_DIM)
    if head_dim % 2:
        raise ModelLoadError(f"{where}: head_dim={head_dim} is odd; rotary embeddings need it even")
    max_pos = _positive_int(
        get("max_position_embeddings", 4096), "max_position_embeddings", where, MAX_POSITIONS
    )
    eps = get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise ModelLoadError(f"{where}: rms_norm_eps={eps!r} is not a number in (0, 1)")
    theta, scaling = _hf_rope(hf, where)

    if model_type == "qwen2":  # transformers' Qwen2 always has q/k/v biases, never o/mlp ones
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif model_type == "qwen3":
        qkv_bias = o_bias = bool(get("attention_bias", False))
        mlp_bias = False
    else:
        qkv_bias = o_bias = bool(get("attention_bias", False))
        mlp_bias = bool(get("mlp_bias", False))

    eos = get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
    config = cls(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_dim,
        rms_norm_eps=float(eps),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=model_type == "qwen3",
        sliding_window=_hf_sliding_window(hf, layers, where) if model_type != "llama" else None,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    try:
        rope_frequencies(config)  # a rope that cannot be computed fails now, not in the runner
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers' rope functions raise KeyError, TypeError, ...
        raise ModelLoadError(
            f"{where}: the rope parameters {config.rope_scaling!r} cannot be computed "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return config


def _refuse_unknown_fields(hf: Any, where: str) -> None:
    """A field the config class knows but pitstop has not decided, set to a non-default
    value, is refused: it may change the output (a newer transformers may add such fields).
    Keys the class does not know are ignored, as transformers' model ignores them."""
    import transformers

    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    generic = set(base().to_dict())
    decided = generic | set(HF_FIELDS_READ) | set(HF_FIELDS_WITHOUT_EFFECT)
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
    return _positive_int(window, "sliding_window", where, MAX_POSITIONS)


# ---------------------------------------------------------------------- rope
def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[head_size/2]`` in float32, the factor cos and sin are scaled by).

    The default rope is the textbook formula (as transformers writes it); every
    scaled variant calls transformers' own ``ROPE_INIT_FUNCTIONS``. GGUF
    ``rope_freqs`` divide the result, as llama.cpp does.
    """
    import torch

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
