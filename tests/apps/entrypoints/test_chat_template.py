"""pitstop.entrypoints.chat_template: a chat through the model's template, against
transformers' rendering of SmolLM2's; the checks of a chat's messages."""

from __future__ import annotations

import pytest
from helpers.models import (
    make_tiny_checkpoint,
    smollm2_tokenizer_dir,
    transformers_smollm2_tokenizer,
)

from pitstop.entrypoints.chat_template import apply_chat_template, validate_messages
from pitstop.errors import InvalidRequestError
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugins.model_sources.huggingface.tokenizer import load_hf_tokenizer

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語?"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    """SmolLM2's tokenizer as the engine loads it (converted from the GGUF, then cached)."""
    return load_hf_tokenizer(smollm2_tokenizer_dir())


@pytest.fixture(scope="module")
def ref():
    """transformers' tokenizer built straight from the GGUF (shared, read only)."""
    return transformers_smollm2_tokenizer()


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(ours, ref, messages, add_generation_prompt):
    expected = ref.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = list(expected["input_ids"])
    ids = apply_chat_template(ours, messages, add_generation_prompt=add_generation_prompt)
    assert ids == expected
    assert ids[:2] != [ours.bos_token_id] * 2  # no double BOS
    text = ours.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_no_chat_template_is_a_clear_error(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "llama", with_tokenizer=False)
    (folder / "tokenizer.json").write_bytes(
        (smollm2_tokenizer_dir() / "tokenizer.json").read_bytes()
    )
    tok = load_hf_tokenizer(folder)  # tokenizer.json alone: no template
    assert tok.encode("hi", add_special_tokens=False) == [6004]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])


def test_validate_messages() -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert validate_messages(chat) == chat
    for messages, fragment in [
        ([{"role": "wizard", "content": "hi"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": "\ud800"}], "surrogate"),
        (["hi"], "object"),
        ("hi", "list"),
        ([], "empty"),
    ]:
        with pytest.raises(InvalidRequestError, match=fragment):
            validate_messages(messages)
