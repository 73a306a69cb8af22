"""The prompts `pitstop verify` runs: the set shipped with pitstop, or a JSON-lines file.

One JSON object per line::

    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    {"id": "fib", "prompt": "def fibonacci(n):", "max_tokens": 48}

``prompt`` (plain text, completed as is) or ``messages`` (a chat, rendered with
the model's chat template) is required, exactly one of them; ``max_tokens``
(default 32) and ``id`` (a label for the report) are optional. Blank lines are
skipped. Every mistake is a :class:`~pitstop.errors.ConfigError` that names the
file, the line and the fix, raised before any weight loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from pitstop.errors import ConfigError

DEFAULT_MAX_TOKENS = 32
SHIPPED_PROMPTS = "prompts.jsonl"  # package data of pitstop.verify
KEYS = ("id", "prompt", "messages", "max_tokens")
_SCHEMA = (
    'each line is a JSON object with "prompt" (text) or "messages" (a chat: a list of '
    '{"role": ..., "content": ...}), and optionally "max_tokens" (an integer >= 1) and "id" (a label)'
)

Message = dict[str, str]


@attrs.frozen
class VerifyPrompt:
    """One prompt of the set: plain text or a chat, and how many tokens to generate."""

    id: str
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    source: str = ""  # where it came from ("file.jsonl:3"), for messages

    @property
    def label(self) -> str:
        """A one-line label for the report: the id, else the start of the text."""
        if self.id:
            return self.id
        text = self.prompt if self.prompt is not None else (self.messages or ({},))[-1]["content"]
        return " ".join(text.split())

    def to_dict(self) -> dict[str, Any]:
        """The prompt as one line of a prompts file would hold it."""
        data: dict[str, Any] = {"id": self.id} if self.id else {}
        if self.prompt is not None:
            data["prompt"] = self.prompt
        else:
            data["messages"] = [dict(m) for m in self.messages or ()]
        data["max_tokens"] = self.max_tokens
        return data


def shipped_prompts_path() -> Path:
    """Where the shipped prompt set lives (``pitstop/verify/prompts.jsonl``): a template
    for a file of your own."""
    return Path(str(resources.files("pitstop.verify") / SHIPPED_PROMPTS))


def shipped_prompts() -> list[VerifyPrompt]:
    """The fixed prompt set that ships with pitstop: chat, code, a list, arithmetic, edits."""
    text = (resources.files("pitstop.verify") / SHIPPED_PROMPTS).read_text(encoding="utf-8")
    return parse_prompt_lines(text.splitlines(), f"pitstop/verify/{SHIPPED_PROMPTS}")


def load_prompts(path: str | Path) -> list[VerifyPrompt]:
    """Read a JSON-lines prompts file; a missing file or a bad line is a ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(
            f"prompts file {path} does not exist; pass a JSON-lines file ({_SCHEMA})"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc}") from exc
    prompts = parse_prompt_lines(text.splitlines(), str(path))
    if not prompts:
        raise ConfigError(f"prompts file {path} holds no prompts; {_SCHEMA}")
    return prompts


def parse_prompt_lines(lines: Iterable[str], where: str = "<prompts>") -> list[VerifyPrompt]:
    """Parse JSON lines (blank ones skipped); ``where`` names the source in errors."""
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{at}: not valid JSON ({exc.msg} at column {exc.colno}); {_SCHEMA}"
            ) from exc
        prompts.append(prompt_from_dict(data, at))
    return prompts


def prompt_from_dict(data: Any, at: str = "<prompt>") -> VerifyPrompt:
    """Validate one parsed line; ``at`` ("file:line") starts every error message."""
    if not isinstance(data, dict):
        raise ConfigError(f"{at}: expected a JSON object, got {type(data).__name__}; {_SCHEMA}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(
            f"{at}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
            f"{', '.join(map(repr, KEYS))}"
        )
    prompt, messages = data.get("prompt"), data.get("messages")
    if (prompt is None) == (messages is None):
        raise ConfigError(
            f'{at}: give exactly one of "prompt" and "messages"'
            + (" (both are set)" if prompt is not None else " (neither is set)")
            + f"; {_SCHEMA}"
        )
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ConfigError(f'{at}: "prompt" must be a non-empty string, got {prompt!r}')
    chat = None if messages is None else _messages(messages, at)
    max_tokens = data.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f'{at}: "max_tokens" must be an integer >= 1, got {max_tokens!r}')
    label = data.get("id", "")
    if not isinstance(label, str | int) or isinstance(label, bool):
        raise ConfigError(f'{at}: "id" must be a string, got {label!r}')
    return VerifyPrompt(str(label), prompt, chat, max_tokens, at)


def _messages(value: Any, at: str) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f'{at}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} '
            f"objects, got {value!r}"
        )
    for i, m in enumerate(value):
        ok = (
            isinstance(m, dict)
            and set(m) == {"role", "content"}
            and all(isinstance(v, str) for v in m.values())
            and m["role"]
        )
        if not ok:
            raise ConfigError(
                f'{at}: message {i} must be {{"role": "<system|user|assistant>", "content": '
                f'"<text>"}}, got {m!r}'
            )
    return tuple(dict(m) for m in value)
