"""`AsyncLLM`: the engine steps in its own thread; asyncio callers stream, abort, shut down.

Runs on a tiny random Llama checkpoint (fast to load); the server tests use SmolLM2.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams
from pitstop.entrypoints.async_engine import AsyncLLM, EngineClosedError, EngineStepError
from pitstop.errors import InvalidRequestError
from pitstop.loop.engine import LLMEngine

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    return LLM(
        str(tiny_llama),
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.02,
        max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def engine(offline: LLM) -> LLMEngine:
    # One engine for the module; each test wraps it in a fresh AsyncLLM (the
    # engine outlives an AsyncLLM's shutdown, and every test ends with none live).
    return offline.engine


@pytest.fixture
def allm(engine: LLMEngine) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(engine)
    yield llm
    llm.close(grace_s=0.0)
    assert not engine.has_unfinished_requests()


def greedy(n: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def _all_pages_free(llm: AsyncLLM) -> bool:
    a = llm.snapshot.allocator
    return a.pages_free == a.num_pages


def test_stream_matches_offline(allm: AsyncLLM, offline: LLM) -> None:
    prompts = ["Hello there", "The capital of France is", "1, 2, 3,"]
    # Offline reference first (the AsyncLLM thread is idle: it only steps when asked).
    expected = {p: offline.generate(p, greedy(12), use_tqdm=False)[0] for p in prompts}

    async def run(prompt: str) -> tuple[str, list[int], str | None]:
        text, ids, reason = "", [], None
        async for out in allm.generate(prompt, greedy(12)):
            text += out.text_delta
            ids += out.new_token_ids
            reason = out.finish_reason
        return text, ids, reason

    async def main() -> list[tuple[str, list[int], str | None]]:
        return await asyncio.gather(*(run(p) for p in prompts))

    for prompt, (text, ids, reason) in zip(prompts, asyncio.run(main()), strict=True):
        assert ids == expected[prompt].token_ids
        assert text == expected[prompt].text
        assert reason == expected[prompt].finish_reason


def test_many_concurrent_requests_all_finish(allm: AsyncLLM) -> None:
    async def run(i: int) -> tuple[int, int, bool]:
        stream = await allm.add_request(f"request number {i}", greedy(1 + i % 7, ignore_eos=True))
        n = 0
        last = None
        async for out in stream:
            n += len(out.new_token_ids)
            last = out
        assert last is not None and last.finished
        return i, n, len(last.token_ids) == n

    async def main():
        return await asyncio.gather(*(run(i) for i in range(32)))

    for i, n, consistent in asyncio.run(main()):
        assert n == 1 + i % 7
        assert consistent
    assert _all_pages_free(allm)


def test_listeners_count_an_output_before_its_stream_gets_it(allm: AsyncLLM) -> None:
    """The server's metrics are an output listener: a client that has read a request's last
    output must find it counted (before, the stream got it first, and a slow listener, or a
    busy machine, let a client read ``/metrics`` without it)."""
    counted: list[str] = []

    def slow_listener(out) -> None:
        if out.finished:
            time.sleep(0.2)
            counted.append(out.request_id)

    allm.add_output_listener(slow_listener)

    async def main() -> bool:
        async for out in allm.generate("Hello there", greedy(3)):
            if out.finished:
                return out.request_id in counted
        return False

    assert asyncio.run(main())


def test_invalid_request_fails_alone(allm: AsyncLLM) -> None:
    async def main() -> None:
        good = await allm.add_request("a good prompt", greedy(6, ignore_eos=True))
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await allm.add_request(prompt_token_ids=[5] * (MAX_MODEL_LEN + 3), params=greedy(4))
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await allm.add_request(prompt_token_ids=[10**9], params=greedy(4))
        with pytest.raises(InvalidRequestError):
            await allm.add_request("", greedy(4))
        outs = [out async for out in good]
        assert outs[-1].finish_reason == "length"
        assert len(outs[-1].token_ids) == 6

    asyncio.run(main())


def test_chat_messages_use_the_template(allm: AsyncLLM, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    expected = offline.chat(messages, greedy(8), use_tqdm=False)[0]

    async def main():
        return [out async for out in allm.generate(messages=messages, params=greedy(8))]

    outs = asyncio.run(main())
    assert outs[-1].token_ids == expected.token_ids
    assert outs[-1].prompt_token_ids == expected.prompt_token_ids


def test_abort_frees_pages_at_once(allm: AsyncLLM) -> None:
    async def main() -> None:
        stream = await allm.add_request("a long one", greedy(None, ignore_eos=True))
        first = await stream.__anext__()
        assert not first.finished
        t0 = time.monotonic()
        stream.abort()
        rest = [out async for out in stream]
        assert rest[-1].finish_reason == "abort"
        while not _all_pages_free(allm):
            assert time.monotonic() - t0 < 1.0, "pages not freed within a second"
            await asyncio.sleep(0.01)

    asyncio.run(main())


def test_abort_from_another_thread(allm: AsyncLLM) -> None:
    async def main() -> str | None:
        stream = await allm.add_request("abort me", greedy(None, ignore_eos=True))
        await stream.__anext__()
        threading.Thread(target=allm.abort, args=(stream.request_id,)).start()
        last = None
        async for out in stream:
            last = out
        return last.finish_reason if last else None

    assert asyncio.run(main()) == "abort"


def test_leaving_generate_early_aborts(allm: AsyncLLM) -> None:
    async def main() -> None:
        async for _out in allm.generate("stop reading", greedy(None, ignore_eos=True)):
            break
        t0 = time.monotonic()
        while allm.snapshot.num_running or not _all_pages_free(allm):
            assert time.monotonic() - t0 < 1.0
            await asyncio.sleep(0.01)

    asyncio.run(main())


def test_idle_engine_sleeps(allm: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = allm.engine.has_unfinished_requests

    def counting() -> bool:
        nonlocal calls
        calls += 1
        return real()

    monkeypatch.setattr(allm.engine, "has_unfinished_requests", counting)
    time.sleep(0.3)
    assert calls <= 2, f"the idle engine thread polled {calls} times in 0.3 s"


def test_step_failure_fails_live_requests_only(
    allm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = allm.engine.step
    state = {"fail": True}

    def flaky_step():
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(allm.engine, "step", flaky_step)

    async def main() -> None:
        stream = await allm.add_request("doomed", greedy(4))
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in stream:
                pass
        outs = [out async for out in allm.generate("fine", greedy(3, ignore_eos=True))]
        assert outs[-1].finish_reason == "length"

    asyncio.run(main())
    assert _all_pages_free(allm)


def test_shutdown_aborts_what_runs(engine: LLMEngine) -> None:
    llm = AsyncLLM(engine)

    async def main() -> None:
        stream = await llm.add_request("running at shutdown", greedy(None, ignore_eos=True))
        await stream.__anext__()
        await llm.shutdown(grace_s=0.0)
        rest = [out async for out in stream]
        assert rest[-1].finish_reason == "abort"
        assert not llm.is_running
        with pytest.raises(EngineClosedError):
            await llm.add_request("too late", greedy(2))

    asyncio.run(main())
    assert not engine.has_unfinished_requests()


def test_shutdown_with_grace_lets_requests_finish(engine: LLMEngine) -> None:
    llm = AsyncLLM(engine)

    async def main() -> None:
        stream = await llm.add_request("finish me", greedy(5, ignore_eos=True))
        llm.begin_shutdown(grace_s=None)
        outs = [out async for out in stream]
        assert outs[-1].finish_reason == "length"
        assert await asyncio.to_thread(llm.join, 5.0)

    asyncio.run(main())
