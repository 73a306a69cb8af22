"""`pitstop serve --allocator tiered` under a small multi-turn load (the official ``openai``
client, a tiny random checkpoint on the CPU): conversations come back after other traffic
evicted them, one client leaves mid-turn, and afterwards every page is free, the host tier
served hits, and a turn asked again gives the same greedy tokens."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers.models import make_tiny_checkpoint
from helpers.server_process import serve_subprocess

# 20 pages of 8 tokens: six open conversations of up to ~90 tokens do not all fit
FLAGS = ["--device", "cpu", "--dtype", "float32", "--page-size", "8", "--max-num-pages", "20"]
FLAGS += ["--max-model-len", "160", "--allocator", "tiered", "--kv-offloading-size", "0.01"]
TURNS = 4


def _health_idle(http: httpx.Client) -> dict:
    deadline = time.monotonic() + 10
    while True:
        h = http.get("/health").json()
        if h["pages_free"] == h["num_pages"] and h["num_running"] == h["num_waiting"] == 0:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"pages not all free 10 s after the load: {h}")
        time.sleep(0.05)


def _metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


@pytest.mark.slow
def test_multiturn_load_with_a_client_leaving_mid_turn(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with serve_subprocess([str(folder), *FLAGS], env, start_timeout=120) as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        rng = random.Random(0)
        errors: list[BaseException] = []
        last: dict[int, tuple[list[int], str]] = {}

        def conversation(c: int) -> None:
            history = [rng.randrange(10, 40000) for _ in range(40)]
            try:
                for turn in range(TURNS):
                    if c == 0 and turn == 2:  # this client leaves mid-turn
                        stream = client.completions.create(
                            model=model,
                            prompt=history,
                            max_tokens=50,
                            temperature=0,
                            stream=True,
                            extra_body={"ignore_eos": True},
                        )
                        next(iter(stream))
                        stream.close()
                        return
                    out = client.completions.create(
                        model=model,
                        prompt=history,
                        max_tokens=6,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    last[c] = (list(history), out.choices[0].text)
                    history = history + [rng.randrange(10, 40000) for _ in range(12)]
                    time.sleep(0.05 * c)  # the others' traffic comes between two turns
            except BaseException as exc:  # noqa: BLE001  (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        with httpx.Client(base_url=url, timeout=30) as http:
            _health_idle(http)
            assert _metric(http, "pitstop:allocator_host_hit_tokens_total") > 0
            assert _metric(http, "pitstop:allocator_bytes_to_host_total") > 0
            # the last turn asked again (served from either tier now) gives the same tokens
            prompt, reply = next(iter(last.values()))
            again = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert again.choices[0].text == reply
            _health_idle(http)
