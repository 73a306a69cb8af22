"""Tokenizer: SmolLM2's (from the GGUF, through the pitstop cache) against transformers',
and the incremental detokenizer on random token streams. (Chat templates:
tests/apps/entrypoints/test_chat_template.py.)"""

from __future__ import annotations

import pytest
from helpers.models import smollm2_tokenizer_dir, transformers_smollm2_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pitstop.entrypoints.chat_template import apply_chat_template
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugins.model_sources.huggingface.tokenizer import load_hf_tokenizer
from pitstop.requests.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "naïve café, 日本語のテキスト, emoji 🤖🚀 and a family 👨‍👩‍👧",
    "line one\nline two\n\n\ttabbed",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    """SmolLM2's tokenizer as the engine loads it (converted from the GGUF, then cached)."""
    return load_hf_tokenizer(smollm2_tokenizer_dir())


@pytest.fixture(scope="module")
def ref():
    """transformers' tokenizer built straight from the GGUF (shared, read only)."""
    return transformers_smollm2_tokenizer()


def test_metadata(ours, ref):
    assert ours.vocab_size == len(ref) == 49152
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.eos_token_ids == (2,)
    assert ours.chat_template == ref.chat_template is not None


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(ours, ref, text):
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == ref.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60))
def test_encode_decode_random_text(ours, ref, text):
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------- detokenizer
_MULTIBYTE = "é日本語🤖🚀👨‍👩‍👧Ωж"


@st.composite
def token_streams(draw, vocab_size: int, special_ids: list[int], multibyte_ids: list[int]):
    """Output ids mixing random vocabulary, byte tokens of multi-byte characters
    (split mid-character) and special tokens, cut into random step sizes (up to the whole
    stream at once: a sample without stop strings decodes all its tokens since its last
    output in one step)."""
    pieces = st.one_of(
        st.integers(0, vocab_size - 1),
        st.sampled_from(multibyte_ids),
        st.sampled_from(special_ids),
    )
    ids = draw(st.lists(pieces, max_size=40))
    steps, i = [], 0
    while i < len(ids):
        n = draw(st.one_of(st.integers(1, 4), st.integers(5, 40)))
        steps.append(ids[i : i + n])
        i += n
    return ids, steps


def _check_stream(tok: Tokenizer, prompt: list[int], ids: list[int], steps, skip: bool) -> None:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.step(step) for step in steps]
    for delta in deltas:
        # a delta never ends inside a character (unless the stream itself is broken there)
        assert not delta.endswith("\ufffd") or "\ufffd" in tok.decode(ids, skip)
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_streams_multibyte_characters(ours):
    ids = ours.encode("A robot 🤖 says 日本語, naïvely.", add_special_tokens=False)
    prompt = apply_chat_template(ours, [{"role": "user", "content": "hi"}])
    detok = IncrementalDetokenizer(ours, prompt)
    deltas = [detok.step([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "A robot 🤖 says 日本語, naïvely."
    assert detok.flush() == ""
    assert deltas.count("") > 0  # the emoji's byte tokens were held back until complete


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans())
def test_detokenizer_deltas_equal_full_decode(ours, data, skip):
    multibyte_ids = sorted(set(ours.encode(_MULTIBYTE, add_special_tokens=False)))
    specials = [0, 1, 2]
    ids, steps = data.draw(token_streams(ours.vocab_size, specials, multibyte_ids))
    prompt = data.draw(
        st.sampled_from([[], ours.encode("Hi there, ", add_special_tokens=False), [1, 2]])
    )
    _check_stream(ours, prompt, ids, steps, skip)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), skip=st.booleans())
def test_decode_through_the_backend_equals_transformers_decode(ours, ref, ids, skip):
    """The engine decodes through the Rust tokenizer directly (no clean-up follows it for
    SmolLM2): the same text as transformers' ``decode`` for any ids, special ones included."""
    assert ours._backend_decode is not None, "SmolLM2's tokenizer takes the direct path"
    assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip) == ours.hf.decode(ids, skip_special_tokens=skip)
