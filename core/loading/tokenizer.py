"""Text <-> token ids: the :class:`Tokenizer` the engine encodes prompts and stop strings
with and detokenizes outputs with.

A thin wrapper over a ``transformers`` fast tokenizer (never a hand-written BPE), made by
a model source (``huggingface`` reads ``tokenizer.json``, ``gguf`` a file's own). Chat
templates are the entry points' concern (:mod:`pitstop.entrypoints.chat_template`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Tokenizer:
    """Encodes and decodes the text of one model."""

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
        # decoding straight through the Rust tokenizer where transformers' decode adds nothing
        # to it (no clean-up of spaces after it): a third of the time a call, and the engine
        # decodes twice a token a sequence (the incremental detokenizer)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        cleans = getattr(hf_tokenizer, "clean_up_tokenization_spaces", True)
        self._backend_decode = None if backend is None or cleans else backend.decode
        # Does plain encoding put a BOS in front? (decides whether a chat prompt needs one)
        self.adds_bos = bool(
            self.bos_token_id is not None and hf_tokenizer.encode("a")[:1] == [self.bos_token_id]
        )

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the model's BOS when ``add_special_tokens``)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens left out when ``skip_special_tokens``)."""
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string, as the vocabulary spells it."""
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (Jinja), or None."""
        return self.hf.chat_template
