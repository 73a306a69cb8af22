"""vLLM's engine-argument names, read as pitstop's settings.

A vLLM user writes ``LLM(model, max_num_seqs=64, enable_prefix_caching=True)``,
``max_num_seqs = 64`` in a config file or ``--max-num-seqs 64`` on the command
line. :func:`translate` turns such names into pitstop's own settings before
:class:`~pitstop.config.EngineConfig` validates them, in one place for the
three ways settings enter:

- :data:`RENAMED`: a vLLM name with a pitstop setting of the same meaning
  (``max_num_seqs`` is ``max_batch_size``), its value converted where the two
  differ in kind (``enable_prefix_caching=True`` selects the ``prefix``
  allocator, ``kv_cache_memory_bytes`` becomes ``kv_cache_gib``);
- :data:`SAME_NAME`: vLLM names pitstop uses as they are;
- :data:`ACCEPTED`: names pitstop takes without a setting of its own
  (``trust_remote_code``: pitstop never runs a checkpoint's code either way);
- :data:`REMOVED`: arguments vLLM itself removed, refused saying so and what
  replaced them; :data:`SERVE_REFUSED`: ``vllm serve`` flags ``pitstop serve``
  lacks (flags that take several values in vLLM parse them all,
  :data:`MULTI_VALUED`, so the refusal names the flag);
- :data:`REFUSED`: vLLM arguments pitstop does not have, refused by name with
  what to use instead, unless the value asks for what pitstop does anyway
  (None, ``pipeline_parallel_size=1``, ``tokenizer_mode="auto"``: :data:`NEUTRAL`).

A vLLM name given together with the pitstop setting it stands for is an
error naming both, unless the two say the same. docs/api.md's table of
vLLM names is rendered from these tables by :mod:`pitstop.server.vllm_table`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from pitstop.errors import ConfigError


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


@attrs.frozen
class Renamed:
    """A vLLM argument read as pitstop settings: ``convert(value)`` gives them by name."""

    vllm: str
    pitstop: str  # the setting it becomes, as the docs table shows it
    convert: Callable[[Any], dict[str, Any]]
    flag_type: type = int  # the value type of its CLI flag (bool: --x / --no-x)
    note: str = ""


def _as(setting: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {setting: value}


def _prefix_caching(value: Any) -> dict[str, Any]:
    return {"allocator": "prefix" if _bool("enable_prefix_caching", value) else "paged"}


def _chunked_prefill(value: Any) -> dict[str, Any]:
    return {"scheduler": "chunked" if _bool("enable_chunked_prefill", value) else "continuous"}


def _async_scheduling(value: Any) -> dict[str, Any]:
    return {"overlap": "on" if _bool("async_scheduling", value) else "off"}


def _enable_lora(value: Any) -> dict[str, Any]:
    return {"adapter": "lora" if _bool("enable_lora", value) else None}


def _offloading_backend(value: Any) -> dict[str, Any]:
    if value != "native":
        raise ConfigError(
            f"kv_offloading_backend={value!r}: pitstop's host tier is the 'tiered' allocator "
            "(vLLM's 'native'); use kv_offloading_backend='native' or allocator='tiered'"
        )
    return {"allocator": "tiered"}


def _memory_bytes(value: Any) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"kv_cache_memory_bytes must be a positive integer (bytes), got {value!r}"
        )
    return {"kv_cache_gib": value / 2**30}


RENAMED: tuple[Renamed, ...] = (
    Renamed(
        "enable_lora",
        "adapter",
        _enable_lora,
        bool,
        "true: adapter='lora'; false: no adapter plugin",
    ),
    Renamed("max_num_seqs", "max_batch_size", _as("max_batch_size")),
    Renamed("block_size", "page_size", _as("page_size")),
    Renamed("num_gpu_blocks_override", "max_num_pages", _as("max_num_pages")),
    Renamed(
        "enable_prefix_caching",
        "allocator",
        _prefix_caching,
        bool,
        "true: allocator='prefix'; false: allocator='paged'",
    ),
    Renamed(
        "enable_chunked_prefill",
        "scheduler",
        _chunked_prefill,
        bool,
        "true: scheduler='chunked'; false: scheduler='continuous'",
    ),
    Renamed(
        "async_scheduling",
        "overlap",
        _async_scheduling,
        bool,
        "true: overlap='on'; false: overlap='off'",
    ),
    Renamed(
        "kv_offloading_backend",
        "allocator",
        _offloading_backend,
        str,
        "'native': allocator='tiered', whose host pool kv_offloading_size sizes",
    ),
    Renamed(
        "kv_cache_memory_bytes",
        "kv_cache_gib",
        _memory_bytes,
        int,
        "bytes / 2**30",
    ),
)
"""vLLM arguments with a pitstop setting of the same meaning under another name."""

SAME_NAME: tuple[str, ...] = (
    "model",
    "tokenizer",
    "dtype",
    "kv_cache_dtype",
    "seed",
    "max_model_len",
    "tensor_parallel_size",
    "distributed_executor_backend",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "enforce_eager",
    "device",
)
"""vLLM arguments that are pitstop settings of the same name (``dtype`` also takes
vLLM's ``"half"`` and ``"float"``, ``kv_cache_dtype`` its ``"fp8"``)."""

DTYPE_WORDS: Mapping[str, str] = {"half": "float16", "float": "float32"}
"""vLLM's other words for a ``dtype``."""

KV_CACHE_DTYPE_WORDS: Mapping[str, str] = {"fp8": "fp8_e4m3"}
"""vLLM's other words for a ``kv_cache_dtype``."""

ACCEPTED: Mapping[str, str] = {
    "trust_remote_code": (
        "accepted (true or false); pitstop never runs a checkpoint's own code, and refuses a "
        "checkpoint that needs it (config.json with auto_map)"
    ),
    "disable_log_stats": (
        "accepted (true or false); pitstop logs no periodic statistics (pitstop serve "
        "serves them on /metrics)"
    ),
    "disable_log_requests": (
        "accepted (true or false; vLLM deprecated it for enable_log_requests); pitstop serve "
        "logs no requests"
    ),
}
"""vLLM arguments taken without a pitstop setting: what each means here."""

REFUSED: Mapping[str, str] = {
    "quantization": (
        "pitstop's is weights=NAME (dense, fp8: e4m3 weights quantized at load); a "
        "quantized checkpoint is refused"
    ),
    "pipeline_parallel_size": "pitstop splits a model by tensor_parallel_size only",
    "data_parallel_size": "pitstop runs one engine per process; start one per replica",
    "swap_space": "pitstop preempts by recompute, never swaps KV to CPU; leave it out",
    "cpu_offload_gb": "pitstop keeps every weight on the device; leave it out",
    "speculative_config": (
        "pitstop's is speculative='ngram' or speculative='draft' with num_speculative_tokens "
        "and speculative_model"
    ),
    "tokenizer_mode": "pitstop reads the fast tokenizer (tokenizer.json) only; leave it out",
    "load_format": "pitstop's is model='dummy:<preset>' for random weights; else leave it out",
    "download_dir": "pitstop reaches no model hub; give a local folder or .gguf file as model",
    "revision": "pitstop reaches no model hub; give a local folder or .gguf file as model",
    "code_revision": "pitstop runs no checkpoint code; leave it out",
    "tokenizer_revision": "pitstop reaches no model hub; give tokenizer a local folder",
    "hf_token": "pitstop reaches no model hub; give a local folder or .gguf file as model",
    "hf_overrides": "edit the checkpoint's config.json instead",
    "max_logprobs": "pitstop's limit is fixed at 20 (logprobs=-1 asks for the whole vocabulary)",
    "preemption_mode": "pitstop preempts by recompute only",
    "scheduling_policy": "pitstop's is scheduler=... and its admission setting",
    "max_num_partial_prefills": "pitstop's is the chunked scheduler's chunk_size",
    "long_prefill_token_threshold": "pitstop's is the chunked scheduler's chunk_size",
    "compilation_config": "pitstop's is enforce_eager (CUDA graphs for decode on or off)",
    "cuda_graph_sizes": "pitstop's is enforce_eager (CUDA graphs for decode on or off)",
    "max_seq_len_to_capture": "pitstop's is enforce_eager (CUDA graphs for decode on or off)",
    "structured_outputs_config": (
        "pitstop's is grammar=NAME (a grammar-backend plugin; the default llguidance is "
        "vLLM's 'guidance')"
    ),
    "guided_decoding_backend": (
        "pitstop's is grammar=NAME (a grammar-backend plugin; the default llguidance is "
        "vLLM's 'guidance')"
    ),
    "kv_transfer_config": "pitstop has no KV transfer between engines",
    "served_model_name": "pitstop's is pitstop serve --served-model-name",
    "limit_mm_per_prompt": "pitstop serves text-only models",
    "mm_processor_kwargs": "pitstop serves text-only models",
    "rope_scaling": "edit the checkpoint's config.json instead",
    "rope_theta": "edit the checkpoint's config.json instead",
    "skip_tokenizer_init": "pass prompt_token_ids; a model without a tokenizer takes only those",
    "max_parallel_loading_workers": "pitstop streams weights in one thread; leave it out",
    "enable_expert_parallel": (
        "pitstop cuts every expert by its intermediate rows (tensor_parallel_size), "
        "not the experts over ranks"
    ),
    "task": "pitstop generates text only",
    "runner": "pitstop generates text only",
    "generation_config": "give sampling values in SamplingParams",
    "override_generation_config": "give sampling values in SamplingParams",
    "disable_custom_all_reduce": "pitstop uses torch.distributed's all-reduce only",
    "disable_sliding_window": "pitstop's models use full attention",
    "worker_cls": "pitstop's strategies are plugins: see docs/plugins.md",
    "scheduler_cls": "pitstop's is scheduler=<a registered scheduler plugin>",
    "allowed_local_media_path": "pitstop serves text-only models",
    "override_pooler_config": "pitstop generates text only (no pooling models)",
    "pooler_config": "pitstop generates text only (no pooling models)",
    "enable_prompt_embeds": "give prompts as text or token ids",
    "logits_processors": "give logits_processors per request in SamplingParams",
    "calculate_kv_scales": "pitstop's fp8 KV cache (kv_cache_dtype='fp8') keeps one K and V scale per layer",
    "fully_sharded_loras": (
        "under tensor parallelism pitstop cuts each adapter as its base weight; "
        "fully sharded LoRA layers are not implemented"
    ),
}
"""vLLM arguments pitstop does not have: what to do instead."""

REMOVED: Mapping[str, str] = {
    "use_v2_block_manager": "vLLM removed it (v0.6.6): its block manager is the only one; leave it out",
    "worker_use_ray": (
        "vLLM removed it for distributed_executor_backend='ray'; pitstop splits a model "
        "by tensor_parallel_size, over the executor distributed_executor_backend names"
    ),
    "engine_use_ray": "vLLM removed it (v0.6); leave it out",
    "num_scheduler_steps": (
        "vLLM removed multi-step scheduling (V1); pitstop overlaps steps with overlap='on'"
    ),
    "multi_step_stream_outputs": "vLLM removed multi-step scheduling (V1); leave it out",
    "scheduler_delay_factor": "vLLM removed it (V1); leave it out",
    "tokenizer_pool_size": "vLLM removed tokenizer pools (V1); leave it out",
    "tokenizer_pool_type": "vLLM removed tokenizer pools (V1); leave it out",
    "disable_async_output_proc": "vLLM removed it (V1); leave it out",
    "enable_prompt_adapter": "vLLM removed prompt adapters (v0.10); leave it out",
    "max_prompt_adapters": "vLLM removed prompt adapters (v0.10); leave it out",
    "ngram_prompt_lookup_max": (
        "vLLM moved it into speculative_config; pitstop's is speculative='ngram' with "
        "prompt_lookup_max"
    ),
    "ngram_prompt_lookup_min": (
        "vLLM moved it into speculative_config; pitstop's is speculative='ngram' with "
        "prompt_lookup_min"
    ),
}
"""vLLM arguments vLLM itself removed: what replaced them (here and in vLLM)."""

SERVE_REFUSED: Mapping[str, str] = {
    "ssl_keyfile": "serve behind a TLS proxy (nginx, caddy) on the loopback",
    "ssl_certfile": "serve behind a TLS proxy (nginx, caddy) on the loopback",
    "ssl_ca_certs": "serve behind a TLS proxy (nginx, caddy) on the loopback",
    "root_path": "mount the server under a path with your proxy's rewrite",
    "middleware": "put a proxy in front of pitstop serve",
    "response_role": "the assistant's role is 'assistant'",
    "return_tokens_as_token_ids": "ask for logprobs; each entry has the token id",
    "disable_frontend_multiprocessing": "pitstop serve is one process",
    "api_server_count": "pitstop serve is one process; start one per replica",
    "headless": "pitstop serve always serves HTTP",
    "reasoning_parser": "pitstop has no reasoning parsers",
    "tool_parser_plugin": "a tool parser is a pitstop plugin (tool_parser kind): docs/plugins.md",
    "allowed_methods": "pitstop serve allows the methods of its routes",
    "allowed_headers": "pitstop serve allows the headers of its API",
    "allow_credentials": "pitstop serve sends no credentialed CORS answers",
    "enable_log_requests": "pitstop serve logs no requests; its /metrics counts them",
    "max_log_len": "pitstop serve logs no requests",
    "log_config_file": "configure Python's logging before pitstop serve starts, or use -v",
    "chat_template": (
        "pitstop serve renders with the model's own chat template (its tokenizer_config.json); "
        "give a checkpoint folder whose template is the one you want"
    ),
}
"""vLLM's ``vllm serve`` flags ``pitstop serve`` does not have: what to do instead."""

MULTI_VALUED: frozenset[str] = frozenset(
    {"cuda_graph_sizes", "middleware", "allowed_methods", "allowed_headers"}
)
"""Refused flags that take several values in vLLM (``--cuda-graph-sizes 1 2 4``): they parse
them all, so the refusal names the flag instead of "unrecognized arguments"."""

NEUTRAL: Mapping[str, tuple[Any, ...]] = {
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "swap_space": (0, 4),  # vLLM's default 4: its V1 engine never swaps either
    "cpu_offload_gb": (0,),
    "tokenizer_mode": ("auto",),
    "load_format": ("auto",),
    "preemption_mode": ("recompute",),
    "skip_tokenizer_init": (False,),
    "enable_expert_parallel": (False,),
    "task": ("auto", "generate"),
    "runner": ("auto", "generate"),
    "disable_sliding_window": (False,),
    "disable_custom_all_reduce": (False,),
    "max_logprobs": (20,),  # pitstop's fixed limit
    "generation_config": ("auto",),  # LLM.get_default_sampling_params reads the model's
    "override_generation_config": ({},),
    "hf_overrides": ({},),
    "compilation_config": ({},),
    "guided_decoding_backend": ("auto", "guidance"),  # vLLM's 'guidance' is llguidance
    "structured_outputs_config": ({}, {"backend": "auto"}, {"backend": "guidance"}),
    "scheduling_policy": ("fcfs",),
    "max_num_partial_prefills": (1,),
    "long_prefill_token_threshold": (0,),
    "limit_mm_per_prompt": ({},),
    "mm_processor_kwargs": ({},),
    "rope_scaling": ({},),
    "hf_token": (False,),
    "worker_cls": ("auto",),
    "allowed_local_media_path": ("",),
    "enable_prompt_embeds": (False,),
    "calculate_kv_scales": (False,),
    "fully_sharded_loras": (False,),
    "return_tokens_as_token_ids": (False,),
    "disable_frontend_multiprocessing": (False,),
    "api_server_count": (1,),
    "headless": (False,),
    "response_role": ("assistant",),
    "allow_credentials": (False,),
    "enable_log_requests": (False,),
    "root_path": ("",),
    "middleware": ([],),
}
"""Values of refused arguments that ask for what pitstop does anyway (besides None, which
every refused argument takes): accepted, so that code passing vLLM's defaults runs."""


def is_neutral(name: str, value: Any) -> bool:
    """Whether ``value`` of the refused argument ``name`` asks for pitstop's own behaviour
    (a number may be given as int or float: ``swap_space=4.0``)."""
    return value is None or any(_same(value, v) for v in NEUTRAL.get(name, ()))


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, int | float) and isinstance(neutral, int | float):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def renamed_by_name() -> dict[str, Renamed]:
    """:data:`RENAMED` by vLLM name."""
    return {r.vllm: r for r in RENAMED}


