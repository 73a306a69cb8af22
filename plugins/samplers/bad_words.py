"""``SamplingParams.bad_words``: words a request never generates, as token sequences.

The standard sampler's: its ``prepare_request`` tokenizes a request's words once, when the
request enters (:func:`bad_word_token_ids`), and each step's :func:`blocked_now` masks
the tokens that would complete one (:func:`pitstop.plugins.samplers.batch.make_step_inputs`).

Each word is tokenized as written (leading spaces dropped) and, when that
gives other tokens of the same length, with one leading space (how the word
reads after another word). A sequence of one token is blocked at every step;
a longer one blocks its last token at a step whose previous output tokens
are the rest of it, so the word can never be completed. Only generated
tokens count (the prompt does not start a bad word), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pitstop.errors import InvalidRequestError


def bad_word_token_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``words`` to block (see the module docstring)."""
    if tokenizer is None:
        raise InvalidRequestError(
            "bad_words needs the model's tokenizer; this model has none: block tokens with "
            "logit_bias={id: -100} instead"
        )
    found: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InvalidRequestError(
                f"bad_words: {word!r} encodes to no tokens; remove it or give visible text"
            )
        found.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced != plain and len(spaced) == len(plain):
            found.append(spaced)
    return tuple(dict.fromkeys(found))


def blocked_now(sequences: Sequence[tuple[int, ...]], output_ids: Sequence[int]) -> list[int]:
    """The tokens the bad-word ``sequences`` block after ``output_ids`` (known tokens only)."""
    blocked = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (
            len(output_ids) >= prefix and tuple(output_ids[len(output_ids) - prefix :]) == seq[:-1]
        ):
            blocked.append(seq[-1])
    return blocked
