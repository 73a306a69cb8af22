"""Bad input gets a clear error that names the problem; the engine keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest_models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams
from pitstop.errors import ConfigError, InvalidRequestError, ModelLoadError, PluginError


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("bad"), "llama")
    return LLM(str(folder), device="cpu", max_model_len=64, max_num_pages=16, page_size=16)


def _still_serves(llm: LLM) -> None:
    out = llm.generate(
        prompt_token_ids=[[5, 6, 7]],
        sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    assert len(out[0].token_ids) == 4
    stats = llm.engine.allocator.stats()
    assert stats.pages_free == stats.num_pages and stats.tokens_held == 0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        SamplingParams(**kwargs)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate(prompt_token_ids=[[]], sampling_params=SamplingParams(max_tokens=2))
    _still_serves(llm)


def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[5] * 64], sampling_params=SamplingParams(max_tokens=2))
    _still_serves(llm)


def test_token_ids_outside_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate(prompt_token_ids=[[5, 10**7]], sampling_params=SamplingParams(max_tokens=2))
    _still_serves(llm)


def test_a_bad_prompt_in_a_batch_submits_nothing(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(
            prompt_token_ids=[[5, 6], [], [7]], sampling_params=SamplingParams(max_tokens=2)
        )
    assert not llm.engine.has_unfinished_requests()
    _still_serves(llm)


def test_output_stops_at_max_model_len(llm: LLM) -> None:
    out = llm.generate(
        prompt_token_ids=[[5] * 60], sampling_params=SamplingParams(max_tokens=50, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    _still_serves(llm)


def test_abort_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request(
        prompt_token_ids=[5] * 30, params=SamplingParams(max_tokens=20, ignore_eos=True)
    )
    engine.step()
    final = engine.abort(rid)
    assert final is not None and final.finish_reason == "abort" and final.finished
    _still_serves(llm)


def test_unknown_plugin_name() -> None:
    with pytest.raises(PluginError, match="registered allocator names: .*paged"):
        LLM("smollm2-135m", allocator="nope")


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a known name nor an existing file"):
        LLM(str(tmp_path / "missing.gguf"), device="cpu")


def test_unreadable_model_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ModelLoadError):
        LLM(str(bad), device="cpu")


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama", with_tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises((ModelLoadError, PluginError), match="GPT2"):
        LLM(str(folder), device="cpu")


def test_invalid_config_fails_before_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="page_size"):
        LLM("smollm2-135m", page_size=-4)
    with pytest.raises(ConfigError, match="unknown setting"):
        LLM("smollm2-135m", pagesize=4)


def test_kv_cache_smaller_than_one_sequence(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(folder), device="cpu", max_model_len=256, max_num_pages=4, page_size=16)


def test_text_prompt_without_tokenizer(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama", with_tokenizer=False)
    llm = LLM(str(folder), device="cpu", max_num_pages=64)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate(["hello"])
