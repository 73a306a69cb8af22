"""The example plugin's scheduler, kernel set and proposer, selected by name from the installed
distribution, running the engine; and their settings refused before any weight loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, EngineConfig, SamplingParams
from pitstop.errors import ConfigError
from pitstop.plugin_system.plugin_manager import PluginManager

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [9] * 20, [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen3 checkpoint: GQA (4 query heads, 2 KV heads), head size 32."""
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3", with_tokenizer=False))


def _llm(model: str, pm: PluginManager, **kwargs: object) -> LLM:
    kwargs.setdefault("max_num_pages", 64)
    kwargs.setdefault("max_model_len", 48)
    return LLM(model, device="cpu", page_size=4, plugins=pm, **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.fixture
def plugins(with_example: Path) -> PluginManager:
    """Every installed plugin, the example distribution among them."""
    pm = PluginManager(allow=None)
    for kind, name in (
        ("scheduler", "sjf"),
        ("kernels", "sdpa"),
        ("proposer", "recall"),
        ("weights", "int8"),
    ):
        assert pm.get(kind, name).distribution == "pitstop-example"
    return pm


# ---------------------------------------------------------------- sjf


def test_sjf_runs_the_engine_with_the_same_greedy_tokens(
    plugins: PluginManager, tiny_qwen3: str
) -> None:
    expected = _greedy(_llm(tiny_qwen3, plugins), PROMPTS)
    # a cache too small for every request at once (preemption) and a budget that chunks prompts
    for options in ({}, {"sjf.job_size": "prompt", "sjf.max_wait_steps": 0}):
        llm = _llm(
            tiny_qwen3,
            plugins,
            scheduler="sjf",
            max_num_pages=12,
            max_num_batched_tokens=8,
            options=options,
        )
        assert _greedy(llm, PROMPTS) == expected
        assert llm.engine.stats.preemptions > 0  # a preempted request resumed where it left off
        assert llm.engine.allocator.stats().pages_free == 12
    # and in the overlapped loop (plan step N+1 before step N's tokens are known)
    llm = _llm(tiny_qwen3, plugins, scheduler="sjf", overlap="on", max_num_batched_tokens=8)
    assert _greedy(llm, PROMPTS) == expected


# ---------------------------------------------------------------- int8


def test_int8_runs_the_engine_close_to_dense(plugins: PluginManager, tiny_qwen3: str) -> None:
    def first_logits(llm: LLM) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        llm.engine.observe_logits(lambda inputs, seqs, logits: seen.append(logits.clone()))
        _greedy(llm, PROMPTS)
        return seen[0]

    dense = _llm(tiny_qwen3, plugins)
    int8 = _llm(tiny_qwen3, plugins, weights="int8")
    assert "int8" in int8.engine.runner.weights.describe()["linear"]
    expected, got = first_logits(dense), first_logits(int8)
    # weight rounding only (activations stay float32): measured 1.4 % of the largest logit
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 0.03
    assert int8.engine.runner.weight_bytes() < dense.engine.runner.weight_bytes()


# ---------------------------------------------------------------- sdpa


def test_sdpa_gives_the_reference_kernels_greedy_tokens(
    plugins: PluginManager, tiny_qwen3: str
) -> None:
    expected = _greedy(_llm(tiny_qwen3, plugins, kernels="reference"), PROMPTS)
    for options in ({}, {"sdpa.max_batch": 1}):
        llm = _llm(tiny_qwen3, plugins, kernels="sdpa", options=options)
        assert llm.engine.runner.kernels.describe()["attention"].startswith("sdpa")
        assert _greedy(llm, PROMPTS) == expected


@pytest.mark.gpu
def test_sdpa_over_fused_on_cuda(plugins: PluginManager, tiny_qwen3: str) -> None:
    """On the GPU: every op against the reference (fp32, bf16, fp8 caches), then the engine's
    greedy tokens (overlapped loop) equal the fused kernel set's."""
    import torch

    from pitstop.testing.kernels import check_kernel_set

    over_fused = EngineConfig(options={"sdpa.base": "fused"})
    check_kernel_set(
        lambda device, dtype: plugins.create("kernels", "sdpa", over_fused, device, dtype),
        device="cuda",
        dtypes=(torch.float32, torch.bfloat16),
        fp8=True,
        max_examples=30,
    )
    run = {"device": "cuda", "dtype": "float32", "max_model_len": 512, "kv_cache_gib": 0.5}
    run["plugins"] = plugins
    fused = LLM(tiny_qwen3, kernels="fused", **run)
    sdpa = LLM(tiny_qwen3, kernels="sdpa", options={"sdpa.base": "fused"}, **run)
    assert sdpa.engine.runner.kernels.describe()["rms_norm"] == "triton"
    assert _greedy(sdpa, PROMPTS) == _greedy(fused, PROMPTS)


def test_sdpa_base_must_be_another_kernel_set(plugins: PluginManager, tiny_qwen3: str) -> None:
    with pytest.raises(ConfigError, match="sdpa.base must name another kernel set"):
        _llm(tiny_qwen3, plugins, kernels="sdpa", options={"sdpa.base": "sdpa"})


# ---------------------------------------------------------------- recall


def test_recall_keeps_greedy_tokens_and_its_drafts_are_accepted(
    plugins: PluginManager, tiny_qwen3: str
) -> None:
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] * 3
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = _greedy(_llm(tiny_qwen3, plugins), [prompt, PROMPTS[0]], params)
    llm = _llm(
        tiny_qwen3,
        plugins,
        speculative="recall",
        num_speculative_tokens=4,
        options={"recall.context": 4},  # long enough that no context of these outputs repeats
    )
    assert _greedy(llm, [prompt, PROMPTS[0]], params) == expected
    stats = llm.engine.stats
    first = (stats.spec_proposed_tokens, stats.spec_accepted_tokens)
    # The same prompt again (a retried request): every continuation is in the shared table,
    # so the drafts are exactly the greedy tokens and every one of them is kept.
    assert _greedy(llm, [prompt], params) == expected[:1]
    proposed = stats.spec_proposed_tokens - first[0]
    accepted = stats.spec_accepted_tokens - first[1]
    assert proposed > 0 and accepted == proposed, (proposed, accepted)
    assert not llm.engine.proposer._learnt  # every finished sequence was released


