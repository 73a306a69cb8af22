"""`EngineConfig`: the engine's settings, a plain value.

The fields are the engine's own settings (the model, the strategies' names,
memory, batch bounds, the engine loop); each strategy's knobs are its plugin's
declared settings (:mod:`pitstop.plugin_system.settings`), held in ``options`` by
``<plugin>.<setting>`` key or by a declared alias (``{"chunk_size": 512}``). The
config knows no plugin: building one checks only its own fields. The entry points
fold every other spelling into it (vLLM's names, aliases as keywords, TOML files,
flags: :mod:`pitstop.entrypoints.engine_args`), and the engine resolves it once
(:meth:`pitstop.plugin_system.plugin_manager.PluginManager.resolve`): every strategy
name checked and each selected strategy's typed settings read, before any weight loads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.env_flags import env_flag, freeze_gc_from_env, poison_from_env
from pitstop.errors import ConfigError

if TYPE_CHECKING:
    from pitstop.ground.model_config import ModelConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2")

# No machine pitstop runs on has this much memory: a larger KV cache is a typo
# (1e6 for 1.0), refused before anything tries to allocate it.
MAX_KV_CACHE_GIB = 4096.0

# Positions are int32 in the kernels and no model has a longer context: a larger
# max_model_len is a typo (2**40), refused before anything is sized by it.
MAX_MODEL_LEN = 2**31 - 1

ALLOW_LONG_MAX_MODEL_LEN_ENV = "PITSTOP_ALLOW_LONG_MAX_MODEL_LEN"
"""Set to 1 to let ``max_model_len`` exceed the model's context (as vLLM's
``VLLM_ALLOW_LONG_MAX_MODEL_LEN``); the config's ``allow_long_max_model_len`` does the same."""

log = logging.getLogger(__name__)


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


