"""What vLLM's ``LLM`` has beyond ``generate`` and ``chat``, as pitstop answers it.

- :data:`REFUSED_METHODS`: vLLM's ``LLM`` methods pitstop does not do (pooling,
  LoRA, profiling, ...); each is a method of
  :class:`pitstop.entrypoints.llm.LLM` that raises :class:`InvalidRequestError` saying so and
  what to use, so that vLLM code fails with a reason, not an ``AttributeError``.
- :func:`generation_defaults`: the sampling values of a checkpoint's
  ``generation_config.json`` that vLLM's ``LLM.get_default_sampling_params()``
  reads (its ``generation_config="auto"``).
- :func:`check_call_options`: the keyword arguments vLLM's ``generate`` /
  ``chat`` / ``beam_search`` take that pitstop has no use for, accepted at
  their defaults (None) and refused by name otherwise (a ``LoRARequest``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pitstop.errors import ConfigError, InvalidRequestError

REFUSED_METHODS: Mapping[str, str] = {
    "encode": "pitstop generates text only (no pooling models); use generate",
    "embed": "pitstop generates text only (no embedding models); use generate",
    "classify": "pitstop generates text only (no classification models); use generate",
    "score": (
        "pitstop generates text only (no scoring models); for the log-probability of a text "
        "use generate with SamplingParams(prompt_logprobs=0)"
    ),
    "reward": "pitstop generates text only (no reward models); use generate",
    "apply_model": (
        "pitstop runs the model in this process: call your function on "
        "llm.engine.runner.model (the torch module) at tensor_parallel_size=1"
    ),
    "collective_rpc": (
        "pitstop runs the model in this process at tensor_parallel_size=1: "
        "use llm.engine.runner directly"
    ),
    "start_profile": "wrap generate in torch.profiler.profile()",
    "stop_profile": "wrap generate in torch.profiler.profile()",
    "get_metrics": (
        "each RequestOutput has .metrics (arrival, first token, TTFT, TPOT); pitstop serve "
        "serves Prometheus metrics on /metrics"
    ),
    "reset_mm_cache": "pitstop serves text-only models: there is no multi-modal cache",
    "set_tokenizer": "pass tokenizer=PATH (a folder with tokenizer.json) when building the LLM",
    "add_lora": "pass lora_request=LoRARequest(...) to generate or chat (LLM(enable_lora=True))",
    "remove_lora": "adapters leave their slots least recently used first; nothing to remove",
    "list_loras": "pitstop does not list adapters offline; keep your LoRARequests",
}
"""vLLM's ``LLM`` methods pitstop does not have: what to use instead."""

LORA_REFUSAL = (
    "beam search with an adapter is not in this version of pitstop: use generate(..., "
    "lora_request=...), or merge the adapter into the base weights (peft's "
    "merge_and_unload(), then save_pretrained); pass lora_request=None"
)

CALL_OPTIONS: Mapping[str, str] = {
    "lora_request": LORA_REFUSAL,
    "priority": "pitstop's schedulers admit by arrival (or shortest-first): leave it out",
    "tokenization_kwargs": "pass prompt_token_ids to tokenize the prompt your own way",
    "prompt_adapter_request": "pitstop has no prompt adapters: leave it out",
    "guided_options_request": "give structured_outputs in SamplingParams",
    "mm_processor_kwargs": "pitstop serves text-only models: leave it out",
    "chat_template_content_format": (
        "pitstop passes a message's content to the template as a string (text parts joined)"
    ),
    "concurrency_limit": "pitstop runs every prompt's beams together: leave it out",
}
"""Keyword arguments of vLLM's ``LLM`` calls pitstop has no use for: what instead."""

_CALL_NEUTRAL: Mapping[str, Callable[[Any], bool]] = {
    "priority": lambda v: v is None or (isinstance(v, list | tuple) and not any(v)),
    "chat_template_content_format": lambda v: v in (None, "auto", "string"),
}


def check_call_options(call: str, options: Mapping[str, Any]) -> None:
    """Refuse any of vLLM's extra keyword arguments of ``LLM.<call>`` whose value asks for
    something pitstop does not do (None, and ``priority`` all zero, are accepted)."""
    for name, value in options.items():
        neutral = _CALL_NEUTRAL.get(name, lambda v: v is None)
        if not neutral(value):
            raise InvalidRequestError(
                f"LLM.{call}({name}=...) is vLLM's; pitstop does not do it: {CALL_OPTIONS[name]}"
            )


def refused_method(name: str) -> Callable[..., Any]:
    """A method of ``LLM`` that raises, saying pitstop does not do ``LLM.<name>`` and what to use."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise InvalidRequestError(
            f"LLM.{name} is vLLM's; pitstop does not do it: {REFUSED_METHODS[name]}"
        )

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not in pitstop (vLLM's ``LLM.{name}``): {REFUSED_METHODS[name]}."
    return method


GENERATION_FIELDS: Mapping[str, str] = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
"""``generation_config.json`` keys vLLM reads as sampling defaults, by SamplingParams field."""


def generation_defaults(model: str) -> dict[str, Any]:
    """The SamplingParams values a checkpoint folder's ``generation_config.json`` sets (as
    vLLM reads them: :data:`GENERATION_FIELDS`); empty for a GGUF file, dummy weights or a
    folder without the file. A file that is not a JSON object is a :class:`ConfigError`."""
    file = Path(model) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return {
        field: data[key]
        for key, field in GENERATION_FIELDS.items()
        if key in data and data[key] is not None
    }


def per_prompt_adapters(lora_request: Any, num_prompts: int) -> list[Any]:
    """vLLM's ``lora_request`` of ``generate``/``chat`` as one entry per prompt: a single
    :class:`~pitstop.entrypoints.lora_request.LoRARequest` (or None) for all, or a list of one each."""
    from pitstop.entrypoints.lora_request import LoRARequest

    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise InvalidRequestError(
            f"lora_request must be a LoRARequest, None or a list of them, got {lora_request!r}"
        )
    if len(lora_request) != num_prompts:
        raise InvalidRequestError(
            f"{len(lora_request)} lora requests for {num_prompts} prompts; give one, or one each"
        )
    for item in lora_request:
        if item is not None and not isinstance(item, LoRARequest):
            raise InvalidRequestError(
                f"lora_request items must be LoRARequest or None, got {item!r}"
            )
    return list(lora_request)
