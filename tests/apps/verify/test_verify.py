"""`pitstop verify`: equivalent configurations pass, perturbed kernels fail, bad input is exit 2.

The model tests run the real SmolLM2-135M on CPU with a few short prompts.
Two deliberately wrong kernel sets, registered through the plugin manager
like any third-party one, must be flagged: one moves the logits without
changing a token (the logit check catches it), the other is an off-by-one in
decode attention that changes the tokens (and that a prefill-only check would
never run).
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path
from types import ModuleType

import attrs
import pytest
import torch
from helpers.models import smollm2_gguf

from pitstop.entrypoints.engine_args import engine_config, setting_value

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # fused kernels on CPU: before triton loads

import pitstop  # noqa: E402
import pitstop.plugin_system.plugin_manager as pmod  # noqa: E402
from pitstop import EngineConfig  # noqa: E402
from pitstop.entrypoints.cli import main as cli_main  # noqa: E402
from pitstop.errors import ConfigError, PluginError  # noqa: E402
from pitstop.plugin_system.plugin_manager import PluginManager  # noqa: E402
from pitstop.plugins.kernels.reference import ReferenceKernels  # noqa: E402
from pitstop.verify.compare import (  # noqa: E402
    FAIL,
    NEAR_TIE,
    PASS,
    Tolerance,
    default_tolerance,
    first_divergence,
    judge,
)
from pitstop.verify.prompts import (  # noqa: E402
    VerifyPrompt,
    load_prompts,
    parse_prompt_lines,
    shipped_prompts,
)
from pitstop.verify.report import format_report  # noqa: E402
from pitstop.verify.run import reference_config, verify  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = dict(model="smollm2-135m", device="cpu", dtype="float32", kv_cache_gib=0.25)
FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gib", "0.25"]

# Short prompts: two chats (SmolLM2's template gives them a shared first page, so the
# second can hit the prefix cache) and a repetitive text (so n-gram lookup finds drafts).
PROMPT_LINES = [
    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "sky", "messages": [{"role": "user", "content": "Why is the sky blue?"}]},
    {"id": "repeat", "prompt": "one two three, one two three, one two three, one two"},
]
MAX_TOKENS = 10


def _write_prompts(folder: Path, lines: list = PROMPT_LINES) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# ---------------------------------------------------------------- perturbed kernel sets
class WrongEpsKernels(ReferenceKernels):
    """RMSNorm with 100x the model's epsilon: a slight, uniform error in every layer."""

    name = "wrong-eps"

    def rms_norm(self, x, weight, eps, residual=None):
        return super().rms_norm(x, weight, eps * 100, residual)


class StaleDecodeKernels(ReferenceKernels):
    """Decode attention that misses the newest key (an off-by-one in the context length)."""

    name = "stale-decode"

    def attention(self, q, k_cache, v_cache, meta, scale):
        lens = [
            c - 1 if q_len == 1 and c > 1 else c
            for q_len, c in zip(meta.query_lens_list, meta.context_lens_list, strict=True)
        ]
        context_lens = torch.tensor(lens, dtype=meta.context_lens.dtype, device=q.device)
        meta = attrs.evolve(meta, context_lens_list=lens, context_lens=context_lens)
        return super().attention(q, k_cache, v_cache, meta, scale)


def _perturbed_plugin() -> ModuleType:
    module = ModuleType("perturbed_kernels")

    @pitstop.hookimpl
    def register_kernels(register) -> None:
        register("wrong-eps", lambda config, device, dtype: WrongEpsKernels(device, dtype))
        register("stale-decode", lambda config, device, dtype: StaleDecodeKernels(device, dtype))

    module.register_kernels = register_kernels  # type: ignore[attr-defined]
    return module


@pytest.fixture
def perturbed_plugins() -> PluginManager:
    return PluginManager(extra_modules=[_perturbed_plugin()])


@pytest.fixture
def prompts() -> list[VerifyPrompt]:
    return parse_prompt_lines([json.dumps(line) for line in PROMPT_LINES])


# ---------------------------------------------------------------- the prompt set
def test_shipped_prompt_set_is_varied_and_packaged() -> None:
    shipped = shipped_prompts()
    assert 8 <= len(shipped) <= 12
    assert any(p.messages for p in shipped) and any(p.prompt for p in shipped)
    assert len({p.id for p in shipped}) == len(shipped), "ids label the report: keep them unique"
    assert all(p.source.startswith("pitstop/verify/prompts.jsonl:") for p in shipped)
    # a non-editable install carries the file only if pyproject lists it as package data
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "pitstop.verify" in setuptools["packages"]
    assert "*.jsonl" in setuptools["package-data"]["pitstop.verify"]


