"""Prometheus metrics of a serving engine, named ``pitstop:*`` in the style of vLLM's ``vllm:*``.

Two sources feed them:

- the engine snapshot (:class:`pitstop.entrypoints.async_engine.EngineSnapshot`), read at
  scrape time by a custom collector: request counts, KV-cache usage,
  prefix-cache queries and hits, the allocator's own counters (``pitstop:allocator_*``:
  the ``tiered`` allocator's hits per tier, bytes copied each way, copy time hidden and
  exposed), preemptions;
- every request output, observed on the engine thread: prompt and
  generation token counters, finished requests by reason, and the latency
  histograms (from the engine's own timestamps, so HTTP overhead is not in
  them).

Each app gets its own :class:`~prometheus_client.CollectorRegistry`, so
several servers can live in one process (tests).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pitstop.entrypoints.async_engine import AsyncLLM
from pitstop.requests.outputs import RequestOutput

# Bucket bounds (seconds) after vLLM's, wide enough for a CPU and a GPU.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)

FINISH_REASONS = ("stop", "length", "abort")

# Why a request failed, the label of pitstop:request_failures_total:
REQUEST_FAILURE_REASONS = (
    "invalid_request",  # 400, 404, 413, 415: the request itself is wrong
    "unauthorized",  # 401, 403: API key, Host or Origin refused
    "timeout",  # 408: the request did not arrive within --read-timeout
    "rate_limited",  # 429: connection, queue or per-client cap
    "shutdown",  # 503 during the drain, or ended by the server at its end
    "step_failure",  # an engine step failed and took this request with it
    "request_error",  # the engine failed this request alone (isolated)
    "server_error",  # 500: a bug in the server
)


def failure_reason(status: int, code: str | None = None) -> str:
    """The ``reason`` label of a request refused or failed with HTTP ``status`` (and ``code``)."""
    if code == "request_failed":
        return "request_error"
    if code == "engine_error":
        return "step_failure"
    if status in (401, 403):
        return "unauthorized"
    if status == 408:
        return "timeout"
    if status == 429:
        return "rate_limited"
    if status == 503:
        return "shutdown"
    if status >= 500:
        return "server_error"
    return "invalid_request"


class _SnapshotCollector(Collector):
    """Reads the engine's latest snapshot at scrape time."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.llm.snapshot
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        a = snap.allocator
        yield gauge(
            "pitstop:num_requests_running", "Requests in the running batch.", snap.num_running
        )
        yield gauge(
            "pitstop:num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting
        )
        yield gauge(
            "pitstop:kv_cache_usage_perc",
            "Fraction of KV-cache pages in use (1 = full).",
            snap.kv_cache_usage,
        )
        yield gauge("pitstop:kv_cache_pages_free", "KV-cache pages free.", a.pages_free)
        yield gauge("pitstop:kv_cache_pages_total", "KV-cache pages in all.", a.num_pages)
        yield counter(
            "pitstop:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            a.prefix_queried_tokens,
        )
        yield counter(
            "pitstop:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            a.prefix_hit_tokens,
        )
        for name, total in sorted(a.counters.items()):  # the allocator's own (a host tier's)
            yield counter(
                f"pitstop:allocator_{name}",
                f"The allocator's own counter {name} since start (AllocatorStats.counters).",
                total,
            )
        yield counter(
            "pitstop:num_preemptions", "Sequences preempted since start.", snap.stats.preemptions
        )
        yield counter("pitstop:engine_steps", "Engine steps run since start.", snap.stats.steps)
        yield counter(
            "pitstop:spec_decode_num_draft_tokens",
            "Draft tokens verified by the target model since start.",
            snap.stats.spec_proposed_tokens,
        )
        yield counter(
            "pitstop:spec_decode_num_accepted_tokens",
            "Draft tokens the target model kept since start.",
            snap.stats.spec_accepted_tokens,
        )
        yield counter(
            "pitstop:spec_decode_steps",
            "Engine steps that speculated (proposed drafts and verified them).",
            snap.stats.spec_steps,
        )
        yield counter(
            "pitstop:spec_decode_skipped_batch_steps",
            "Engine steps decoded plainly because more than speculative_max_batch sequences ran.",
            snap.stats.spec_skipped_batch_steps,
        )
        yield counter(
            "pitstop:spec_decode_paused_sequence_steps",
            "Sequence-steps without drafts because the sequence's recent acceptance was low.",
            snap.stats.spec_paused_seq_steps,
        )
        yield counter(
            "pitstop:spec_decode_empty_proposals",
            "Sequence-steps for which the proposer found no draft.",
            snap.stats.spec_empty_proposals,
        )
        yield counter(
            "pitstop:kv_cache_utilization_sum",
            "Sum over engine steps of KV tokens held / tokens reserved (divide by engine_steps).",
            snap.stats.utilization_sum,
        )


