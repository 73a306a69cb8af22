"""vLLM's engine-argument names: keywords, TOML keys and flags read as pitstop's settings."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from pitstop import EngineConfig
from pitstop.entrypoints.cli import build_parser
from pitstop.entrypoints.engine_args import (
    add_cli_flags,
    config_from_cli,
    config_from_toml,
    engine_config,
    setting_value,
)
from pitstop.entrypoints.vllm_args import (
    ACCEPTED,
    MULTI_VALUED,
    NEUTRAL,
    REFUSED,
    REMOVED,
    RENAMED,
    SAME_NAME,
    SERVE_REFUSED,
)
from pitstop.errors import ConfigError, ModelLoadError
from pitstop.server.vllm_table import VLLM_SERVE_FLAGS, markdown_table

API_MD = Path(__file__).resolve().parents[3] / "docs" / "api.md"


def _cli(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    return config_from_cli(parser.parse_args(list(argv)))


def test_renamed_keywords_become_pitstop_settings() -> None:
    config = engine_config(
        max_num_seqs=32,
        block_size=32,
        num_gpu_blocks_override=100,
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        async_scheduling=True,
        kv_cache_memory_bytes=2**29,
        trust_remote_code=True,
        disable_log_stats=True,
    )
    assert config.max_batch_size == 32 and config.page_size == 32
    assert config.max_num_pages == 100 and config.allocator == "prefix"
    assert config.scheduler == "continuous" and config.overlap == "on"
    assert config.kv_cache_gib == 0.5
    assert engine_config(enable_prefix_caching=False).allocator == "paged"
    assert engine_config(enable_chunked_prefill=True).scheduler == "chunked"
    assert engine_config(async_scheduling=False).overlap == "off"


def test_a_small_max_num_seqs_alone_is_valid() -> None:
    # vLLM has no prefill cap of its own: max_prefill_batch (64) follows a smaller max_num_seqs
    assert setting_value(engine_config(max_num_seqs=8), "max_prefill_batch") == 8
    assert setting_value(engine_config(max_num_seqs=128), "max_prefill_batch") == 64
    assert (
        setting_value(engine_config(max_num_seqs=8, max_prefill_batch=2), "max_prefill_batch") == 2
    )
    both = engine_config(max_num_seqs=8, options={"chunked.max_prefill_batch": 4})
    assert setting_value(both, "max_prefill_batch") == 4
    with pytest.raises(ConfigError, match="max_prefill_batch"):
        engine_config(max_num_seqs=8, max_prefill_batch=9)


@pytest.mark.parametrize(
    ("given", "stored"),
    [("half", "float16"), ("float16", "float16"), ("float", "float32"), ("float32", "float32")]
    + [("bfloat16", "bfloat16"), ("auto", "auto")],
)
def test_dtype_takes_vllms_words(given: str, stored: str) -> None:
    assert engine_config(dtype=given).dtype == stored


def test_kv_cache_dtype_fp8_is_e4m3() -> None:
    assert engine_config(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        engine_config(kv_cache_dtype="fp8_inc")


def test_a_vllm_name_against_the_pitstop_one_names_both() -> None:
    with pytest.raises(ConfigError, match=r"max_num_seqs=8.*max_batch_size=16"):
        engine_config(max_num_seqs=8, max_batch_size=16)
    with pytest.raises(ConfigError, match=r"enable_prefix_caching.*allocator='preallocated'"):
        engine_config(enable_prefix_caching=True, allocator="preallocated")
    # the same meaning twice is not a conflict
    assert engine_config(block_size=32, page_size=32).page_size == 32
    assert engine_config(enable_prefix_caching=True, allocator="prefix").allocator == "prefix"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_vllm_arguments_are_named_with_the_alternative(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name} is vLLM's; pitstop does not have it: "):
        engine_config(**{name: "x"})
    engine_config(**{name: None})  # None asks for nothing pitstop lacks


def test_values_that_ask_for_what_pitstop_does_are_accepted() -> None:
    config = engine_config(
        pipeline_parallel_size=1, tokenizer_mode="auto", swap_space=0, quantization=None
    )
    assert config == EngineConfig()
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2"):
        engine_config(pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="swap_space"):
        engine_config(swap_space=True)  # a bool is not the number 0
    assert _cli("--pipeline-parallel-size", "1") == EngineConfig()
    with pytest.raises(ConfigError, match="fully_sharded_loras"):
        engine_config(fully_sharded_loras=True)


def test_enable_lora_selects_the_lora_adapter_plugin() -> None:
    assert engine_config(enable_lora=True).adapter == "lora"
    assert engine_config(enable_lora=False).adapter is None
    assert _cli("--enable-lora").adapter == "lora"
    config = engine_config(enable_lora=True, max_loras=4, max_lora_rank=64, max_cpu_loras=8)
    assert config.options == {"max_loras": 4, "max_lora_rank": 64, "max_cpu_loras": 8}
    flags = _cli(
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8"
    )
    assert flags == config


def test_refusals_point_at_pitstops_equivalent() -> None:
    with pytest.raises(ConfigError, match=r"speculative='ngram'"):
        engine_config(speculative_config={"method": "ngram"})
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        engine_config(pipeline_parallel_size=2)


@pytest.mark.parametrize(
    ("name", "nearest"),
    [("max_num_seq", "max_num_seqs"), ("pagesize", "page_size"), ("enable_prefix_cache", None)],
)
def test_an_unknown_keyword_names_the_nearest_known_one(name: str, nearest: str | None) -> None:
    with pytest.raises(ConfigError, match="unknown setting") as info:
        engine_config(**{name: 1})
    if nearest is not None:
        assert f"did you mean {nearest!r}?" in str(info.value)
    else:
        assert "did you mean 'enable_prefix_caching'?" in str(info.value)


def test_accepted_flags_must_be_booleans() -> None:
    with pytest.raises(ConfigError, match="trust_remote_code must be true or false"):
        engine_config(trust_remote_code="yes")
    with pytest.raises(ConfigError, match="enable_prefix_caching must be true or false"):
        engine_config(enable_prefix_caching=1)


def test_toml_takes_vllm_names(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text("max_num_seqs = 48\nenable_prefix_caching = true\ndtype = 'half'\n")
    config = config_from_toml(path)
    assert config.max_batch_size == 48 and config.allocator == "prefix"
    assert config.dtype == "float16"
    # a flag beats the file, whichever name either uses
    assert config_from_toml(path, max_batch_size=96).max_batch_size == 96
    assert setting_value(config_from_toml(path, max_num_seqs=12), "max_prefill_batch") == 12
    path.write_text("max_num_seq = 48\n")
    with pytest.raises(ConfigError, match="did you mean 'max_num_seqs'"):
        config_from_toml(path)
    path.write_text("swap_space = 8\n")  # 4, vLLM's default, asks for nothing pitstop lacks
    with pytest.raises(ConfigError, match="swap_space is vLLM's"):
        config_from_toml(path)


def test_cli_takes_vllm_flags(tmp_path: Path) -> None:
    config = _cli("--max-num-seqs", "24", "--enable-prefix-caching", "--block-size", "8")
    assert config.max_batch_size == 24 and config.allocator == "prefix"
    assert config.page_size == 8
    assert _cli("--no-enable-prefix-caching").allocator == "paged"
    assert _cli("--no-enable-chunked-prefill").scheduler == "continuous"
    assert _cli("--enforce-eager").enforce_eager is True  # vLLM's flag takes no value
    assert _cli("--enforce-eager", "false").enforce_eager is False
    assert _cli("--trust-remote-code", "--dtype", "half").dtype == "float16"
    with pytest.raises(ConfigError, match="quantization is vLLM's"):
        _cli("--quantization", "awq")
    with pytest.raises(ConfigError, match="max_num_seqs=8.*max_batch_size=4"):
        _cli("--max-num-seqs", "8", "--max-batch-size", "4")
    path = tmp_path / "engine.toml"
    path.write_text("max_batch_size = 128\n")
    assert _cli("--config", str(path), "--max-num-seqs", "12").max_batch_size == 12


def test_an_unknown_flag_names_the_nearest_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-num-seq", "4", "hi"])
    assert "did you mean '--max-num-seqs'?" in capsys.readouterr().err
    # no prefix matching: --max-token is not --max-tokens
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-token", "4", "hi"])
    assert "did you mean '--max-tokens'?" in capsys.readouterr().err


def test_serve_takes_the_model_as_a_flag_too() -> None:
    pytest.importorskip("fastapi")
    from pitstop.server.cli import model_from_args

    parser = build_parser()
    assert model_from_args(parser.parse_args(["serve", "--model", "m"])).model == "m"
    assert model_from_args(parser.parse_args(["serve", "m"])).model == "m"
    assert model_from_args(parser.parse_args(["serve", "m", "--model", "m"])).model == "m"
    with pytest.raises(ConfigError, match="two models given"):
        model_from_args(parser.parse_args(["serve", "a", "--model", "b"]))


def test_a_checkpoint_that_needs_remote_code_is_refused(tmp_path: Path) -> None:
    from helpers.models import make_tiny_checkpoint

    from pitstop.plugins.model_sources.huggingface.checkpoint import read_hf_config

    folder = make_tiny_checkpoint(tmp_path, "llama", with_tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"auto_map.*does not run a checkpoint's code"):
        read_hf_config(folder)


def test_the_docs_table_is_the_codes() -> None:
    text = API_MD.read_text()
    found = re.search(r"<!-- vllm-args:begin -->\n(.*?)\n<!-- vllm-args:end -->", text, re.S)
    assert found is not None, "docs/api.md lost its vLLM table markers"
    assert found.group(1) == markdown_table(), (
        "docs/api.md's vLLM table differs from the code; paste the output of: "
        "python -m pitstop.server.vllm_table"
    )
    names = {r.vllm for r in RENAMED} | set(SAME_NAME) | set(ACCEPTED) | set(REFUSED)
    names |= set(REMOVED) | {"sampling_params", "beam_search()", "embed()", "lora_request"}
    assert all(f"| `{name}` |" in found.group(1) for name in names if name != "sampling_params")
    flags = {"--" + n.replace("_", "-") for n in set(VLLM_SERVE_FLAGS) | set(SERVE_REFUSED)}
    assert all(f"| `{flag}` | `pitstop serve` |" in found.group(1) for flag in flags)


def test_the_table_marks_what_the_serve_parser_has() -> None:
    from pitstop.server.vllm_table import serve_rows

    have = ["--" + n.replace("_", "-") for n in VLLM_SERVE_FLAGS if n != "chat_template"]
    rows = {flag: text for flag, _, text in serve_rows(have)}
    assert rows["--host"] == rows["--port"] == "same flag"
    assert rows["--chat-template"].startswith("refused: pitstop serve renders with the model's")
    assert rows["--root-path"].startswith("refused: mount the server")
    with pytest.raises(KeyError):  # a vLLM serve flag pitstop lacks must say what instead
        serve_rows(["--host"])  # --port: not in the parser, not in SERVE_REFUSED


def test_vllms_defaults_and_unset_values_run() -> None:
    # vLLM's LLM(...) defaults spelt out, and None ("unset") for what pitstop names otherwise
    spelt = dict(swap_space=4, max_logprobs=20, generation_config="auto", scheduling_policy="fcfs")
    spelt |= dict(seed=None, max_num_seqs=None, block_size=None, enable_prefix_caching=None)
    spelt |= dict(max_num_batched_tokens=None, trust_remote_code=None, dtype=None)
    spelt |= dict(guided_decoding_backend="guidance", hf_overrides={}, swap_space_=None)
    del spelt["swap_space_"]
    assert engine_config(**spelt) == EngineConfig()
    assert engine_config(swap_space=4.0) == EngineConfig()  # a number as int or float
    for name, values in NEUTRAL.items():
        for value in values:
            engine_config(**{name: value})
    with pytest.raises(ConfigError, match=r"max_logprobs is vLLM's.*got max_logprobs=5"):
        engine_config(max_logprobs=5)


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_flag_vllm_removed_says_so(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name} was removed from vLLM; .*: "):
        _cli("--" + name.replace("_", "-"))


def test_flags_of_several_values_parse_and_serve_only_flags(capsys) -> None:
    for name in sorted(MULTI_VALUED):
        with pytest.raises(ConfigError, match=rf"^{name} is vLLM's; pitstop does not have it"):
            _cli("--" + name.replace("_", "-"), "a", "b", "c")
    assert _cli("--disable-log-requests") == EngineConfig()  # pitstop logs no requests
    parser = build_parser()
    args = parser.parse_args(["generate", "--cuda-graph-sizes", "1", "2", "4", "--", "hi"])
    with pytest.raises(ConfigError, match=r"cuda_graph_sizes is vLLM's.*\[1, 2, 4\]"):
        config_from_cli(args)
    args = parser.parse_args(["generate", "--ssl-keyfile", "k.pem", "hi"])
    with pytest.raises(ConfigError, match="ssl_keyfile is vLLM's; .*TLS proxy"):
        config_from_cli(args)
    assert "ssl" not in capsys.readouterr().out


def test_every_same_name_is_a_setting() -> None:
    assert set(SAME_NAME) <= set(EngineConfig.field_names())


def test_api_key_takes_several_keys_as_vllms() -> None:
    """``--api-key a b`` (vLLM's form) and the flag repeated both give every key."""
    import argparse

    from pitstop.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--api-key", "a", "b", "--api-key", "c"]).api_key == ["a", "b", "c"]
    assert parser.parse_args([]).api_key is None


def test_kv_offloading_size_alone_turns_the_host_tier_on_as_in_vllm() -> None:
    from pitstop.entrypoints.engine_args import add_cli_flags, config_from_cli

    assert engine_config(kv_offloading_size=2).allocator == "tiered"
    assert engine_config(kv_offloading_size=2, allocator="prefix").allocator == "prefix"
    assert engine_config(kv_offloading_size=2, enable_prefix_caching=True).allocator == "prefix"
    assert engine_config(kv_offloading_size=0).allocator == engine_config().allocator
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    flags = config_from_cli(parser.parse_args(["--kv-offloading-size", "8"]))
    assert flags.allocator == "tiered" and flags.options == {"kv_offloading_size": 8.0}
