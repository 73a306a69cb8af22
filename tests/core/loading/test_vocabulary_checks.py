"""Every loader checks the tokenizer and the special-token ids against the model's vocabulary
(issue 32): a mismatched checkpoint is refused at load, not by an index error per request."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.checkpoints import TINY_VOCAB, write_gguf_from_hf
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams
from pitstop.errors import InvalidRequestError, ModelLoadError
from pitstop.loading.weights import load_model_source
from pitstop.requests.validation import check_encoded_prompt


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path / "pitstop-cache"))


def test_a_folder_whose_vocab_is_smaller_than_its_tokenizer_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama", vocab_size=64)
    with pytest.raises(ModelLoadError, match=r"49,152 tokens but the model's vocab_size is 64"):
        load_model_source(str(folder))


def test_a_tokenizer_given_for_a_smaller_model_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama", vocab_size=64, with_tokenizer=False)
    other = make_tiny_checkpoint(tmp_path / "other", "llama")
    with pytest.raises(ModelLoadError, match="tokenizer=PATH"):
        load_model_source(str(folder), tokenizer=str(other))


@pytest.mark.parametrize(
    ("field", "value"), [("bos_token_id", 64), ("eos_token_id", 10**6), ("eos_token_id", -1)]
)
def test_special_token_ids_outside_the_vocabulary_are_refused(
    tmp_path: Path, field: str, value: int
) -> None:
    folder = make_tiny_checkpoint(
        tmp_path, "llama", vocab_size=64, with_tokenizer=False, **{field: value}
    )
    with pytest.raises(
        ModelLoadError, match=rf"{field} {value} is outside the vocabulary \[0, 64\)"
    ):
        load_model_source(str(folder))


def test_a_gguf_whose_bos_is_outside_the_vocabulary_is_refused_at_once(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(
        tmp_path, "llama", vocab_size=TINY_VOCAB, with_tokenizer=False, num_hidden_layers=1
    )
    path = write_gguf_from_hf(folder, tmp_path / "bad-bos.gguf", bos_token_id=TINY_VOCAB + 5)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=rf"bos_token_id {TINY_VOCAB + 5} is outside"):
        load_model_source(str(path))
    assert time.perf_counter() - start < 5


def test_text_prompt_ids_are_checked_against_the_vocabulary() -> None:
    check_encoded_prompt("hi", [1, 2, 3], 64)
    with pytest.raises(InvalidRequestError, match=r"\[64, 70\] outside the model's vocabulary"):
        check_encoded_prompt("hi", [1, 64, 70], 64)


def test_a_matching_checkpoint_still_serves_text(tmp_path: Path) -> None:
    llm = LLM(
        str(make_tiny_checkpoint(tmp_path, "llama")),
        device="cpu",
        max_num_pages=16,
        max_model_len=128,
    )
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
