"""``bad_words``: the standard sampler's token sequences, and the tokens each step blocks."""

from __future__ import annotations

import pytest

from pitstop.errors import InvalidRequestError
from pitstop.plugins.samplers.bad_words import bad_word_token_ids, blocked_now


class _Words:
    """A tokenizer of whole words: 'a' -> [1], ' a' -> [2], 'b c' -> [3, 4], ' b c' -> [5, 4]."""

    table = {"a": [1], " a": [2], "b c": [3, 4], " b c": [5, 4], "x y": [6, 7], " x y": [6, 7, 8]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.table[text]


def test_bad_words_semantics() -> None:
    seqs = bad_word_token_ids(_Words(), ["a", " b c", "x y"])
    # as written and with a leading space when that is as long; ' x y' is longer: left out
    assert seqs == ((1,), (2,), (3, 4), (5, 4), (6, 7))
    assert blocked_now(seqs, []) == [1, 2]  # one-token words: always
    assert blocked_now(seqs, [9, 3]) == [1, 2, 4]  # 'b' was the last token: 'c' may not follow
    assert blocked_now(seqs, [5]) == [1, 2, 4]
    assert blocked_now(seqs, [6, 9]) == [1, 2]
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        bad_word_token_ids(None, ["a"])
