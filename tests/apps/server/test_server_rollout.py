"""``pitstop serve --enable-sleep-mode --enable-weight-updates``: the rollout endpoints.

In process on tiny Llama checkpoints: off by default (404), behind the key (401); a
completion while asleep is a 503 with ``Retry-After`` and never accepted; sleeping with a
request unfinished is a 409 naming it; after ``/update_weights_from_disk`` a completion
gives what a fresh engine of that checkpoint gives.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from helpers.models import make_tiny_checkpoint

from pitstop.config import EngineConfig
from pitstop.entrypoints.async_engine import AsyncLLM
from pitstop.server.app import ServerSettings, create_app

PROMPT = [5, 17, 99, 1234, 4321, 42, 7]
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def _config(model: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.02,
        max_model_len=128,
        allocator="prefix",
        threads=1,
    )


def _serve(model: Path, **flags: bool) -> tuple[AsyncLLM, httpx.AsyncClient]:
    llm = AsyncLLM.from_config(
        _config(model), enable_sleep_mode=flags.get("enable_sleep_mode", False)
    )
    settings = ServerSettings(served_model_name="tiny", api_key="k", **flags)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(llm, settings)),
        base_url="http://test",
        # every POST declares JSON (the server refuses others: 415), these bodiless ones too
        headers={"Authorization": "Bearer k", "Content-Type": "application/json"},
    )
    return llm, client


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-rollout")
    return {s: make_tiny_checkpoint(root / s, "llama", seed=i) for i, s in enumerate(("a", "b"))}


async def _text(c: httpx.AsyncClient) -> str:
    r = await c.post("/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_endpoints_are_off_without_the_flags(checkpoints) -> None:
    llm, c = _serve(checkpoints["a"])

    async def main() -> None:
        async with c:
            for method, path in (
                ("POST", "/sleep"),
                ("POST", "/wake_up"),
                ("GET", "/is_sleeping"),
                ("POST", "/reset_prefix_cache"),
                ("POST", "/update_weights_from_disk"),
            ):
                assert (await c.request(method, path)).status_code == 404, path

    try:
        asyncio.run(main())
    finally:
        llm.close()


def test_sleep_wake_and_update_over_http(checkpoints) -> None:
    fresh, c_fresh = _serve(checkpoints["b"])

    async def expected_b() -> str:
        async with c_fresh:
            return await _text(c_fresh)

    try:
        text_b = asyncio.run(expected_b())
    finally:
        fresh.close()
    llm, c = _serve(checkpoints["a"], enable_sleep_mode=True, enable_weight_updates=True)

    async def main() -> None:
        async with c:
            text_a = await _text(c)
            assert text_a != text_b
            r = await c.post("/sleep", params={"level": 1}, headers={"Authorization": ""})
            assert r.status_code == 401
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": False}
            assert (await c.post("/sleep", params={"level": 1})).status_code == 200
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": True}
            r = await c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert "/wake_up" in r.json()["error"]["message"]
            assert (await c.post("/wake_up")).json() == {"is_sleeping": False}
            assert await _text(c) == text_a

            # a request unfinished: sleep is refused, naming it
            stream = await llm.add_request(
                prompt_token_ids=PROMPT, request_id="long-one", params=_long()
            )
            r = await c.post("/sleep", params={"level": 1})
            assert r.status_code == 409 and "long-one" in r.text, r.text
            stream.abort()
            async for _ in stream:
                pass

            # level 2: new weights are needed before generating
            assert (await c.post("/sleep", params={"level": 2})).status_code == 200
            r = await c.post("/wake_up", params={"tags": ["weights"]})
            assert r.json() == {"is_sleeping": True}
            assert (await c.post("/wake_up", params={"tags": ["kv_cache"]})).status_code == 200
            r = await c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and "update_weights" in r.text, r.text

            r = await c.post("/update_weights_from_disk", json={"model_path": "/nowhere"})
            assert r.status_code == 400 and "/nowhere" in r.text
            body = {"model_path": str(checkpoints["b"])}
            r = await c.post("/update_weights_from_disk", json=body)
            assert r.status_code == 200 and r.json()["success"], r.text
            assert await _text(c) == text_b
            assert (await c.post("/reset_prefix_cache")).json() == {"success": True}

    try:
        asyncio.run(main())
    finally:
        llm.close()


def _long():
    from pitstop.entrypoints.sampling_params import SamplingParams

    return SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