def test_recall_drafts_are_accepted_on_a_repetitive_prompt(plugins: PluginManager) -> None:
    """The shipped SmolLM2 copying its prompt: recall drafts the copy from the prompt's table."""
    from helpers.models import smollm2_gguf

    smollm2_gguf()
    prompts = [
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. The quick"
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    run = {"device": "cpu", "kv_cache_gib": 0.05, "max_model_len": 256, "plugins": plugins}
    plain = LLM("smollm2-135m", **run).generate(prompts, params, use_tqdm=False)
    llm = LLM("smollm2-135m", speculative="recall", **run)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.stats
    assert stats.spec_accepted_tokens > 0, (stats.spec_proposed_tokens, stats.spec_accepted_tokens)


# ---------------------------------------------------------------- settings

BAD_SETTINGS = [
    # (strategy selected, options, what the message names)
    ("scheduler", "sjf", {"sjf.max_wait_steps": "soon"}, "sjf.max_wait_steps", "an integer >= 0"),
    ("scheduler", "sjf", {"sjf.max_wait_steps": -1}, "sjf.max_wait_steps", "an integer >= 0"),
    (
        "scheduler",
        "sjf",
        {"sjf.job_size": "longest"},
        "sjf.job_size",
        "'total', 'prompt', 'output'",
    ),
    ("scheduler", "sjf", {"sjf.wait": 3}, "sjf.max_wait_steps", "an integer >= 0"),
    ("kernels", "sdpa", {"sdpa.max_batch": "all"}, "sdpa.max_batch", "an integer >= 1"),
    ("kernels", "sdpa", {"sdpa.max_batch": 0}, "sdpa.max_batch", "an integer >= 1"),
    ("kernels", "sdpa", {"sdpa.base": 3}, "sdpa.base", "a non-empty string"),
    ("kernels", "sdpa", {"sdpa.backend": "math"}, "sdpa.max_batch", "an integer >= 1"),
    ("speculative", "recall", {"recall.context": 1.5}, "recall.context", "an integer >= 1"),
    ("speculative", "recall", {"recall.context": 0}, "recall.context", "an integer >= 1"),
    ("speculative", "recall", {"recall.shared": "yes"}, "recall.shared", "true or false"),
    ("speculative", "recall", {"recall.size": 8}, "recall.max_contexts", "an integer >= 1"),
    ("weights", "int8", {"int8.min_features": -1}, "int8.min_features", "an integer >= 0"),
]


@pytest.mark.parametrize(("field", "name", "options", "key", "allowed"), BAD_SETTINGS)
def test_bad_settings_are_refused_before_any_weight_loads(
    plugins: PluginManager,
    monkeypatch: pytest.MonkeyPatch,
    field: str,
    name: str,
    options: dict[str, object],
    key: str,
    allowed: str,
) -> None:
    def no_weights(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("weights were loaded before the settings were checked")

    monkeypatch.setattr("pitstop.loop.engine.load_model_source", no_weights)
    with pytest.raises(ConfigError) as info:
        LLM("smollm2-135m", device="cpu", plugins=plugins, options=options, **{field: name})
    text = str(info.value)
    assert repr(name) in text and key in text and allowed in text, text
    given = next(iter(options.values()))
    assert ("unknown option" in text) or repr(given) in text, text


def test_the_settings_reach_the_strategies(plugins: PluginManager) -> None:
    config = EngineConfig(
        max_model_len=64,
        options={"sjf.max_wait_steps": 5, "sdpa.max_batch": 3, "recall.context": 4},
    )
    assert plugins.create("scheduler", "sjf", config, None).settings.max_wait_steps == 5
    assert plugins.create("kernels", "sdpa", config, "cpu", None).max_batch == 3
    assert plugins.create("proposer", "recall", config, None).context == 4
