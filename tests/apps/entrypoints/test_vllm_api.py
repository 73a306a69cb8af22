"""A vLLM user's second mile (issue 46): a small max_batch_size, beam search, the default
sampling params, vLLM's methods pitstop does not do, vLLM's module paths, LoRARequest,
assignment to SamplingParams, and the EOS text left out of the output."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import hf_model
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, EngineConfig, SamplingParams
from pitstop.entrypoints.engine_args import engine_config, setting_value
from pitstop.entrypoints.vllm_surface import REFUSED_METHODS
from pitstop.errors import ConfigError, InvalidRequestError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
TINY_EOS = 2  # the tiny checkpoint's eos_token_id (tests/helpers/models.py)


def _next_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the token after ``tokens`` (the reference)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A tiny llama whose generation_config.json sets sampling values and a second EOS id:
    the token ranked second after PROMPT, so that beam search finishes a beam at step one."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("vllm-api"), "llama")
    second = int(_next_logprobs(hf_model(folder), PROMPT).topk(2).indices[1])
    config = {"eos_token_id": [TINY_EOS, second], "temperature": 0.7, "top_p": 0.9}
    config |= {"top_k": 20, "max_new_tokens": 12, "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder, second


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, int]):
    """transformers' own load of the tiny checkpoint."""
    return hf_model(tiny[0])


@pytest.fixture(scope="module")
def llm(tiny: tuple[Path, int]) -> LLM:
    # max_batch_size=3 (pitstop's own name), below the schedulers' default prefill cap of 64
    return LLM(str(tiny[0]), device="cpu", max_model_len=64, max_num_pages=32, max_batch_size=3)


# ---------------------------------------------------------------- 1: a small max_batch_size
def test_a_small_max_batch_size_lowers_the_prefill_default(llm: LLM) -> None:
    assert llm.config.max_batch_size == 3
    assert setting_value(llm.config, "max_prefill_batch") == 3
    assert setting_value(EngineConfig(max_batch_size=100), "max_prefill_batch") == 64
    assert (
        setting_value(engine_config(max_batch_size=8, max_prefill_batch=2), "max_prefill_batch")
        == 2
    )
    for scheduler in ("continuous", "fcfs", "chunked"):
        assert (
            setting_value(EngineConfig(max_batch_size=5, scheduler=scheduler), "max_prefill_batch")
            == 5
        )
    with pytest.raises(ConfigError, match=r"max_prefill_batch \(64\) must not exceed max_batch"):
        engine_config(max_batch_size=3, max_prefill_batch=64)  # typed by the user: refused
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[PROMPT] * 7, sampling_params=params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3] * 7


def test_the_setting_help_says_the_default_follows() -> None:
    from pitstop.entrypoints.catalogue import describe
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    chunked = next(s for s in get_plugin_manager().strategies() if s.name == "chunked")
    row = next(r for r in describe(chunked.settings, "chunked") if r[1] == "max_prefill_batch")
    assert row[3] == "64, or max_batch_size when smaller"


# ---------------------------------------------------------------- 2: beam search
def _reference_beam_search(model, prompt, width, steps, eos, length_penalty=1.0, ignore_eos=False):
    """vLLM's algorithm written out on transformers' log-probabilities: each live beam grows by
    its 2*width most likely tokens; those ending in EOS finish; the best `width` go on."""

    def score(beam):
        tokens, cum = beam
        length = len(tokens) - (1 if len(tokens) > len(prompt) and tokens[-1] in eos else 0)
        return cum / length**length_penalty

    live, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            top = _next_logprobs(model, tokens).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                beam = ([*tokens, t], cum + lp)
                (done if t in eos and not ignore_eos else grown).append(beam)
        live = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize(("width", "length_penalty"), [(3, 1.0), (2, 0.0)])