def _is_real(value: Any) -> bool:
    """A finite int or float; True and False are not numbers here."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _positive(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    if value is not None and (not _is_real(value) or value <= 0):
        raise ConfigError(f"{att.name} must be a positive finite number, got {value!r}")


def _kv_cache_gib(inst: Any, att: attrs.Attribute, value: Any) -> None:
    _positive(inst, att, value)
    if value is not None and value > MAX_KV_CACHE_GIB:
        raise ConfigError(
            f"{att.name} is {value!r} GiB, more than any machine has (limit {MAX_KV_CACHE_GIB:g}); "
            "give the KV-cache size in GiB (e.g. 1 or 0.5), or leave it unset to size it from memory"
        )


def _positive_int(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConfigError(f"{att.name} must be a positive integer, got {value!r}")


def _model_len(inst: Any, att: attrs.Attribute, value: Any) -> None:
    _positive_int(inst, att, value)
    if value is not None and value > MAX_MODEL_LEN:
        raise ConfigError(
            f"{att.name}={value:,} is more than any model's context (positions are int32: at "
            f"most {MAX_MODEL_LEN:,}); give the longest prompt + output in tokens (e.g. 8192), or "
            "leave it unset to use the model's own"
        )


def _non_negative_int(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{att.name} must be an integer >= 0, got {value!r}")


def _non_negative_real(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    if not _is_real(value) or value < 0:
        raise ConfigError(f"{att.name} must be a finite number >= 0, got {value!r}")


def _one_of(*choices: Any):
    def check(_inst: Any, att: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ConfigError(
                f"{att.name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
            )

    return check


def _name(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{att.name} must be a strategy name (a non-empty string), got {value!r}")


def _optional_name(inst: Any, att: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _name(inst, att, value)


def _fraction(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    if not _is_real(value) or not 0 < value <= 1:
        raise ConfigError(f"{att.name} must be a number in (0, 1], e.g. 0.9, got {value!r}")


def _optional_path(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(
            f"{att.name} must be a path or name (a non-empty string), or unset, got {value!r}"
        )


def _options(_inst: Any, att: attrs.Attribute, value: Mapping[str, Any]) -> None:
    for key, item in value.items():
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(
                f"{att.name} keys must be non-empty strings such as 'prefix.max_cached_pages', "
                f"got {key!r}"
            )
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"{att.name}[{key!r}] must be a finite number, got {item!r}")


def _bool(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{att.name} must be true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Every setting of one engine. Frozen: build a new one with :func:`attrs.evolve`."""

    # --- the model and where it runs
    model: str = attrs.field(
        default="smollm2-135m",
        validator=_name,
        metadata=_doc(
            "model: 'smollm2-135m' (the shipped GGUF), a .gguf file, a Hugging Face "
            "checkpoint folder, or 'dummy:<preset>' (qwen3-0.6b, qwen3-8b, qwen3-32b, llama3-8b, "
            "qwen3-30b-a3b, mixtral-8x7b)"
        ),
    )
    tokenizer: str | None = attrs.field(
        default=None,
        validator=_optional_path,
        metadata=_doc("tokenizer folder or tokenizer.json (default: the model's own)"),
    )
    dtype: str = attrs.field(
        default="auto",
        validator=_one_of(*DTYPES),
        metadata=_doc(
            "weights and activations: auto (float32 on CPU, bfloat16 on CUDA), float32 (or "
            "float), float16 (or half), bfloat16"
        ),
    )
    device: str = attrs.field(default="auto", metadata=_doc("auto, cpu, cuda or cuda:N"))
    tensor_parallel_size: int = attrs.field(
        default=1,
        validator=_positive_int,
        metadata=_doc(
            "ranks the model is split over (one per GPU; gloo processes on CPU); 1 starts no worker"
        ),
    )
    distributed_executor_backend: str = attrs.field(
        default="mp",
        validator=_name,
        metadata=_doc(
            "executor plugin that runs the ranks at tensor_parallel_size > 1 (mp: spawned "
            "processes, or torchrun's); at 1 the model runs in the engine's process"
        ),
    )
    threads: int | None = attrs.field(
        default=None,
        validator=_positive_int,
        metadata=_doc(
            "CPU threads torch uses (default: torch's choice, one per core; the engine prints "
            "the number at start-up)"
        ),
    )
    seed: int = attrs.field(
        default=0, validator=_non_negative_int, metadata=_doc("seed of requests that set none")
    )
    max_model_len: int | None = attrs.field(
        default=None,
        validator=_model_len,
        metadata=_doc(
            "longest prompt + output in tokens (default: the model's, capped at 4096); at most "
            "the model's context unless allow_long_max_model_len"
        ),
    )
    allow_long_max_model_len: bool = attrs.field(
        default=False,
        validator=_bool,
        metadata=_doc(
            "let max_model_len exceed the model's context (max_position_embeddings), with a "
            f"warning: positions past it were never trained (also {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1)"
        ),
    )

    # --- the strategies, by name
    allocator: str = attrs.field(
        default="paged", validator=_name, metadata=_doc("KV-cache allocator plugin")
    )
    scheduler: str = attrs.field(
        default="chunked",
        validator=_name,
        metadata=_doc(
            "scheduler plugin (default chunked: every step within a token budget, as vLLM does)"
        ),
    )
    kernels: str = attrs.field(
        default="auto",
        validator=_name,
        metadata=_doc(
            "kernel-set plugin; auto: fused on CUDA (when registered), reference elsewhere"
        ),
    )
    sampler: str = attrs.field(default="standard", validator=_name, metadata=_doc("sampler plugin"))
    speculative: str | None = attrs.field(
        default=None,
        validator=_optional_name,
        metadata=_doc("speculative-decoding proposer plugin (default: none)"),
    )
    weights: str = attrs.field(
        default="dense",
        validator=_name,
        metadata=_doc(
            "weight-format plugin of the linear layers: dense (the checkpoint's weights in "
            "dtype), fp8 (per-channel e4m3 weights, per-token activations)"
        ),
    )
    adapter: str | None = attrs.field(
        default=None,
        validator=_optional_name,
        metadata=_doc(
            "adapter plugin that serves fine-tuned adapters on the base weights per request "
            "(lora; vLLM's enable_lora=True selects it); default: none"
        ),
    )
    grammar: str = attrs.field(
        default="llguidance",
        validator=_name,
        metadata=_doc(
            "grammar-backend plugin: structured outputs' compiler (JSON schema, regex, choice, "
            "grammar), built at the first request that asks for them"
        ),
    )

    # --- KV cache
    page_size: int = attrs.field(
        default=16, validator=_positive_int, metadata=_doc("tokens per KV-cache page")
    )
    max_num_pages: int | None = attrs.field(
        default=None,
        validator=_positive_int,
        metadata=_doc("exact number of KV-cache pages (default: sized from memory)"),
    )
    gpu_memory_utilization: float = attrs.field(
        default=0.9,
        validator=_fraction,
        metadata=_doc("fraction of GPU memory the engine may use (CUDA)"),
    )
    kv_cache_gib: float | None = attrs.field(
        default=None,
        validator=_kv_cache_gib,
        metadata=_doc(
            "KV-cache size in GiB (default: 1 on CPU; from gpu_memory_utilization on CUDA)"
        ),
    )
    kv_cache_dtype: str = attrs.field(
        default="auto",
        validator=_one_of(*KV_CACHE_DTYPES),
        metadata=_doc(
            "element type of the KV cache: auto (the model's dtype), bfloat16, float16, float32, "
            "or fp8_e4m3 (or fp8) / fp8_e5m2 (one byte per element, one K and one V scale per "
            "layer)"
        ),
    )

    # --- scheduling
    max_batch_size: int = attrs.field(
        default=256, validator=_positive_int, metadata=_doc("most sequences in one step")
    )
    max_num_batched_tokens: int = attrs.field(
        default=8192,
        validator=_positive_int,
        metadata=_doc(
            "most tokens computed in one step (the chunked scheduler's budget unless its chunk_size "
            "is set)"
        ),
    )
    # --- CUDA graphs and the engine loop
    enforce_eager: bool = attrs.field(
        default=False, validator=_bool, metadata=_doc("never capture CUDA graphs")
    )
    piecewise_max_tokens: int = attrs.field(
        default=2048,
        validator=_positive_int,
        metadata=_doc(
            "the largest prefill or mixed step replayed from piecewise CUDA graphs (everything "
            "between two attentions captured a token-count bucket); a larger step launches its "
            "kernels one by one (capped by the step budget, max_num_batched_tokens)"
        ),
    )
    overlap: str = attrs.field(
        default="auto",
        converter=lambda v: ("on" if v else "off") if isinstance(v, bool) else v,
        validator=_one_of("auto", "on", "off"),
        metadata=_doc(
            "plan step N+1 on the CPU while the device runs step N (auto: on for CUDA, "
            "off on CPU; a step that verifies drafts runs serially)"
        ),
    )

    freeze_gc: bool = attrs.field(
        factory=freeze_gc_from_env,
        validator=_bool,
        metadata=_doc(
            "at the end of start-up, collect garbage once and move every object then alive into "
            "Python's permanent generation (gc.freeze), so that a full collection while serving "
            "scans only what was made since instead of stalling a step (~100 ms on the H200); "
            "close() thaws them (default: on, unless PITSTOP_FREEZE_GC=0)"
        ),
    )

    # --- debugging
    check_weights: bool = attrs.field(
        default=True,
        validator=_bool,
        metadata=_doc(
            "refuse a checkpoint with NaN or infinite weights at load, checked as each tensor "
            "streams into its parameter (one read of it; see docs/configuration.md for the cost)"
        ),
    )
    poison_memory: bool = attrs.field(
        factory=poison_from_env,
        validator=_bool,
        metadata=_doc(
            "fill fresh KV pages, workspaces and staging buffers with NaN or an out-of-range "
            "integer, so a read of memory the engine never wrote fails instead of passing on "
            "stale values (tests and pitstop verify; slower; default: PITSTOP_POISON_MEMORY)"
        ),
    )

    # --- speculative decoding
    num_speculative_tokens: int = attrs.field(
        default=4, validator=_positive_int, metadata=_doc("draft tokens proposed per step (k)")
    )
    speculative_max_batch: int = attrs.field(
        default=16,
        validator=_positive_int,
        metadata=_doc(
            "speculate only while at most this many sequences run (larger batches are "
            "compute-bound: they decode plainly, in the overlapped loop)"
        ),
    )
    speculative_verifier: str = attrs.field(
        default="rejection",
        validator=_name,
        metadata=_doc(
            "draft-verifier plugin: which drafts a speculative step keeps (rejection: exact "
            "rejection sampling, the target model's distribution)"
        ),
    )
    speculative_min_accepted: float = attrs.field(
        default=0.5,
        validator=_non_negative_real,
        metadata=_doc(
            "a sequence whose recent drafts kept fewer tokens per step than this pauses "
            "speculation, for 4 steps doubling to 64 (0: never pause)"
        ),
    )

    # --- the plugins' own settings
    options: Mapping[str, Any] = attrs.field(
        factory=dict,
        converter=lambda d: dict(d or {}),
        validator=_options,
        metadata=_doc(
            "the plugins' declared settings by '<plugin>.<setting>' key or by alias, e.g. "
            "{'prefix.max_cached_pages': 8, 'chunk_size': 512} (pitstop plugins --settings)"
        ),
    )

    def __attrs_post_init__(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ConfigError(
                f"device={self.device!r} names one GPU, but tensor_parallel_size="
                f"{self.tensor_parallel_size} puts rank r on cuda:r; use device='cuda' (or 'auto'), "
                "and CUDA_VISIBLE_DEVICES to choose the GPUs"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        """The names of every setting, in declaration order."""
        return [a.name for a in attrs.fields(cls)]


def long_max_model_len_allowed(config: EngineConfig) -> bool:
    """Whether ``config`` (``allow_long_max_model_len``) or the environment
    (``PITSTOP_ALLOW_LONG_MAX_MODEL_LEN=1``) lets max_model_len exceed the model's context."""
    return config.allow_long_max_model_len or env_flag(ALLOW_LONG_MAX_MODEL_LEN_ENV, default=False)


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """``config.max_model_len`` checked against the model's context (its
    ``max_position_embeddings``), or the default ``min(context, 4096)`` when unset.

    First the model's own limits (:meth:`ModelConfig.check_max_model_len`: no
    override lifts them). A length past the context is a :class:`ConfigError`
    naming both numbers and the two ways to allow it; allowed, it logs a warning
    (the model never saw those positions).
    """
    context = model_config.max_position_embeddings
    asked = config.max_model_len
    if asked is None:
        return min(context, 4096)
    model_config.check_max_model_len(asked)
    if asked <= context:
        return asked
    if not long_max_model_len_allowed(config):
        raise ConfigError(
            f"max_model_len={asked:,} is longer than the model's context of {context:,} tokens "
            f"(max_position_embeddings); use max_model_len <= {context}, or, if you know the "
            f"model works past it, set allow_long_max_model_len=true (--allow-long-max-model-len "
            f"true) or {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1"
        )
    log.warning(
        "max_model_len=%d exceeds the model's context of %d tokens (allowed by "
        "allow_long_max_model_len / %s): output past position %d may be garbage",
        asked,
        context,
        ALLOW_LONG_MAX_MODEL_LEN_ENV,
        context,
    )
    return asked
