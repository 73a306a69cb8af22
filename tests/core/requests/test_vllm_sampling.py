"""vLLM's SamplingParams and outputs: max_tokens=None, clone, allowed tokens, bad words,
logits processors, prompt truncation, detokenize, logprobs=-1, stop tokens' text,
stop_reason, num_cached_tokens and a callable ``finished``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from helpers.models import SMOLLM2_VOCAB, make_tiny_checkpoint

from pitstop import LLM, SamplingParams
from pitstop.entrypoints.sampling_params import VLLM_NEUTRAL, VLLM_ONLY
from pitstop.errors import InvalidRequestError
from pitstop.plugins.samplers.bad_words import bad_word_token_ids
from pitstop.requests.outputs import CallableBool

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("vllm-sampling"), "llama")


@pytest.fixture(scope="module")
def llm(tiny: Path) -> LLM:
    return LLM(str(tiny), device="cpu", max_model_len=64, max_num_pages=32, page_size=8)


def _greedy(llm: LLM, **kw) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 12), ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    return out.outputs[0].token_ids


# ---------------------------------------------------------------- max_tokens
def test_max_tokens_none_runs_to_max_model_len(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - len(PROMPT)


def test_max_tokens_over_the_context_names_both_numbers(llm: LLM) -> None:
    params = SamplingParams(max_tokens=60)
    with pytest.raises(
        InvalidRequestError, match=r"8 tokens and max_tokens is 60: 68 tokens.*max_model_len=64"
    ):
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_server_answers_400_for_max_tokens_over_the_context(tiny: Path) -> None:
    pytest.importorskip("fastapi")
    from pitstop.config import EngineConfig
    from pitstop.entrypoints.async_engine import AsyncLLM
    from pitstop.loop.engine import LLMEngine
    from pitstop.server.app import ServerSettings, create_app

    config = EngineConfig(
        model=str(tiny), device="cpu", dtype="float32", max_num_pages=16, max_model_len=64
    )
    engine = AsyncLLM(LLMEngine(config))

    async def main() -> None:
        app = create_app(engine, ServerSettings(served_model_name="tiny"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100_000}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            assert "100000" in r.text and "max_model_len=64" in r.text
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            r = await c.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
            assert r.status_code == 200, r.text  # no max_tokens given: up to the context
            choice = r.json()["choices"][0]
            assert "stop_reason" in choice
            stop = {**body, "max_tokens": 8, "temperature": 0, "stop_token_ids": [9999]}
            r = await c.post("/v1/completions", json=stop)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            # every token stops: the first one is the stop_reason, and its text is left out
            every = {**stop, "stop_token_ids": list(range(SMOLLM2_VOCAB)), "stream": True}
            async with c.stream("POST", "/v1/completions", json=every) as streamed:
                lines = [x async for x in streamed.aiter_lines() if x.startswith("data: {")]
            choices = [ch for x in lines for ch in json.loads(x[6:])["choices"]]
            final = [ch for ch in choices if ch["finish_reason"]]
            assert final[0]["finish_reason"] == "stop" and isinstance(final[0]["stop_reason"], int)
            assert "".join(ch["text"] for ch in choices) == ""
            assert all(ch["stop_reason"] is None for ch in choices if not ch["finish_reason"])

    try:
        asyncio.run(main())
    finally:
        engine.close()


# ---------------------------------------------------------------- SamplingParams fields
def test_clone_is_an_equal_copy() -> None:
    p = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0})
    q = p.clone()
    assert q == p and q is not p


@pytest.mark.parametrize("name", sorted(VLLM_ONLY))
def test_vllm_only_fields_are_refused_by_name(name: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"^{name} is vLLM's SamplingParams field"):
        SamplingParams(**{name: "not a default"})
    for value in VLLM_NEUTRAL.get(name, ()):  # vLLM's defaults ask for what pitstop does
        assert SamplingParams(**{name: value}) == SamplingParams()


def test_a_misspelt_field_names_the_nearest() -> None:
    with pytest.raises(InvalidRequestError, match="did you mean 'temperature'"):
        SamplingParams(temprature=0.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_p": 1.5}, "top_p must be a finite number in (0, 1], got 1.5; use 1 to disable"),
        ({"n": 0}, "n must be an integer in [1, 128], got 0"),
        ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false, got 1"),
        ({"top_k": True}, "top_k must be -1 or 0 (off) or an integer in [1, 2**63 - 1], got True"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be null or a non-empty list"),
        ({"bad_words": [""]}, "bad_words must be a list of non-empty strings"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be null, -1"),
        ({"logprobs": -2}, "logprobs must be null, -1 (the whole vocabulary)"),
        ({"logits_processors": [lambda x: x]}, "logits_processors must be callables of 2 or 3"),
        ({"detokenize": False, "stop": "x"}, "detokenize=False leaves no text"),
    ],
)
def test_one_message_style(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_allowed_token_ids_restrict_every_token(llm: LLM) -> None:
    allowed = [20, 21, 22]
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature,
            max_tokens=10,
            ignore_eos=True,
            allowed_token_ids=allowed,
            seed=1,
        )
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
        assert len(out.token_ids) == 10 and set(out.token_ids) <= set(allowed)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.generate(
            prompt_token_ids=[PROMPT],
            sampling_params=SamplingParams(allowed_token_ids=[SMOLLM2_VOCAB]),
            use_tqdm=False,
        )


def _contains(ids: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_are_never_generated(llm: LLM) -> None:
    tokenizer = llm.engine.tokenizer
    plain = _greedy(llm)
    words = [tokenizer.decode([plain[0]]), tokenizer.decode(plain[3:5])]
    blocked = bad_word_token_ids(tokenizer, words)
    assert any(_contains(plain, s) for s in blocked)  # the greedy answer has them
    for overlap in ("off", "on"):
        engine_llm = (
            llm
            if overlap == "off"
            else LLM(
                llm.config.model, device="cpu", max_model_len=64, max_num_pages=32, overlap="on"
            )
        )
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=words)
        out = engine_llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
        ids = out[0].token_ids
        assert len(ids) == 12 and ids != plain
        assert not any(_contains(ids, s) for s in blocked), (words, blocked, ids)


def test_logits_processors_both_forms_batched(llm: LLM) -> None:
    seen: list[tuple[list[int], list[int]]] = []

    def force_30(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(logits, float("-inf"))
        forced[30 + len(output_ids) % 2] = 0.0
        return forced

    def record(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append((list(prompt_ids), list(output_ids)))
        logits[40] = 1e9  # in place is fine too
        return logits

    base = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logits_processors=[force_30]),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logits_processors=[record]),
        base,
    ]
    plain = llm.generate(prompt_token_ids=[PROMPT], sampling_params=base, use_tqdm=False)[0]
    outs = llm.generate(prompt_token_ids=[PROMPT] * 3, sampling_params=params, use_tqdm=False)
    assert outs[0].token_ids == [30, 31, 30, 31, 30]
    assert outs[1].token_ids == [40] * 5
    assert outs[2].token_ids == plain.token_ids  # a row without processors is untouched
    assert seen == [(PROMPT, [40] * i) for i in range(5)]


def test_a_failing_logits_processor_fails_only_its_request(llm: LLM) -> None:
    def wrong(output_ids: list[int], logits: torch.Tensor) -> list[float]:
        return [0.0]

    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logits_processors=[wrong]),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    outs = llm.generate(prompt_token_ids=[PROMPT] * 2, sampling_params=params, use_tqdm=False)
    assert outs[0].finish_reason == "error" and "logits_processors" in (outs[0].error or "")
    assert len(outs[1].token_ids) == 3


def test_truncate_prompt_tokens_keeps_the_last_ones(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT[-3:]
    params = SamplingParams(max_tokens=2, truncate_prompt_tokens=-1)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT


def test_detokenize_false_gives_ids_only(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    assert out.text == "" and len(out.token_ids) == 4


def test_logprobs_minus_one_is_the_whole_vocabulary(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=-1)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    assert [len(position) for position in out.logprobs] == [SMOLLM2_VOCAB] * 2
    chosen = out.logprobs[0][out.token_ids[0]]
    assert chosen.rank == 1
    total = torch.tensor([e.logprob for e in out.logprobs[0].values()]).logsumexp(0)
    assert abs(total.item()) < 1e-3


# ---------------------------------------------------------------- outputs
def test_a_stop_tokens_text_is_left_out_unless_asked(llm: LLM) -> None:
    tokenizer = llm.engine.tokenizer
    plain = _greedy(llm)
    stop = next(t for i, t in enumerate(plain) if i >= 2 and t not in plain[:i])
    cut = plain.index(stop)
    for include in (False, True):
        params = SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            stop_token_ids=[stop],
            include_stop_str_in_output=include,
        )
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
        c = out.outputs[0]
        assert c.token_ids == plain[: cut + 1] and c.stop_reason == stop
        assert c.text == tokenizer.decode(plain[: cut + 1 if include else cut])


def test_text_decoded_when_taken_equals_the_streamed_deltas_and_the_whole_decode(
    llm: LLM,
) -> None:
    """Without stop strings a sample's text is decoded when an output is taken, not per
    token: offline (one output, at the end) and streamed (an output a step) it is the same
    text, the deltas add up to it, and it is the decode of the output ids."""
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    engine.add_request(params=params, prompt_token_ids=PROMPT, request_id="streamed")
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step(stream=True):
            deltas.append(out.outputs[0].text_delta)
            last = out
    assert last is not None and last.finished
    text = offline.outputs[0].text
    assert last.outputs[0].text == text == "".join(deltas)
    assert text == tokenizer.decode(offline.outputs[0].token_ids)


def test_stop_reason_is_none_at_length(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    assert out.outputs[0].stop_reason is None and out.finish_reason == "length"


def test_finished_works_as_attribute_and_as_call(llm: LLM) -> None:
    out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False)[0]
    assert out.finished is True  # RequestOutput.finished: vLLM's attribute
    c = out.outputs[0]
    assert c.finished and c.finished() is True and c.finished == True  # noqa: E712
    assert repr(CallableBool(False)) == "False" and not CallableBool(0)()


def test_num_cached_tokens_counts_prefix_hits(tiny: Path) -> None:
    prefix = LLM(
        str(tiny),
        device="cpu",
        max_model_len=64,
        max_num_pages=32,
        page_size=8,
        enable_prefix_caching=True,
    )
    prompt = list(range(100, 120))  # two full pages of 8 and a partial one
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = prefix.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    again = prefix.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16
    assert again.token_ids == first.token_ids