def test_beam_search_matches_an_independent_search(
    llm: LLM, tiny: tuple[Path, int], reference, width: int, length_penalty: float
) -> None:
    from pitstop.sampling_params import BeamSearchParams

    model = reference
    eos = {TINY_EOS, tiny[1]}
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[2:]}]
    params = BeamSearchParams(beam_width=width, max_tokens=4, length_penalty=length_penalty)
    outputs = llm.beam_search(prompts, params)
    assert len(outputs) == 2
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = prompt["prompt_token_ids"]
        want = _reference_beam_search(model, ids, width, 4, eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for seq, (_, cum) in zip(out.sequences, want, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert seq.tokens[: len(ids)] == ids  # vLLM's tokens include the prompt
            stopped = seq.tokens[-1] in eos
            assert seq.finish_reason == ("stop" if stopped else "length")
            shown = seq.tokens[:-1] if stopped else seq.tokens  # the EOS text is left out
            assert seq.text == llm.get_tokenizer().decode(shown)
    # the second-ranked first token is an EOS id: that beam finished after one token
    assert any(len(s.tokens) == len(PROMPT) + 1 for s in outputs[0].sequences)


def test_beam_search_options(llm: LLM, tiny: tuple[Path, int], reference) -> None:
    from pitstop.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams

    model = reference
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    (out,) = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
    assert isinstance(out, BeamSearchOutput) and len(out.sequences) == 2
    want = _reference_beam_search(model, PROMPT, 2, 3, {TINY_EOS, tiny[1]}, ignore_eos=True)
    assert [s.tokens for s in out.sequences] == [t for t, _ in want]
    assert all(len(s.tokens) == len(PROMPT) + 3 for s in out.sequences)
    kept = BeamSearchParams(beam_width=2, max_tokens=2, include_stop_str_in_output=True)
    (out,) = llm.beam_search([{"prompt_token_ids": PROMPT}], kept)
    first = next(s for s in out.sequences if s.finish_reason == "stop")
    assert first.text == llm.get_tokenizer().decode(first.tokens)  # EOS text kept
    text = llm.beam_search(["Hello"], BeamSearchParams(beam_width=1, max_tokens=2))[0]
    assert text.sequences[0].text.startswith("Hello")
    with pytest.raises(InvalidRequestError, match=r"beam_width must be an integer in \[1, 10\]"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="beam_search takes BeamSearchParams"):
        llm.beam_search(["Hello"], SamplingParams())
    with pytest.raises(InvalidRequestError, match="fewer than max_model_len=64"):
        llm.beam_search([{"prompt_token_ids": [5] * 64}], params)


# ---------------------------------------------------------------- 2: defaults, refused methods
def test_default_sampling_params_come_from_generation_config(llm: LLM, tmp_path: Path) -> None:
    from pitstop.entrypoints.vllm_surface import generation_defaults

    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.9, 20)
    assert defaults.max_tokens == 12 and defaults.min_p == 0.0
    out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False)[0]  # no params: those
    assert 1 <= len(out.token_ids) <= 12
    assert generation_defaults(str(tmp_path)) == {}  # no generation_config.json: SamplingParams()
    assert generation_defaults("smollm2-135m") == {} and generation_defaults("dummy:x") == {}
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "eos_token_id": 2}')
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.3}
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        generation_defaults(str(tmp_path))


@pytest.mark.parametrize("name", sorted(REFUSED_METHODS))
def test_vllms_other_methods_say_what_to_use(llm: LLM, name: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"^LLM\.{name} is vLLM's; pitstop does not do"):
        getattr(llm, name)(["x"])


# ---------------------------------------------------------------- 3: module paths, LoRA, assignment
@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("pitstop.sampling_params", ["SamplingParams", "BeamSearchParams", "RequestOutputKind"]),
        ("pitstop.inputs", ["TextPrompt", "TokensPrompt", "PromptType"]),
        ("pitstop.outputs", ["RequestOutput", "CompletionOutput"]),
        ("pitstop.lora.request", ["LoRARequest"]),
        ("pitstop.entrypoints.beam_search", ["BeamSearchOutput", "BeamSearchSequence"]),
    ],
)
def test_vllms_module_paths(module: str, names: list[str]) -> None:
    found = importlib.import_module(module)
    assert all(hasattr(found, n) for n in names)


