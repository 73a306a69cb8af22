"""The prompt forms ``LLM.generate`` accepts, as vLLM has them.

A prompt is a string, a :class:`TextPrompt` (``{"prompt": "..."}``) or a
:class:`TokensPrompt` (``{"prompt_token_ids": [...]}``); ``generate`` takes
one of these or a list of them. :func:`parse_prompts` turns any of those
forms into ``(text, token_ids)`` pairs and refuses everything else with an
:class:`~pitstop.errors.InvalidRequestError` that says what to send.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict

from pitstop.errors import InvalidRequestError


class TextPrompt(TypedDict):
    """A text prompt: ``{"prompt": "Hello"}``."""

    prompt: str
    multi_modal_data: NotRequired[Any]


class TokensPrompt(TypedDict):
    """A prompt given as token ids: ``{"prompt_token_ids": [1, 2, 3]}``."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[Any]


PromptType = str | TextPrompt | TokensPrompt
"""One prompt in any of the accepted forms."""

_FORMS = "a string, {'prompt': str}, {'prompt_token_ids': [int, ...]}, or a list of these"


def _one(item: Any, where: str) -> tuple[str | None, list[int] | None]:
    if isinstance(item, str):
        return item, None
    if isinstance(item, Mapping):
        keys = set(item)
        if "multi_modal_data" in keys and item["multi_modal_data"] is not None:
            raise InvalidRequestError(
                f"{where}: multi_modal_data is not supported (pitstop serves text models)"
            )
        keys.discard("multi_modal_data")
        if keys == {"prompt"} and isinstance(item["prompt"], str):
            return item["prompt"], None
        if keys == {"prompt_token_ids"}:
            ids = item["prompt_token_ids"]
            if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
                raise InvalidRequestError(
                    f"{where}.prompt_token_ids must be a list of token ids, got "
                    f"{type(ids).__name__}"
                )
            return None, list(ids)
        raise InvalidRequestError(
            f"{where} has keys {sorted(keys)}; a prompt dict has exactly one of 'prompt' (str) "
            "or 'prompt_token_ids' (list of int)"
        )
    raise InvalidRequestError(f"{where} is a {type(item).__name__}; give {_FORMS}")


def parse_prompts(prompts: Any) -> list[tuple[str | None, list[int] | None]]:
    """Every prompt of ``prompts`` (one or a list, in any accepted form) as ``(text, ids)``."""
    if prompts is None:
        raise InvalidRequestError(f"no prompts given; give {_FORMS}")
    if isinstance(prompts, str | Mapping):
        return [_one(prompts, "prompt")]
    if not isinstance(prompts, Sequence):
        raise InvalidRequestError(f"prompts is a {type(prompts).__name__}; give {_FORMS}")
    if not prompts:
        raise InvalidRequestError(f"the list of prompts is empty; give {_FORMS}")
    return [_one(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