class ServerMetrics:
    """Every ``pitstop:*`` metric of one served engine, in one registry."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        disable_created_metrics()  # no *_created series: they only add noise to a scrape
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r = self.registry
        label = ["model_name"]
        r.register(_SnapshotCollector(llm, model_name))
        self.prompt_tokens = Counter(
            "pitstop:prompt_tokens",
            "Prompt tokens of requests that started generating.",
            label,
            registry=r,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "pitstop:generation_tokens", "Tokens generated.", label, registry=r
        ).labels(model_name)
        self._success = Counter(
            "pitstop:request_success",
            "Requests finished, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: self._success.labels(model_name, reason) for reason in FINISH_REASONS
        }
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS
        )
        self.tpot = self._histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Request latency from arrival to finish.", E2E_BUCKETS
        )
        self.step_failures = Counter(
            "pitstop:step_failures",
            "Engine steps that raised (each fails the requests it could not isolate).",
            label,
            registry=r,
        ).labels(model_name)
        self._failures = Counter(
            "pitstop:request_failures",
            "Requests refused or failed, by reason (invalid_request, unauthorized, timeout, "
            "rate_limited, shutdown, step_failure, request_error, server_error).",
            ["model_name", "reason"],
            registry=r,
        )
        self.request_failures = {
            reason: self._failures.labels(model_name, reason) for reason in REQUEST_FAILURE_REASONS
        }
        self._seen_step_errors: weakref.WeakSet[BaseException] = weakref.WeakSet()
        llm.add_output_listener(self.observe)
        add_failure_listener = getattr(llm, "add_failure_listener", None)
        if add_failure_listener is not None:  # steps the engine isolated a failure in
            add_failure_listener(self.observe_step_failure)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Any:
        """The histogram ``pitstop:NAME`` of this server's model, in its registry."""
        return Histogram(
            f"pitstop:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
        ).labels(self.model_name)

    # ------------------------------------------------------------------ failures
    def observe_step_failure(self, num_requests_failed: int = 0) -> None:
        """Count one failed engine step and the requests it failed (thread-safe).

        For the engine to call when a step raises; ``num_requests_failed``
        requests are counted with reason ``step_failure``.
        """
        self.step_failures.inc()
        if num_requests_failed:
            self.request_failures["step_failure"].inc(num_requests_failed)

    def observe_request_failure(self, reason: str, count: int = 1) -> None:
        """Count ``count`` requests that failed for ``reason`` (thread-safe).

        The engine calls it with ``"request_error"`` for a request it failed
        alone; the server with the other reasons of ``REQUEST_FAILURE_REASONS``.
        An unknown reason gets a series of its own.
        """
        counter = self.request_failures.get(reason)
        if counter is None:
            counter = self.request_failures[reason] = self._failures.labels(self.model_name, reason)
        counter.inc(count)

    def observe_stream_error(self, exc: BaseException) -> None:
        """A request's stream raised ``exc`` (an engine step failure): count it.

        The async engine hands the same exception object to every request of
        the failed step, so the first sighting of an object counts the step.
        """
        self.request_failures["step_failure"].inc()
        try:
            first = exc not in self._seen_step_errors
            self._seen_step_errors.add(exc)
        except TypeError:  # not weak-referenceable: count every sighting as a step
            first = True
        if first:
            self.step_failures.inc()

    def observe(self, out: RequestOutput) -> None:
        """Count one engine output (called on the engine thread)."""
        n_new = sum(len(o.new_token_ids) for o in out.outputs)
        if n_new:
            self.generation_tokens.inc(n_new)
            if out.num_generated_tokens == n_new:  # the first tokens: its prompt was computed
                self.prompt_tokens.inc(len(out.prompt_token_ids))
        if not out.finished:
            return
        reason = out.finish_reason or "abort"
        counter = self.request_success.get(reason)
        if counter is None:
            counter = self.request_success[reason] = self._success.labels(self.model_name, reason)
        counter.inc()
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