def test_vllm_prompt_dicts_and_output_types(llm: LLM) -> None:
    from pitstop.inputs import TextPrompt, TokensPrompt
    from pitstop.outputs import CompletionOutput, RequestOutput

    params = SamplingParams(temperature=0, max_tokens=2)
    outs = llm.generate([TextPrompt(prompt="Hi"), TokensPrompt(prompt_token_ids=PROMPT)], params)
    assert isinstance(outs[0], RequestOutput) and isinstance(outs[1].outputs[0], CompletionOutput)
    assert outs[1].prompt_token_ids == PROMPT


def test_a_lora_request_without_enable_lora_is_refused_with_what_to_do(llm: LLM) -> None:
    from pitstop.lora.request import LoRARequest

    lora = LoRARequest("sql", 1, "/adapters/sql")
    assert lora == LoRARequest("sql", 1, "/adapters/sql") and lora.adapter_id == 1
    with pytest.raises(InvalidRequestError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("sql", 0, "/adapters/sql")
    for call in (
        lambda: llm.generate(["Hi"], SamplingParams(max_tokens=1), lora_request=lora),
        lambda: llm.chat([{"role": "user", "content": "Hi"}], lora_request=lora),
    ):
        with pytest.raises(InvalidRequestError, match="lora_request.*enable_lora=True"):
            call()
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["Hi"], SamplingParams(max_tokens=1), lora_request=None, priority=[0])
    assert len(out[0].token_ids) == 1


def test_sampling_params_take_assignment_with_the_same_checks(llm: LLM) -> None:
    params = SamplingParams(temperature=0, min_tokens=2)
    params.max_tokens = 3
    params.ignore_eos = True
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    assert len(out.token_ids) == 3
    for field, value in [("top_p", 1.5), ("max_tokens", 1), ("n", 0), ("temprature", 1)]:
        with pytest.raises(InvalidRequestError) as assigned:
            setattr(params, field, value)
        with pytest.raises(InvalidRequestError) as built:
            SamplingParams(**{"temperature": 0, "min_tokens": 2, "max_tokens": 3, field: value})
        assert str(assigned.value) == str(built.value)
    assert params.max_tokens == 3 and params.top_p == 1.0  # unchanged by a refused assignment
    params.stop = "x"  # converted as construction converts it
    assert params.stop == ("x",)


# ---------------------------------------------------------------- 5: the EOS text
@pytest.mark.parametrize("include", [False, True])
def test_the_eos_text_is_left_out_unless_asked(llm: LLM, include: bool) -> None:
    tokenizer = llm.engine.tokenizer
    params = SamplingParams(
        temperature=0,
        max_tokens=8,
        min_tokens=2,
        logit_bias={TINY_EOS: 100},
        skip_special_tokens=False,
        include_stop_str_in_output=include,
    )
    c = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    c = c.outputs[0]
    assert c.token_ids[-1] == TINY_EOS and len(c.token_ids) == 3 and c.finish_reason == "stop"
    eos_text = tokenizer.decode([TINY_EOS], skip_special_tokens=False)
    assert eos_text and c.text.endswith(eos_text) == include
    assert c.text == tokenizer.decode(c.token_ids[: None if include else -1], False)


def test_the_public_sampling_params_is_the_engines_value_with_its_fields_and_defaults() -> None:
    """pitstop.SamplingParams checks what it is given and is the engine's plain value: the
    same fields, the same defaults, so a request built either way samples alike."""
    import attrs

    from pitstop.requests.sampling_params import SamplingParams as EngineSamplingParams

    public = {a.name: a.default for a in attrs.fields(SamplingParams)}
    engine = {a.name: a.default for a in attrs.fields(EngineSamplingParams)}
    assert public == engine
    params = SamplingParams(top_k=0, logit_bias={"7": 1})
    assert isinstance(params, EngineSamplingParams)
    assert (params.top_k, params.logit_bias) == (-1, ((7, 1.0),))
