"""Output tokens to text deltas, one instance per sequence (vLLM's incremental method)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# How many prompt tokens the detokenizer keeps as context for the first output
# token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): some tokenizers
# decode a token differently at the start of a text (leading spaces).
_DETOKENIZE_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a stream of output tokens into text deltas, one instance per sequence.

    vLLM's method: decode a small window ``ids[prefix_offset:]`` and emit what it
    adds beyond ``ids[prefix_offset:read_offset]``. Text that ends in U+FFFD (an
    incomplete UTF-8 character split across tokens) is held back until the
    character completes; :meth:`flush` releases it when the sequence ends.
    """

    def __init__(
        self,
        tokenizer: Any,  # a pitstop.loading.tokenizer.Tokenizer: decode(ids, skip_special)
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._parts)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly finalized text (possibly empty)."""
        self._ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Release text held back at the end of the sequence (an incomplete character)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix) :]
        # The new window starts at the old read offset; drop the ids before it so
        # the list stays short on long outputs.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._parts.append(delta)
        return delta