def vllm_names() -> list[str]:
    """Every vLLM name pitstop reads or refuses by name (for did-you-mean)."""
    return sorted({r.vllm for r in RENAMED} | set(SAME_NAME) | set(ACCEPTED) | set(_refused()))


def _refused() -> dict[str, str]:
    return {**REFUSED, **SERVE_REFUSED}


def refusal(name: str) -> str:
    """The error text of a refused or removed vLLM argument."""
    if name in REMOVED:
        return f"{name} was removed from vLLM; pitstop does not have it either: {REMOVED[name]}"
    return f"{name} is vLLM's; pitstop does not have it: {_refused()[name]}"


def translate(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with every vLLM name turned into pitstop's settings.

    A refused name raises :class:`ConfigError` naming it and what to use
    instead; an accepted one (``trust_remote_code``) is checked and dropped;
    a renamed one becomes its pitstop setting(s). When the pitstop setting is
    also given with another value, the error names both.
    """
    out = {k: v for k, v in settings.items() if k not in _vllm_only()}
    out = {k: v for k, v in out.items() if not (k in SAME_NAME and v is None)}  # vLLM's unset
    renamed = renamed_by_name()
    for name, value in settings.items():
        if name in REMOVED:
            raise ConfigError(refusal(name))
        if name in REFUSED or name in SERVE_REFUSED:
            if is_neutral(name, value):
                continue
            raise ConfigError(refusal(name) + f" (got {name}={value!r})")
        if name in ACCEPTED:
            if value is not None:
                _bool(name, value)
            continue
        rule = renamed.get(name)
        if rule is None or value is None:  # None: vLLM's "unset", pitstop's default
            continue
        for setting, new in rule.convert(value).items():
            if setting in settings and settings[setting] != new:
                raise ConfigError(
                    f"{name}={value!r} (vLLM's name) means {setting}={new!r}, but {setting}="
                    f"{settings[setting]!r} is given too; give one of them"
                )
            out[setting] = new
    return _offloading_selects_tier(settings, out)


# what choosing an allocator by any name looks like (then kv_offloading_size selects nothing)
_CHOOSES_ALLOCATOR = ("allocator", "enable_prefix_caching", "kv_offloading_backend")


def _offloading_selects_tier(settings: Mapping[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """As in vLLM, ``kv_offloading_size`` alone turns the host tier on: a size above 0 with
    no allocator chosen by any name selects ``allocator='tiered'`` (vLLM's default backend,
    'native'), which reads the size as its own setting."""
    options = settings.get("options")
    size = settings.get("kv_offloading_size")
    if size is None and isinstance(options, Mapping):  # flags put the alias among the options
        size = options.get("kv_offloading_size")
    if size is None or isinstance(size, bool) or not isinstance(size, int | float):
        return out
    if size > 0 and not any(settings.get(name) is not None for name in _CHOOSES_ALLOCATOR):
        out["allocator"] = "tiered"
    return out


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{**base, **overrides}`` where an override wins over ``base`` whichever of the two
    names each uses (a ``--max-batch-size`` flag beats a file's ``max_num_seqs``, and
    ``--max-num-seqs`` a file's ``max_batch_size``)."""
    renamed = renamed_by_name()
    kept = dict(base)
    for name in overrides:
        if name in renamed:
            kept.pop(renamed[name].pitstop, None)
    for name in list(kept):
        if name in renamed and renamed[name].pitstop in overrides:
            del kept[name]
    return {**kept, **overrides}


def _vllm_only() -> set[str]:
    return {r.vllm for r in RENAMED} | set(ACCEPTED) | set(_refused()) | set(REMOVED)
