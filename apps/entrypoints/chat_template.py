"""A chat's messages through the model's chat template, into text and token ids.

Functions over a :class:`~pitstop.loading.tokenizer.Tokenizer` (the engine itself
encodes and decodes only): :func:`validate_messages` checks a chat's roles and contents,
:func:`render_chat_template` renders it with the model's template (or a request's own),
:func:`encode_chat_text` encodes the rendered text, and :func:`apply_chat_template` does
both. ``LLM.chat`` and the server reach them through :func:`pitstop.entrypoints.chat.render_chat`.

Special-token text found in a chat's messages is wrapped in two private-use characters
before the template runs (:func:`mark_special_text`), so that encoding can tell it from the
special tokens the template writes itself (:func:`encode_chat_text`); transformers 5 does
the same (``apply_chat_template(sanitize_control_tokens=True)``).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pitstop.errors import InvalidRequestError
from pitstop.errors import fail_request as _fail
from pitstop.requests.validation import check_text

if TYPE_CHECKING:
    from pitstop.loading.tokenizer import Tokenizer

MARK_START = "\U000f0000"
MARK_END = "\U000f0001"

CHAT_ROLES = ("system", "user", "assistant", "tool")

# per tokenizer: a regex of its special tokens' texts, and one of such a text between markers
_PATTERNS: weakref.WeakKeyDictionary[Any, tuple[re.Pattern[str], re.Pattern[str]]] = (
    weakref.WeakKeyDictionary()
)


def _type_name(value: Any) -> str:
    return "a bool" if isinstance(value, bool) else type(value).__name__


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """A chat as a list of ``{"role", "content"}`` dicts, checked before the template runs.

    Roles are ``system``, ``user``, ``assistant`` and ``tool``; content is a
    string (empty allowed). Other keys pass through to the template.
    """
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Iterable):
        _fail(
            f"messages must be a list of {{'role', 'content'}} objects, got {_type_name(messages)}"
        )
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            _fail(
                f"messages[{i}] must be an object with role and content, got {_type_name(message)}"
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            _fail(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = message.get("content", "")
        check_text(f"messages[{i}].content", "" if content is None else content)
        out.append(dict(message))
    if not out:
        _fail("messages is empty; send at least one message")
    return out


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a chat rendered by the model's template (or ``chat_template``).

    :func:`render_chat_template` then :func:`encode_chat_text`.
    """
    text = render_chat_template(
        tokenizer,
        messages,
        add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
        tools=tools,
    )
    return encode_chat_text(tokenizer, text)


def render_chat_template(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text of a chat rendered by the model's template (or ``chat_template``).

    Roles and contents are checked first (:func:`validate_messages`).
    ``continue_final_message`` leaves the last message open for the model to continue;
    ``tools`` (OpenAI function definitions) are passed to the template as ``tools``.
    """
    messages = validate_messages(messages)
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise InvalidRequestError("chat_template must be a non-empty Jinja template string")
    if not (chat_template or tokenizer.hf.chat_template):
        raise InvalidRequestError(
            f"the tokenizer of {tokenizer.name or 'this model'} has no chat template; send a "
            "plain prompt, or load a tokenizer that has one (--tokenizer)"
        )
    try:
        return tokenizer.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja errors, bad message shapes
        raise InvalidRequestError(
            f"cannot apply the chat template to these messages: {exc}"
        ) from exc


def encode_chat_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat: the template writes any BOS itself, so the text is
    encoded without special tokens; a BOS is added only when the model wants one and
    the template left it out.

    Special-token text that :func:`mark_special_text` wrapped in markers is encoded as
    plain text (so a message cannot write ``<|im_start|>system``), the template's own
    special tokens as those tokens; without markers the text is encoded as it is."""
    if MARK_START in text or MARK_END in text:
        ids = _encode_marked(tokenizer, text)
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.adds_bos and ids[:1] != [tokenizer.bos_token_id]:
        ids.insert(0, tokenizer.bos_token_id)  # type: ignore[arg-type]
    return ids


def _special_patterns(tokenizer: Tokenizer) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """A regex of every special token's text (longest first), and one of such a text
    between markers (its group), or of a lone marker; made once per tokenizer."""
    found = _PATTERNS.get(tokenizer)
    if found is not None:
        return found
    hf = tokenizer.hf
    decoder = getattr(hf, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in decoder.values() if getattr(t, "special", False) and t.content}
    texts |= {t for t in getattr(hf, "all_special_tokens", ()) if t}
    longest_first = sorted(texts, key=len, reverse=True)
    specials = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
    marked = re.compile(f"{MARK_START}({specials.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
    _PATTERNS[tokenizer] = (specials, marked)
    return specials, marked


def mark_special_text(tokenizer: Tokenizer, value: Any) -> Any:
    """``value`` (a string, or lists and dicts of them: messages, tools, template
    arguments) with every special token's text in its strings wrapped in markers, and any
    marker characters already there removed (so none can be forged); dict keys unchanged."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return _special_patterns(tokenizer)[0].sub(f"{MARK_START}\\g<0>{MARK_END}", value)
    if isinstance(value, dict):
        return {k: mark_special_text(tokenizer, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [mark_special_text(tokenizer, v) for v in value]
    return value


def unmark(text: str) -> str:
    """A rendered chat's text without the markers (the prompt as the model reads it)."""
    return text.replace(MARK_START, "").replace(MARK_END, "")


def _encode_marked(tokenizer: Tokenizer, text: str) -> list[int]:
    """Encode a chat whose marked special-token texts are plain text (module constants).

    The pieces between markers are encoded one by one, the marked ones without
    special tokens. A piece after the first is encoded after a newline that is then
    dropped, so that SentencePiece does not add the space it puts at a text's start."""
    pieces = _special_patterns(tokenizer)[1].split(text)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if not piece:
            continue  # a lone marker (None), or nothing between two markers
        as_text = i % 2 == 1
        piece_ids = _encode_piece(tokenizer, piece, as_text, newline if i else None)
        special = tokenizer.hf.convert_tokens_to_ids(piece) if as_text else None
        if special is not None and special in piece_ids:
            raise InvalidRequestError(
                f"a message holds {piece!r}, which this tokenizer reads as its special token "
                "even as plain text; remove it, or send special_tokens_in_content 'tokens'"
            )
        ids += piece_ids
    return ids


def _encode_piece(
    tokenizer: Tokenizer, piece: str, as_text: bool, newline: list[int] | None
) -> list[int]:
    """One piece of a marked chat (``as_text``: special tokens read as text); with
    ``newline`` (not the first piece) encoded after a newline, dropped again, unless the
    newline merged with the piece (then the piece alone)."""
    kwargs = {"split_special_tokens": True} if as_text else {}
    if newline is not None:
        ids = list(tokenizer.hf.encode("\n" + piece, add_special_tokens=False, **kwargs))
        if ids[: len(newline)] == newline:
            return ids[len(newline) :]
    return list(tokenizer.hf.encode(piece, add_special_tokens=False, **kwargs))