def test_prompt_file_with_both_kinds(tmp_path: Path) -> None:
    loaded = load_prompts(
        _write_prompts(tmp_path, [*PROMPT_LINES, {"prompt": "x", "max_tokens": 3}])
    )
    assert [p.label for p in loaded] == ["capital", "sky", "repeat", "x"]
    assert loaded[0].messages == ({"role": "user", "content": "What is the capital of France?"},)
    assert loaded[3].max_tokens == 3 and loaded[0].max_tokens == 32
    assert loaded[3].source == f"{tmp_path / 'prompts.jsonl'}:4"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"prompt": "a"}\n{"prompt": "b",}\n', r"prompts.jsonl:2: not valid JSON"),
        ('{"prompt": "a"}\n\n{"max_tokens": 4}\n', r"prompts.jsonl:3: give exactly one of"),
        ('{"prompt": "a", "messages": []}\n', r":1: give exactly one of .* \(both are set\)"),
        ('{"prompt": ""}\n', r':1: "prompt" must be a non-empty string'),
        ('{"prompt": "a", "max_token": 4}\n', r":1: unknown key\(s\) 'max_token'"),
        ('{"prompt": "a", "max_tokens": 0}\n', r':1: "max_tokens" must be an integer >= 1'),
        ('{"messages": [{"role": "user"}]}\n', r":1: message 0 must be"),
        ('["a"]\n', r":1: expected a JSON object"),
        ("\n\n", r"holds no prompts"),
    ],
)
def test_bad_prompt_file_names_the_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_prompts(path)


