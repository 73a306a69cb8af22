"""The ``multiturn`` workload: its conversations, how the clients send their turns, the host
tier's figures (in process and from ``/metrics``), and vLLM's offloading arguments."""

from __future__ import annotations

import time

from pitstop.bench import vllm_peer
from pitstop.bench.drivers import run_workload
from pitstop.bench.http import metric_deltas
from pitstop.bench.report import RequestRecord, tier_figures
from pitstop.bench.workloads import BenchRequest, build_workload, fit_to_model, multiturn
from pitstop.config import EngineConfig


def test_each_turn_is_the_history_so_far_plus_a_new_message() -> None:
    wl = multiturn()
    assert wl.num_requests == 1200 and len(wl.streams) == 50
    assert sorted(i for s in wl.streams for i in s) == list(range(1200))
    for conversation in range(200):
        turns = [wl.requests[conversation * 6 + t] for t in range(6)]
        for before, after in zip(turns, turns[1:], strict=False):
            ids = after.prompt_token_ids
            assert ids[: before.input_len] == before.prompt_token_ids
            assert after.input_len > before.input_len + before.output_len  # reply + message
    longest = max(r.input_len for r in wl.requests)
    assert 6000 < longest <= 8000 and wl.engine_defaults["max_model_len"] >= longest + 300
    # a client's stream interleaves 4 conversations: A1 B1 C1 D1 A2 ...
    assert wl.streams[0][:5] == (0, 6, 12, 18, 1)


def test_a_smaller_multiturn_keeps_whole_conversations_first() -> None:
    wl = build_workload("multiturn", num_requests=14, input_len=(8, 16), output_len=(2, 3))
    assert wl.num_requests == 14 and [len(s) for s in wl.streams] == [14]
    kept, skipped = fit_to_model(wl, vocab_size=1 << 20, max_model_len=40)
    assert len(kept.requests) + len(skipped) == 14
    assert sorted(i for s in kept.streams for i in s) == list(range(len(kept.requests)))


class _Backend:
    """Finishes each request one poll after it was sent; remembers the order of sends."""

    name = "fake"

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.in_flight: list[tuple[str, BenchRequest, float]] = []

    def submit(self, request_id: str, request: BenchRequest, arrival: float) -> None:
        self.sent.append(request_id)
        self.in_flight.append((request_id, request, arrival))

    def poll(self, timeout: float = 0.0) -> list[RequestRecord]:
        done, self.in_flight = self.in_flight, []
        now = time.perf_counter()
        return [
            RequestRecord(rid, r.input_len, r.output_len, arrival, now, now, [now])
            for rid, r, arrival in done
        ]

    def has_work(self) -> bool:
        return bool(self.in_flight)

    def begin_run(self) -> None:
        pass

    def run_stats(self) -> dict:
        return {}


def test_a_stream_sends_its_next_turn_only_when_the_last_one_completed() -> None:
    wl = multiturn(num_requests=24, input_len=(8, 16), output_len=(2, 3))  # one stream of 24
    backend = _Backend()
    result = run_workload(backend, wl, concurrency=16)
    assert len(result.records) == 24
    assert backend.sent == [f"r{i}" for i in wl.streams[0]]


def test_tier_figures_and_the_counters_of_a_pitstop_server() -> None:
    before = {"pitstop:allocator_host_hit_tokens_total": 10.0}
    after = {
        "pitstop:allocator_host_hit_tokens_total": 110.0,
        "pitstop:allocator_device_hit_tokens_total": 50.0,
        "pitstop:allocator_miss_tokens_total": 50.0,
        "pitstop:allocator_bytes_to_device_total": 2.0**30,
    }
    counters = metric_deltas(before, after)["allocator_counters"]
    assert counters["host_hit_tokens"] == 100.0
    figures = tier_figures(counters)
    assert figures["host_hit_rate"] == 0.5 and figures["device_hit_rate"] == 0.25
    assert figures["gib_to_device"] == 1.0


def test_vllm_gets_the_same_device_cache_and_its_cpu_offloading() -> None:
    wl = multiturn(num_requests=6)
    config = EngineConfig(model="x", kv_cache_gib=2.0, options={"kv_offloading_size": 32.0})
    args = vllm_peer.engine_args({}, config, wl, dtype="bfloat16", max_model_len=8192)
    assert args["enable_prefix_caching"] is True
    assert args["kv_cache_memory_bytes"] == 2 * 2**30
    assert args["kv_offloading_size"] == 32.0 and args["kv_offloading_backend"] == "native"


def test_vllm_names_of_the_offloading_select_tiered() -> None:
    import pytest

    from pitstop.entrypoints.vllm_args import translate
    from pitstop.errors import ConfigError

    assert translate({"kv_offloading_backend": "native", "kv_offloading_size": 8}) == {
        "allocator": "tiered",
        "kv_offloading_size": 8,
    }
    with pytest.raises(ConfigError, match="allocator='tiered'"):
        translate({"kv_offloading_backend": "lmcache"})
