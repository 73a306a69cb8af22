"""``pitstop serve --enable-lora --lora-modules NAME=PATH``: an adapter served as a model name.

In process on a tiny Llama checkpoint with a PEFT adapter made at test time: ``/v1/models``
lists the adapter with the model as ``parent``; a completion whose ``model`` is the adapter
gives PEFT's ``merge_and_unload()`` tokens (greedy, fp32), one with the base name the base
model's; the flag's spellings and refusals.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from helpers.checkpoints import greedy_continuation, hf_model, save_random_lora
from helpers.models import make_tiny_checkpoint

from pitstop.errors import ConfigError

peft = pytest.importorskip("peft")

PROMPT = [5, 17, 99, 1234, 4321, 42, 7]
MAX_TOKENS = 5


def _adapter(base: Path, out: Path) -> Path:
    return save_random_lora(
        hf_model(base), out, rank=4, alpha=8, targets=["q_proj", "down_proj"], seed=3, b_scale=20
    )


def _greedy(model) -> list[int]:
    return greedy_continuation(model, PROMPT, MAX_TOKENS)


def test_an_adapter_is_a_model_name(tmp_path: Path) -> None:
    from pitstop.config import EngineConfig
    from pitstop.entrypoints.async_engine import AsyncLLM
    from pitstop.loop.engine import LLMEngine
    from pitstop.server.app import ServerSettings, create_app

    base = make_tiny_checkpoint(tmp_path, "llama")
    adapter = _adapter(base, tmp_path / "sql")
    merged = peft.PeftModel.from_pretrained(hf_model(base), str(adapter)).merge_and_unload()
    expected = {"tiny": _greedy(hf_model(base)), "sql": _greedy(merged)}
    assert expected["tiny"] != expected["sql"]
    config = EngineConfig(
        model=str(base),
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.02,
        max_model_len=128,
        adapter="lora",
    )
    llm = AsyncLLM(LLMEngine(config))
    settings = ServerSettings(
        served_model_name="tiny", lora_modules=[("sql", str(adapter))], api_key="k"
    )

    async def main() -> None:
        transport = httpx.ASGITransport(app=create_app(llm, settings))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", headers={"Authorization": "Bearer k"}
        ) as c:
            r = await c.get("/v1/models")
            cards = {card["id"]: card for card in r.json()["data"]}
            assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == str(adapter)
            assert "parent" not in cards["tiny"]
            for name in ("sql", "tiny"):
                r = await c.post(
                    "/v1/completions",
                    json={
                        "model": name,
                        "prompt": PROMPT,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["model"] == name
                text = body["choices"][0]["text"]
                assert text == llm.engine.tokenizer.decode(expected[name]), name
            r = await c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
            assert r.status_code == 404 and "'sql'" in r.json()["error"]["message"]
            await _load_and_unload(c, adapter, expected["sql"], llm.engine.tokenizer)

    try:
        asyncio.run(main())
    finally:
        llm.close()


async def _load_and_unload(c: httpx.AsyncClient, adapter: Path, tokens: list[int], tok) -> None:
    """vLLM's load/unload endpoints: the key is needed, a bad adapter is a 400 naming it."""
    load = {"lora_name": "sql2", "lora_path": str(adapter)}
    r = await c.post("/v1/load_lora_adapter", json=load, headers={"Authorization": ""})
    assert r.status_code == 401
    r = await c.post("/v1/load_lora_adapter", json={**load, "lora_path": "/nowhere"})
    assert r.status_code == 400 and "is not a folder" in r.json()["error"]["message"]
    r = await c.post("/v1/load_lora_adapter", json=load)
    assert r.status_code == 200, r.text
    r = await c.post("/v1/load_lora_adapter", json=load)
    assert r.status_code == 400 and "already served" in r.json()["error"]["message"]
    assert "sql2" in [card["id"] for card in (await c.get("/v1/models")).json()["data"]]
    body = {"model": "sql2", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = await c.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(tokens)
    r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})
    assert r.status_code == 200, r.text
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 404
    r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})
    assert r.status_code == 404


def test_lora_modules_spellings_and_refusals() -> None:
    from pitstop.server.cli import lora_modules

    assert lora_modules(["a=/x", json.dumps({"name": "b", "path": "/y"})]) == (
        ("a", "/x"),
        ("b", "/y"),
    )
    for bad, match in (
        (["a"], "NAME=PATH"),
        (["a=/x", "a=/y"], "twice"),
        (["=/x"], "non-empty"),
        (['{"name": "a"}'], "path"),
    ):
        with pytest.raises(ConfigError, match=match):
            lora_modules(bad)


def test_lora_modules_need_enable_lora(tmp_path: Path) -> None:
    from pitstop.config import EngineConfig
    from pitstop.entrypoints.async_engine import AsyncLLM
    from pitstop.loop.engine import LLMEngine
    from pitstop.server.app import ServerSettings, create_app

    base = make_tiny_checkpoint(tmp_path, "llama")
    config = EngineConfig(
        model=str(base), device="cpu", dtype="float32", kv_cache_gib=0.02, max_model_len=64
    )
    llm = AsyncLLM(LLMEngine(config))
    try:
        with pytest.raises(ConfigError, match="--enable-lora"):
            create_app(llm, ServerSettings(lora_modules=[("a", "/x")]))
    finally:
        llm.close()
