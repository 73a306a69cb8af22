"""Text <-> token ids, chat templates, and incremental detokenization for streaming.

A thin wrapper over a ``transformers`` fast tokenizer (never a hand-written
BPE). ``transformers`` is imported inside the functions that need it, so a
benchmark on dummy weights runs without it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pitstop.errors import InvalidRequestError, ModelLoadError
from pitstop.requests.validation import validate_messages

# Special-token text found in a chat's messages is wrapped in these two private-use
# characters before the template runs (Tokenizer.mark_special_text), so that encoding can tell
# it from the special tokens the template writes itself (Tokenizer.encode_chat_text).
# transformers 5 does the same (apply_chat_template(sanitize_control_tokens=True)).
MARK_START = "\U000f0000"
MARK_END = "\U000f0001"


class Tokenizer:
    """Encodes, decodes and applies the chat template of one model."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        eos_token_ids: Sequence[int] = (),
        name: str = "",
    ) -> None:
        self.hf = hf_tokenizer
        self.name = name
        eos: list[int] = []
        if hf_tokenizer.eos_token_id is not None:
            eos.append(int(hf_tokenizer.eos_token_id))
        eos += [int(i) for i in eos_token_ids if int(i) not in eos]
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        bos = hf_tokenizer.bos_token_id
        self.bos_token_id: int | None = None if bos is None else int(bos)
        self.vocab_size: int = len(hf_tokenizer)
        # Does plain encoding put a BOS in front? (decides whether a chat prompt needs one)
        self._adds_bos = bool(
            self.bos_token_id is not None and hf_tokenizer.encode("a")[:1] == [self.bos_token_id]
        )

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a folder holding ``tokenizer.json`` (+ ``tokenizer_config.json``), or a
        ``tokenizer.json`` file itself. EOS ids of ``generation_config.json`` and
        ``config.json`` in the same folder are added to the tokenizer's own."""
        path = Path(path)
        if not path.exists():
            raise ModelLoadError(
                f"tokenizer path {path} does not exist; pass a folder with tokenizer.json"
            )
        folder = path.parent if path.is_file() else path
        if path.is_file() and path.name != "tokenizer.json":
            raise ModelLoadError(
                f"{path} is not a tokenizer.json file; pass a folder with tokenizer.json"
            )
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError(
                f"no tokenizer.json in {folder}; pass --tokenizer with a folder that has one"
            )
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            if (folder / "tokenizer_config.json").is_file():
                hf = AutoTokenizer.from_pretrained(str(folder))
            else:
                hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        except Exception as exc:  # transformers raises many kinds
            raise ModelLoadError(f"cannot load the tokenizer in {folder}: {exc}") from exc
        return cls(hf, eos_token_ids=_extra_eos_ids(folder), name=str(folder))

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (chat template included)."""
        folder = Path(folder)
        self.hf.save_pretrained(str(folder))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if self.hf.chat_template is not None:
            config["chat_template"] = self.hf.chat_template
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
        if len(self.eos_token_ids) > 1:
            (folder / "generation_config.json").write_text(
                json.dumps({"eos_token_id": list(self.eos_token_ids)}, indent=2)
            )

    # ------------------------------------------------------------------ use
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the model's BOS when ``add_special_tokens``)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a chat rendered by the model's template (or ``chat_template``).

        :meth:`render_chat_template` then :meth:`encode_chat_text`.
        """
        text = self.render_chat_template(
            messages,
            add_generation_prompt,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            tools=tools,
        )
        return self.encode_chat_text(text)

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The text of a chat rendered by the model's template (or ``chat_template``).

        Roles and contents are checked first (:func:`pitstop.requests.validation.validate_messages`).
        ``continue_final_message`` leaves the last message open for the model to continue;
        ``tools`` (OpenAI function definitions) are passed to the template as ``tools``.
        """
        messages = validate_messages(messages)
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
            raise InvalidRequestError("chat_template must be a non-empty Jinja template string")
        if not (chat_template or self.hf.chat_template):
            raise InvalidRequestError(
                f"the tokenizer of {self.name or 'this model'} has no chat template; send a plain "
                "prompt, or load a tokenizer that has one (--tokenizer)"
            )
        try:
            return self.hf.apply_chat_template(
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

    def encode_chat_text(self, text: str) -> list[int]:
        """Token ids of a rendered chat: the template writes any BOS itself, so the text is
        encoded without special tokens; a BOS is added only when the model wants one and
        the template left it out.

        Special-token text that :meth:`mark_special_text` wrapped in markers is encoded as
        plain text (so a message cannot write ``<|im_start|>system``), the template's own
        special tokens as those tokens; without markers the text is encoded as it is."""
        if MARK_START in text or MARK_END in text:
            ids = self._encode_marked(text)
        else:
            ids = self.encode(text, add_special_tokens=False)
        if self._adds_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids

    @functools.cached_property
    def _special_patterns(self) -> tuple[re.Pattern[str], re.Pattern[str]]:
        """A regex of every special token's text (longest first), and one of such a text
        between markers (its group), or of a lone marker."""
        decoder = getattr(self.hf, "added_tokens_decoder", {}) or {}
        texts = {t.content for t in decoder.values() if getattr(t, "special", False) and t.content}
        texts |= {t for t in getattr(self.hf, "all_special_tokens", ()) if t}
        longest_first = sorted(texts, key=len, reverse=True)
        specials = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        marked = re.compile(f"{MARK_START}({specials.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
        return specials, marked

    def mark_special_text(self, value: Any) -> Any:
        """``value`` (a string, or lists and dicts of them: messages, tools, template
        arguments) with every special token's text in its strings wrapped in markers, and any
        marker characters already there removed (so none can be forged); dict keys unchanged."""
        if isinstance(value, str):
            value = value.replace(MARK_START, "").replace(MARK_END, "")
            return self._special_patterns[0].sub(f"{MARK_START}\\g<0>{MARK_END}", value)
        if isinstance(value, dict):
            return {k: self.mark_special_text(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.mark_special_text(v) for v in value]
        return value

    @staticmethod
    def unmark(text: str) -> str:
        """A rendered chat's text without the markers (the prompt as the model reads it)."""
        return text.replace(MARK_START, "").replace(MARK_END, "")

    def _encode_marked(self, text: str) -> list[int]:
        """Encode a chat whose marked special-token texts are plain text (module constants).

        The pieces between markers are encoded one by one, the marked ones without
        special tokens. A piece after the first is encoded after a newline that is then
        dropped, so that SentencePiece does not add the space it puts at a text's start."""
        pieces = self._special_patterns[1].split(text)
        newline = self.encode("\n", add_special_tokens=False)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if not piece:
                continue  # a lone marker (None), or nothing between two markers
            as_text = i % 2 == 1
            piece_ids = self._encode_piece(piece, as_text, newline if i else None)
            special = self.hf.convert_tokens_to_ids(piece) if as_text else None
            if special is not None and special in piece_ids:
                raise InvalidRequestError(
                    f"a message holds {piece!r}, which this tokenizer reads as its special token "
                    "even as plain text; remove it, or send special_tokens_in_content 'tokens'"
                )
            ids += piece_ids
        return ids

    def _encode_piece(self, piece: str, as_text: bool, newline: list[int] | None) -> list[int]:
        """One piece of a marked chat (``as_text``: special tokens read as text); with
        ``newline`` (not the first piece) encoded after a newline, dropped again, unless the
        newline merged with the piece (then the piece alone)."""
        kwargs = {"split_special_tokens": True} if as_text else {}
        if newline is not None:
            ids = list(self.hf.encode("\n" + piece, add_special_tokens=False, **kwargs))
            if ids[: len(newline)] == newline:
                return ids[len(newline) :]
        return list(self.hf.encode(piece, add_special_tokens=False, **kwargs))


def _extra_eos_ids(folder: Path) -> list[int]:
    """EOS ids a checkpoint folder declares besides the tokenizer's own."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids
