"""Bad input gets a clear error that names the problem; the engine keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams
from pitstop.entrypoints.engine_args import engine_config
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
    # max_tokens=None (vLLM's "up to the context"): the 4 tokens left of max_model_len=64
    out = llm.generate(
        prompt_token_ids=[[5] * 60],
        sampling_params=SamplingParams(max_tokens=None, ignore_eos=True),
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    # more than fits is an error naming both numbers, as vLLM's (it used to be cut silently)
    with pytest.raises(
        InvalidRequestError, match=r"60 tokens and max_tokens is 50.*max_model_len=64"
    ):
        llm.generate(
            prompt_token_ids=[[5] * 60],
            sampling_params=SamplingParams(max_tokens=50, ignore_eos=True),
        )
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


# ---------------------------------------------------------------------- issue 22: strict values
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"seed": True}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("-inf")}, "min_p"),
        ({"stop": 123}, "stop"),
        ({"stop": ["ok", 5]}, "stop"),
        ({"stop": "a\ud800"}, "surrogate"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": "yes"}, "logprobs"),
    ],
)
def test_strict_sampling_params(kwargs: dict, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        SamplingParams(**kwargs)


def test_seeds_are_int64_reduced_modulo_2_64() -> None:
    """vLLM answers 400 outside int64; inside it a negative seed maps as torch maps it."""
    assert SamplingParams(seed=-1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == 2**63
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=None).seed is None
    for seed in (2**63, -(2**63) - 1, 2**70, 10**5000):
        with pytest.raises(InvalidRequestError, match=r"^seed must be in .*\(int64\)"):
            SamplingParams(seed=seed)
    np = pytest.importorskip("numpy")
    p = SamplingParams(top_k=np.int64(5), temperature=np.float32(0.5), max_tokens=np.int32(3))
    assert (p.top_k, p.temperature, p.max_tokens) == (5, 0.5, 3)
    assert type(p.top_k) is int and type(p.temperature) is float


def test_values_that_used_to_fail_the_step_run(llm: LLM) -> None:
    """int64 seeds at both ends and a top_k near int64 run beside a normal request (issue 22, point 1)."""
    params = [
        SamplingParams(seed=2**63 - 1, temperature=1.0, max_tokens=4, ignore_eos=True),
        SamplingParams(seed=-(2**63), temperature=1.0, max_tokens=4, ignore_eos=True),
        SamplingParams(top_k=2**62, temperature=1.0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    ]
    outs = llm.generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling_params=params)
    assert [len(o.token_ids) for o in outs] == [4, 4, 4, 4]
    _still_serves(llm)


def test_validate_request_checks_against_the_vocabulary() -> None:
    from pitstop.requests.validation import validate_request

    ok = SamplingParams(stop_token_ids=[3])
    validate_request("hi", ok, None, vocab_size=10)
    validate_request(None, ok, [0, 9], vocab_size=10)
    bad = [
        ("hi", SamplingParams(stop_token_ids=[10]), None, "stop_token_ids"),
        (None, ok, [1, True], "prompt_token_ids"),
        (None, ok, [1, 10], "vocabulary"),
        (None, ok, [-1], "vocabulary"),
        (None, ok, [], "empty"),
        (None, ok, "1 2", "prompt_token_ids"),
        ("a\udc00b", ok, None, "surrogate"),
        ("", ok, None, "empty"),
        (123, ok, None, "prompt must be a string"),
        (None, ok, None, "give a prompt"),
        ("hi", {"max_tokens": 3}, None, "SamplingParams"),
    ]
    for prompt, params, ids, fragment in bad:
        with pytest.raises(InvalidRequestError, match=fragment):
            validate_request(prompt, params, ids, vocab_size=10)  # type: ignore[arg-type]


def test_check_encoded_prompt() -> None:
    from pitstop.requests.validation import check_encoded_prompt

    check_encoded_prompt("hi", [5])
    with pytest.raises(InvalidRequestError, match="no tokens"):
        check_encoded_prompt("\x04", [])


# ---------------------------------------------------------------------- issue 22: config (point 10)
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"kv_cache_gib": float("nan")}, "kv_cache_gib"),
        ({"kv_cache_gib": float("inf")}, "kv_cache_gib"),
        ({"kv_cache_gib": 1e6}, "more than any machine"),
        ({"kv_cache_gib": True}, "kv_cache_gib"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
        ({"tokenizer": 123}, "tokenizer"),
        ({"tokenizer": ""}, "tokenizer"),
        ({"speculative_model": 5}, "speculative_model"),
        ({"options": {"": 1}}, "options"),
        ({"options": {"x.y": float("nan")}}, "options"),
    ],
)
def test_config_values_refused_before_weights(kwargs: dict, fragment: str) -> None:

    with pytest.raises(ConfigError, match=fragment):
        engine_config(**kwargs)


def test_misspelled_option_key_is_refused() -> None:
    from pitstop.config import EngineConfig
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    pm.check_config(EngineConfig(options={"prefix.max_cached_pages": 4, "thirdparty.knob": 1}))
    for key in ("prefix.max_cache_pages", "prefx.max_cached_pages", "prefix.nope"):
        with pytest.raises(ConfigError, match="unknown option") as info:
            pm.check_config(EngineConfig(options={key: 4}))
        assert "prefix.max_cached_pages" in str(info.value)  # the declared keys are listed
    with pytest.raises(ConfigError, match="unknown option"):
        LLM("smollm2-135m", options={"prefix.max_cache_pages": 4})  # before any weight loads


def test_bad_boolean_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    from pitstop.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--fused-qkv", "maybe"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--fused-qkv" in err and "expected true or false" in err and "Traceback" not in err


def test_chat_roles_and_contents_are_checked(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="role"):
        llm.chat([[{"role": "wizard", "content": "hi"}]])
    with pytest.raises(InvalidRequestError, match="content"):
        llm.chat([[{"role": "user", "content": 123}]])
    _still_serves(llm)


@pytest.mark.parametrize(
    "key", ["²", "①", " 5", "5 ", "٣", "𝟓", "+5", "-1", "0x5", "", "1" * 5000, "9" * 20]
)
def test_logit_bias_keys_are_ascii_decimal_token_ids(key: str) -> None:
    """str.isdigit() took "²" and "①" and then int() failed (a 500); int() took " 5", "٣"
    and "𝟓" as token ids; a 5,000-digit key hit Python's integer-string limit."""
    with pytest.raises(
        InvalidRequestError,
        match=r"^logit_bias key '.*'(\.\.\. \(5,000 characters\))? is not a token id",
    ) as err:
        SamplingParams(logit_bias={key: 1})
    assert len(str(err.value)) < 300  # the key is named, not echoed whole


def test_logit_bias_keys_that_are_token_ids(llm: LLM) -> None:
    assert SamplingParams(logit_bias={"5": 1, 7: -2}).logit_bias == ((5, 1.0), (7, -2.0))
    with pytest.raises(InvalidRequestError, match="names token 5 twice"):
        SamplingParams(logit_bias={"5": 1, 5: 2})
    with pytest.raises(InvalidRequestError, match=r"an integer of about 5,001 digits"):
        SamplingParams(logit_bias={10**5000: 1})
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(
        InvalidRequestError, match=rf"logit_bias: token id\(s\) \[{vocab}\] outside the vocabulary"
    ):
        llm.generate(
            prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(logit_bias={str(vocab): 1})
        )
    _still_serves(llm)
