"""The one table of docs/api.md: every vLLM name and what pitstop does with it.

The rule it shows: a value that asks for what pitstop already does runs;
anything else is refused by name with the alternative. Its rows come from
the code that applies the rule, so the table cannot drift from it:

- ``LLM`` arguments, TOML keys and engine flags: :mod:`pitstop.entrypoints.vllm_args`
  (renamed, same name, accepted, refused with the values accepted, removed
  from vLLM);
- ``pitstop serve`` flags: the serve parser's own flags that vLLM's
  ``vllm serve`` has, and :data:`pitstop.entrypoints.vllm_args.SERVE_REFUSED`;
- ``SamplingParams`` fields: its attrs fields and
  :data:`pitstop.entrypoints.sampling_params.VLLM_ONLY` / ``VLLM_NEUTRAL``;
- ``LLM`` methods and call keywords: :mod:`pitstop.entrypoints.vllm_surface`.

``python -m pitstop.server.vllm_table`` prints it; tests/apps/entrypoints/test_vllm_args.py checks
that docs/api.md holds the current rendering.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Iterable
from typing import Any

import attrs

from pitstop.entrypoints.vllm_args import (
    ACCEPTED,
    NEUTRAL,
    REFUSED,
    REMOVED,
    RENAMED,
    SAME_NAME,
    SERVE_REFUSED,
)

VLLM_SERVE_FLAGS: tuple[str, ...] = (
    "host",
    "port",
    "api_key",
    "served_model_name",
    "allowed_origins",
    "uvicorn_log_level",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "chat_template",
    "trust_request_chat_template",
    "lora_modules",
    "enable_sleep_mode",
)
"""Flags of ``vllm serve`` (beyond the engine's) that ``pitstop serve`` may have as they are;
those it lacks must be in :data:`pitstop.entrypoints.vllm_args.SERVE_REFUSED` (a test checks)."""

IMPLEMENTED_METHODS: tuple[str, ...] = (
    "generate",
    "chat",
    "beam_search",
    "get_tokenizer",
    "get_default_sampling_params",
    "sleep",
    "wake_up",
    "reset_prefix_cache",
)
"""vLLM's ``LLM`` methods pitstop has, with vLLM's arguments."""


def _accepted(values: Iterable[Any]) -> str:
    shown = ", ".join(
        f"{type(v).__name__}.{v.name}" if isinstance(v, enum.Enum) else repr(v) for v in values
    )
    return f"; {shown} accepted (what pitstop does)" if shown else ""


def argument_rows() -> list[tuple[str, str, str]]:
    """(name, kind, pitstop) of every ``LLM`` argument / engine flag of vLLM."""
    kind = "`LLM(...)`, flag"
    rows = [
        (r.vllm, kind, f"`{r.pitstop}`" + (f" ({r.note})" if r.note else "") + "; None: default")
        for r in RENAMED
    ]
    rows += [(name, kind, "same name; None: pitstop's default") for name in SAME_NAME]
    rows += [(name, kind, text) for name, text in ACCEPTED.items()]
    for name, text in REFUSED.items():
        rows.append((name, kind, f"refused: {text}{_accepted((None, *NEUTRAL.get(name, ())))}"))
    rows += [(name, kind, f"removed from vLLM, refused: {text}") for name, text in REMOVED.items()]
    return rows


def serve_rows(serve_flags: Iterable[str] | None = None) -> list[tuple[str, str, str]]:
    """(flag, kind, pitstop) of ``vllm serve``'s own flags; ``serve_flags``: the long flags of
    ``pitstop serve`` (default: read from its parser)."""
    have = set(_serve_flags() if serve_flags is None else serve_flags)
    rows = []
    for name in sorted(set(VLLM_SERVE_FLAGS) | set(SERVE_REFUSED)):
        flag = "--" + name.replace("_", "-")
        if flag in have:
            rows.append((flag, "`pitstop serve`", "same flag"))
        else:
            neutral = _accepted((None, *NEUTRAL.get(name, ())))
            rows.append((flag, "`pitstop serve`", f"refused: {SERVE_REFUSED[name]}{neutral}"))
    return rows


def sampling_rows() -> list[tuple[str, str, str]]:
    """(field, kind, pitstop) of vLLM's ``SamplingParams`` fields."""
    from pitstop.entrypoints.sampling_params import VLLM_NEUTRAL, VLLM_ONLY, SamplingParams

    kind = "`SamplingParams`"
    rows = [(a.name, kind, "same field") for a in attrs.fields(SamplingParams)]
    for name, text in VLLM_ONLY.items():
        rows.append((name, kind, f"refused: {text}{_accepted(VLLM_NEUTRAL.get(name, ()))}"))
    return rows


def method_rows() -> list[tuple[str, str, str]]:
    """(name, kind, pitstop) of vLLM's ``LLM`` methods and their extra keywords."""
    from pitstop.entrypoints.vllm_surface import CALL_OPTIONS, REFUSED_METHODS

    rows = [(f"{m}()", "`LLM` method", "same method") for m in IMPLEMENTED_METHODS]
    rows += [(f"{m}()", "`LLM` method", f"refused: {t}") for m, t in REFUSED_METHODS.items()]
    for name, text in CALL_OPTIONS.items():
        neutral = "None, all-zero" if name == "priority" else "None"
        if name == "chat_template_content_format":
            neutral = "'auto', 'string'"
        rows.append((name, "`LLM` call keyword", f"refused: {text}; {neutral} accepted"))
    return rows


def all_rows(serve_flags: Iterable[str] | None = None) -> list[tuple[str, str, str]]:
    """Every row, grouped by kind, sorted by name within a kind."""
    groups = [argument_rows(), serve_rows(serve_flags), sampling_rows(), method_rows()]
    return [row for group in groups for row in sorted(group)]


def markdown_table(serve_flags: Iterable[str] | None = None) -> str:
    """docs/api.md's table, as Markdown."""
    lines = ["| vLLM | where | pitstop |", "|---|---|---|"]
    lines += [f"| `{name}` | {kind} | {text} |" for name, kind, text in all_rows(serve_flags)]
    return "\n".join(lines)


def _serve_flags() -> list[str]:
    """The long flags ``pitstop serve`` shows (its parser, built without the web libraries)."""
    from pitstop.server.cli import add_arguments

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_arguments(parser)
    return [
        o
        for action in parser._actions
        if action.help is not argparse.SUPPRESS
        for o in action.option_strings
    ]


if __name__ == "__main__":
    print(markdown_table())