def test_bad_prompt_file_exits_2_before_loading_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "oops"}\n')
    assert cli_main(["verify", "--prompts", str(bad), *FLAGS]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: unknown key(s) 'text'" in err and "'prompt'" in err
    assert cli_main(["verify", "--prompts", str(tmp_path / "missing.jsonl"), *FLAGS]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    assert cli_main(["verify", "--kernels", "nope", *FLAGS]) == 2
    assert "unknown kernels 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------- the verdict, on made-up logits
def _result(ref: list[int], cand: list[int], logits: list[list[float]], diffs: dict[int, float]):
    prompt = VerifyPrompt("p", prompt="x")
    rows = [torch.tensor(row) for row in logits]
    return judge(prompt, 1, 8, (ref, cand), ("", ""), rows, diffs, Tolerance(atol=0.1), str)


def test_verdicts() -> None:
    logits = [[5.0, 1.0, 0.0], [2.0, 1.95, 0.0], [0.0, 3.0, 0.0]]
    same = _result([0, 0, 1], [0, 0, 1], logits, {0: 0.01, 1: 0.05, 2: 0.02})
    assert (same.verdict, same.first_divergence, same.max_logit_diff_at) == (PASS, None, 1)
    # flips a 0.05-margin near-tie with logits inside the tolerance: tokens after it don't count
    tie = _result([0, 0, 1], [0, 1, 2], logits, {0: 0.01, 1: 0.05})
    assert (tie.verdict, tie.first_divergence, tie.num_matching) == (NEAR_TIE, 1, 1)
    assert tie.reference_margin == pytest.approx(0.05) and tie.reference_gap == pytest.approx(0.05)
    # same tokens, logits too far apart
    off = _result([0, 0, 1], [0, 0, 1], logits, {0: 0.01, 1: 0.5, 2: 0.02})
    assert off.verdict == FAIL and "0.5 > tolerance 0.1 at output token 1" in off.reason
    # a clear token change with small logits differences on record cannot pass
    flip = _result([0, 0, 1], [1, 0, 1], logits, {0: 0.01})
    assert flip.verdict == FAIL and flip.first_divergence == 0
    nan = _result([0, 0, 1], [0, 0, 1], logits, {0: 0.01, 1: math.nan, 2: 0.0})
    assert nan.verdict == FAIL and "non-finite" in nan.reason
    assert json.dumps(nan.to_dict())  # NaN written as a string, the file stays valid JSON


def test_first_divergence_and_tolerances() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    f32, f16, bf16 = (default_tolerance(t) for t in ("float32", "float16", "bfloat16"))
    assert f32.bound(30) < f16.bound(30) < bf16.bound(30)
    assert Tolerance(atol=0.5).describe() == "0.5"
    assert Tolerance(rtol=1e-4).describe() == "0.0001 x max|logit|"


def test_reference_config_keeps_the_model_and_memory_only() -> None:
    config = engine_config(
        **SETTINGS, kernels="fused", allocator="prefix", scheduler="chunked", chunk_size=16,
        speculative="ngram", page_size=32, seed=3, fused_attention=False,
    )  # fmt: skip
    ref = reference_config(config)
    assert (ref.kernels, ref.allocator, ref.scheduler, ref.speculative) == (
        "reference", "paged", "continuous", None,
    )  # fmt: skip
    assert (ref.model, ref.dtype, ref.device, ref.seed, ref.page_size, ref.kv_cache_gib) == (
        "smollm2-135m", "float32", "cpu", 3, 32, 0.25,
    )  # fmt: skip
    assert setting_value(ref, "chunk_size") == setting_value(EngineConfig(), "chunk_size")
    assert setting_value(ref, "fused_attention") is True


# ---------------------------------------------------------------- SmolLM2 end to end
def test_equivalent_configuration_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    smollm2_gguf()
    out_json = tmp_path / "verify.json"
    args = ["verify", "--prompts", str(_write_prompts(tmp_path)), "--max-tokens", str(MAX_TOKENS)]
    args += ["--scheduler", "chunked", "--chunk-size", "16", "--allocator", "prefix"]
    args += ["--speculative", "ngram", "--json", str(out_json), *FLAGS]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "PASS: 3/3 prompts passed" in text
    assert (
        "candidate: kernels=reference allocator=prefix scheduler=chunked speculative=ngram" in text
    )

    report = json.loads(out_json.read_text())
    assert report["passed"] is True and report["num_failed"] == 0 and report["dtype"] == "float32"
    assert report["tolerance"] == {"atol": 0.0, "rtol": 1e-4, "describe": "0.0001 x max|logit|"}
    # the features under test really ran
    assert report["candidate"]["prefix_hit_tokens"] > 0
    assert report["candidate"]["spec_proposed_tokens"] > 0
    assert report["reference"]["config"]["scheduler"] == "continuous"
    for p in report["prompts"]:
        assert p["verdict"] in (PASS, NEAR_TIE)
        assert p["num_compared"] >= 1 and p["max_logit_diff"] <= p["tolerance"]
        assert (
            p["reference_token_ids"][: p["num_matching"]]
            == p["candidate_token_ids"][: p["num_matching"]]
        )
        for key in ("first_divergence", "max_logit_diff_at", "logit_scale", "reference_margin"):
            assert key in p
    assert [p["prompt"]["id"] for p in report["prompts"]] == ["capital", "sky", "repeat"]


def test_perturbed_kernels_fail(perturbed_plugins: PluginManager, prompts) -> None:
    smollm2_gguf()
    config = engine_config(**SETTINGS, kernels="wrong-eps")
    report = verify(config, prompts, plugins=perturbed_plugins, max_tokens=MAX_TOKENS)
    assert not report.passed and report.num_failed == len(prompts)
    assert report.candidate.config.kernels == "wrong-eps"
    for r in report.results:
        assert r.verdict == FAIL and r.max_logit_diff > 10 * r.tolerance
        assert r.num_compared >= 1 and "logits differ by" in r.reason
    text = format_report(report)
    assert f"FAIL: 0/{len(prompts)} prompts passed" in text


def test_off_by_one_decode_attention_fails_through_the_cli(
    tmp_path: Path,
    perturbed_plugins: PluginManager,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    smollm2_gguf()
    monkeypatch.setattr(pmod, "_default", perturbed_plugins)
    out_json = tmp_path / "verify.json"
    args = ["verify", "--prompts", str(_write_prompts(tmp_path)), "--max-tokens", str(MAX_TOKENS)]
    args += ["--kernels", "stale-decode", "--json", str(out_json), *FLAGS]
    assert cli_main(args) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "stale-decode" in text
    report = json.loads(out_json.read_text())
    assert report["passed"] is False
    for p in report["prompts"]:
        assert p["verdict"] == FAIL
        # the first token comes from a prefill, which this bug does not touch
        assert p["max_logit_diff"] > p["tolerance"] and p["max_logit_diff_at"] >= 1
    assert any(p["first_divergence"] is not None for p in report["prompts"])


@pytest.mark.slow
def test_fused_kernels_pass_on_cpu_through_the_triton_interpreter() -> None:
    """One short prompt, two tokens: a prefill and a decode step (the interpreter runs each
    Triton program in Python: ~3 s a step). The layer stays unfused whatever ``fused.layer``'s
    default: its GEMMs at SmolLM2's size took 618 s here in the interpreter (tiny models
    cover them in tests/plugins/kernels/test_fused_layer.py)."""
    smollm2_gguf()
    pytest.importorskip("triton")
    try:
        plugins = PluginManager()
        plugins.get("kernels", "fused")
    except PluginError:
        pytest.skip("the fused kernel set is not registered")
    config = engine_config(**SETTINGS, kernels="fused", options={"fused.layer": False})
    prompt = parse_prompt_lines(['{"prompt": "The capital of France is", "max_tokens": 2}'])
    report = verify(config, prompt, plugins=plugins)
    assert report.candidate.kernels["attention"] == "triton", report.candidate.kernels
    assert report.passed, format_report(report)


def test_fallback_to_reference_kernels_is_said_in_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU without the Triton interpreter, --kernels fused runs the reference ops: say so."""
    smollm2_gguf()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        PluginManager().get("kernels", "fused")
    except PluginError:
        pytest.skip("the fused kernel set is not registered")
    out_json = tmp_path / "verify.json"
    args = ["verify", "--prompts", str(_write_prompts(tmp_path)), "--max-tokens", "2"]
    args += ["--kernels", "fused", "--json", str(out_json), *FLAGS]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "NOTE: the candidate's 'fused' kernels fell back to the reference ones for" in text
    assert "attention" in json.loads(out_json.read_text())["kernel_fallback_ops"]
