"""``pitstop bench online --url``: the same clients and figures against a running server.

:class:`HttpBackend` is a :class:`~pitstop.bench.backends.Backend` whose
requests go to ``POST /v1/completions`` of an OpenAI-compatible server with
``stream: true`` and ``stream_options.include_usage``. The drivers of
:mod:`pitstop.bench.drivers` (closed loop, Poisson arrivals, warm-up and
repeats) and the figures of :mod:`pitstop.bench.report` are the very ones of
the in-process path; only where the times come from differs:

- arrival: the time the driver scheduled the request (as in-process);
- token times: the moment each streamed chunk reached this client (the
  events are read with ``httpx-sse``). The
  server sends one chunk per engine output that has text, so a token whose
  text is empty (a partial UTF-8 character) or a burst of tokens from one
  step arrives in one chunk with the next: ITL pools the gaps between chunks,
  and TPOT divides by the token count the server reports in ``usage``;
- finish: the chunk that carries ``finish_reason``;
- prompt and output token counts: the final ``usage`` chunk.

What only the server knows (prefix-cache hit rate, preemptions, KV-cache
utilization) comes from ``GET /metrics`` scraped before and after each run.

The client runs on an asyncio loop (``httpx.AsyncClient``) in a thread of its
own, so the driver's loop stays the synchronous one every backend shares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import sys
import threading
import time
from collections import Counter
from typing import Any

import attrs

from pitstop.bench.report import RequestRecord, fastest
from pitstop.bench.workloads import BenchRequest, Workload
from pitstop.errors import PitstopError

log = logging.getLogger(__name__)

API_KEY_ENV = "PITSTOP_API_KEY"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # between two chunks of one stream (a long queue delays the first)
POLL_WAIT_S = 0.001  # how long the driver waits for a finished request while some are in flight

# Counters of /metrics (pitstop's names, and vLLM's for its servers), as exposed (``_total``).
_PREFIXES = ("pitstop:", "vllm:")
_PREFIX_QUERIES = "prefix_cache_queries_total"
_PREFIX_HITS = "prefix_cache_hits_total"
_PREEMPTIONS = "num_preemptions_total"
_STEPS = "engine_steps_total"
_UTILIZATION_SUM = "kv_cache_utilization_sum_total"  # sum over steps of tokens held / reserved
_ALLOCATOR = "pitstop:allocator_"  # the allocator's own counters: pitstop:allocator_<name>_total


class ServerBenchError(PitstopError, ValueError):
    """The server cannot be benchmarked: unreachable, refusing the key, not OpenAI-compatible."""


def base_url(url: str) -> str:
    """``http://host:port`` from what the user gave (a trailing ``/`` or ``/v1`` is dropped)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ServerBenchError(f"--url must start with http:// or https://, got {url!r}")
    return url


def _error_message(resp: Any, body: bytes) -> str:
    """The ``error.message`` of an OpenAI error body, else the start of the body."""
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    text = body.decode("utf-8", "replace").strip()
    return text[:200] or resp.reason_phrase or "no body"


@attrs.frozen
class ServerInfo:
    """What ``GET /v1/models`` says about the server."""

    url: str
    model: str
    max_model_len: int | None = None
    root: str | None = None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _unreachable(url: str, exc: Exception) -> ServerBenchError:
    return ServerBenchError(
        f"cannot reach a server at {url} ({type(exc).__name__}: {exc}); start one with "
        f"`pitstop serve MODEL --port PORT` and pass its address to --url"
    )


def probe(url: str, api_key: str | None) -> ServerInfo:
    """Check the server answers and takes the key; return its model and ``max_model_len``."""
    import httpx

    try:
        resp = httpx.get(
            f"{url}/v1/models",
            headers=_headers(api_key),
            timeout=httpx.Timeout(30.0, connect=CONNECT_TIMEOUT_S),
        )
    except httpx.HTTPError as exc:
        raise _unreachable(url, exc) from exc
    if resp.status_code == 401:
        hint = (
            "the key given was refused"
            if api_key
            else f"pass --api-key KEY (or set ${API_KEY_ENV})"
        )
        raise ServerBenchError(
            f"the server at {url} answered 401 Unauthorized ({_error_message(resp, resp.content)}): "
            f"{hint}"
        )
    if resp.status_code != 200:
        raise ServerBenchError(
            f"GET {url}/v1/models answered {resp.status_code} "
            f"({_error_message(resp, resp.content)}): is this an OpenAI-compatible server?"
        )
    try:
        card = resp.json()["data"][0]
        return ServerInfo(
            url=url,
            model=str(card["id"]),
            max_model_len=card.get("max_model_len"),
            root=card.get("root"),
        )
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ServerBenchError(
            f"GET {url}/v1/models did not list a model ({type(exc).__name__}: {exc})"
        ) from exc


# ---------------------------------------------------------------------- /metrics
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> ``{sample name: value}``, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :].split()
        else:
            name, *rest = line.split()
        try:
            value = float(rest[0])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def scrape(url: str, api_key: str | None) -> dict[str, float] | None:
    """The server's counters now, or None when it has no usable ``/metrics``."""
    import httpx

    try:
        resp = httpx.get(f"{url}/metrics", headers=_headers(api_key), timeout=10.0)
    except httpx.HTTPError as exc:
        log.warning("scraping %s/metrics failed: %s", url, exc)
        return None
    if resp.status_code != 200:
        return None
    return parse_metrics(resp.text)


def metric_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """KV utilization, prefix hit rate and preemptions between two scrapes (None if unknown)."""
    stats: dict[str, Any] = {"kv_utilization": None, "prefix_hit_rate": None, "preemptions": None}
    if before is None or after is None:
        return stats
    counters = {  # the allocator's own (AllocatorStats.counters), pitstop's servers only
        name[len(_ALLOCATOR) : -len("_total")]: value - before.get(name, 0.0)
        for name, value in after.items()
        if name.startswith(_ALLOCATOR) and name.endswith("_total")
    }
    if counters:
        stats["allocator_counters"] = counters

    def delta(key: str) -> float | None:
        for prefix in _PREFIXES:
            name = prefix + key
            if name in after:
                return after[name] - before.get(name, 0.0)
        return None

    queries, hits = delta(_PREFIX_QUERIES), delta(_PREFIX_HITS)
    if queries is not None and hits is not None:
        stats["prefix_hit_rate"] = hits / queries if queries else None
    pre = delta(_PREEMPTIONS)
    if pre is not None:
        stats["preemptions"] = int(pre)
    steps, util = delta(_STEPS), delta(_UTILIZATION_SUM)
    if steps and util is not None:
        stats["kv_utilization"] = util / steps
    return stats


# ---------------------------------------------------------------------- the backend
class HttpBackend:
    """Requests streamed from a running server; the same interface as the in-process engine."""

    def __init__(
        self,
        info: ServerInfo,
        workload: Workload,
        *,
        api_key: str | None = None,
        model: str | None = None,
    ) -> None:
        import httpx

        try:
            import httpx_sse  # noqa: F401  (imported for the first request, here to fail early)
        except ModuleNotFoundError as exc:
            raise ServerBenchError(
                "pitstop bench --url reads the server's stream with httpx-sse, which is not "
                "installed: pip install httpx-sse (or 'pitstop[bench]')"
            ) from exc

        self.name = "http"
        self.info = info
        self.url = info.url
        self.workload = workload
        self.api_key = api_key
        self.model = model or info.model
        self.failed: dict[str, str] = {}  # request id -> why (written on the client's thread)
        self.chunks: dict[str, int] = {}  # request id -> streamed chunks with tokens
        self.asked: dict[str, int] = {}  # request id -> output tokens asked for
        self._done: queue.SimpleQueue[RequestRecord] = queue.SimpleQueue()
        self._in_flight = 0  # submitted, not yet handed back by poll (driver thread only)
        self._base: dict[str, float] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pitstop-bench-http", daemon=True
        )
        self._thread.start()
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=_headers(api_key),
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            # Poisson arrivals can have any number in flight: never queue them in the client.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    # ------------------------------------------------------------------ Backend
    def submit(self, request_id: str, request: BenchRequest, arrival: float) -> None:
        self._in_flight += 1
        self.asked[request_id] = request.output_len
        asyncio.run_coroutine_threadsafe(self._send(request_id, request, arrival), self._loop)

    def poll(self, timeout: float = 0.0) -> list[RequestRecord]:
        wait = timeout if timeout > 0 else (POLL_WAIT_S if self._in_flight else 0.0)
        done: list[RequestRecord] = []
        try:
            done.append(self._done.get(timeout=wait) if wait > 0 else self._done.get_nowait())
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self._in_flight -= len(done)
        return done

    def has_work(self) -> bool:
        return self._in_flight > 0

    def begin_run(self) -> None:
        self._base = scrape(self.url, self.api_key)

    def run_stats(self) -> dict[str, Any]:
        return metric_deltas(self._base, scrape(self.url, self.api_key))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    # ------------------------------------------------------------------ one request
    def body(self, request: BenchRequest) -> dict[str, Any]:
        """The ``/v1/completions`` body of one workload request."""
        wl = self.workload
        prompt: Any = (
            list(request.prompt_token_ids)
            if request.prompt_token_ids is not None
            else request.prompt
        )
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": request.output_len,
            "temperature": wl.temperature,
            "ignore_eos": True,  # every request produces exactly output_len tokens
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if wl.top_k > 0:
            body["top_k"] = wl.top_k
        return body

    async def _send(self, request_id: str, request: BenchRequest, arrival: float) -> None:
        from httpx_sse import EventSource

        times: list[float] = []
        finish: float | None = None
        usage: dict[str, Any] | None = None
        error: str | None = None
        try:
            async with self._client.stream(
                "POST", "/v1/completions", json=self.body(request)
            ) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {_error_message(resp, await resp.aread())}"
                else:
                    async for event in EventSource(resp).aiter_sse():
                        now = time.perf_counter()
                        if event.data == "[DONE]":
                            break
                        obj = json.loads(event.data)
                        if "error" in obj:
                            err = obj["error"]
                            error = "stream error: " + (
                                err.get("message", str(err)) if isinstance(err, dict) else str(err)
                            )
                            continue
                        choices = obj.get("choices") or []
                        if choices:
                            times.append(now)
                            reason = choices[0].get("finish_reason")
                            if reason is not None:
                                finish = now
                                if reason == "abort":
                                    error = "aborted by the server (finish_reason 'abort')"
                        if obj.get("usage"):
                            usage = obj["usage"]
        except Exception as exc:  # a transport error, a broken stream: this request failed
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        end = time.perf_counter()
        if error is None and not times:
            error = "the stream ended without any token"
        if error is not None:
            self.failed[request_id] = error
            rec = RequestRecord(request_id, request.input_len, 0, arrival, None, end, ())
        else:
            self.chunks[request_id] = len(times)
            rec = RequestRecord(
                request_id=request_id,
                input_len=int(usage["prompt_tokens"]) if usage else request.input_len,
                output_len=int(usage["completion_tokens"]) if usage else len(times),
                arrival=arrival,
                first_token=times[0],
                finish=finish if finish is not None else times[-1],
                token_times=times,
            )
        self._done.put(rec)


# ---------------------------------------------------------------------- one column
def measure_server(
    info: ServerInfo,
    workload: Workload,
    col: dict[str, Any],
    *,
    api_key: str | None,
    model: str | None,
    concurrency: int | None,
    request_rate: float | None,
    repeats: int,
    warmup: bool,
    skipped: list[str],
    floor: Any = None,
) -> list[str]:
    """Drive the server at ``info.url`` with the bench's clients (warm-up, then ``repeats``
    timed runs) and fill ``col`` with the figures (or ``error`` when every request failed);
    return the notes on how to read them. Used by ``--url`` and by ``--peer vllm`` online
    (``floor``: the workload's :class:`~pitstop.bench.floor.Floor`, when the device is known)."""
    from pitstop.bench.drivers import run_backend
    from pitstop.bench.options import fill_column

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    notes: list[str] = []
    backend = HttpBackend(info, workload, api_key=api_key, model=model)
    runs = run_backend(
        lambda: backend,
        workload,
        repeats=repeats,
        concurrency=concurrency,
        request_rate=request_rate,
        warmup=warmup,
    )
    errors: Counter[str] = Counter()
    sent = 0
    for run in runs:
        ids = [r.request_id for r in run.records]
        sent += len(ids)
        errors.update(backend.failed[i] for i in ids if i in backend.failed)
        run.records = [r for r in run.records if r.request_id not in backend.failed]
        run.failed = [backend.failed[i] for i in ids if i in backend.failed]
        run.per_request_counters = False  # cached-prompt and preemption counts come from /metrics
    if errors:
        col["errors"] = dict(errors.most_common())
        print(f"[bench] {sum(errors.values())} of {sent} requests failed:", file=sys.stderr)
        for msg, n in errors.most_common(5):
            print(f"[bench]   {n} x {msg}", file=sys.stderr)
    runs = [r for r in runs if r.records]
    if runs:
        fill_column(col, runs, floor, skipped)
        best = fastest(runs)
        tokens = sum(r.output_len for r in best.records)
        chunks = sum(backend.chunks.get(r.request_id, 0) for r in best.records)
        col["stream"] = {"chunks": chunks, "output_tokens": tokens}
        if chunks < tokens:
            notes.append(
                f"{col['name']}: {tokens} tokens arrived in {chunks} chunks: ITL is measured "
                "between chunks (a token with empty text, or a burst from one step, shares the "
                "next chunk); TPOT divides by the token count of usage"
            )
        short = [r for r in best.records if r.output_len != backend.asked[r.request_id]]
        if short:
            notes.append(
                f"{col['name']}: {len(short)} requests did not produce the tokens asked for: "
                "does the server honor ignore_eos?"
            )
    else:
        col["error"] = f"every request failed; first error: {next(iter(errors), 'none')}"
    if col.get("figures") and col["figures"]["kv_utilization"] is None:
        notes.append(
            f"{col['name']}: KV utilization n/a over HTTP (the server exposes no "
            "pitstop:kv_cache_utilization_sum)"
        )
    return notes


# ---------------------------------------------------------------------- orchestration
def run_http_bench(args: argparse.Namespace) -> dict[str, Any]:
    """``pitstop bench online --url``: the results document (the same shape as in-process)."""
    from pitstop.bench.options import (
        SCHEMA,
        BenchError,
        clients_from_args,
        workload_from_args,
    )
    from pitstop.bench.report import git_commit, now_iso
    from pitstop.bench.workloads import fit_to_model
    from pitstop.config import EngineConfig

    for flag, dest in (("--matrix", "matrix"), ("--peer", "peer")):
        if getattr(args, dest, None):
            raise BenchError(
                f"{flag} runs engines in this process; --url measures the one configuration "
                "the server runs (start one server per configuration instead)"
            )
    ignored = [
        "--" + k.replace("_", "-")
        for k in EngineConfig.field_names()
        if k not in ("model", "seed") and getattr(args, k, None) is not None
    ]
    ignored += ["--measure-ceilings"] if getattr(args, "measure_ceilings", False) else []
    ignored += ["--config"] if getattr(args, "config", None) else []
    if ignored:
        print(
            f"[bench] ignored with --url (the server's own flags decide): {', '.join(ignored)}",
            file=sys.stderr,
        )
    url = base_url(args.url)
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    wl = workload_from_args(args)  # a bad workload name is an error before the server is asked
    info = probe(url, api_key)
    max_len = info.max_model_len or 1 << 62
    wl, skipped = fit_to_model(wl, vocab_size=1 << 62, max_model_len=max_len)
    for msg in skipped[:5]:
        print(f"[bench] skipped {msg}", file=sys.stderr)
    if skipped:
        print(
            f"[bench] skipped {len(skipped)} of {len(skipped) + wl.num_requests} requests "
            f"longer than the server's max_model_len {info.max_model_len}",
            file=sys.stderr,
        )
    concurrency, rate = clients_from_args(args, wl)
    repeats = args.repeats or wl.repeats
    model = args.model or info.model
    col: dict[str, Any] = {"name": "server", "backend": "http", "url": url, "settings": {}}
    print(f"[bench] server at {url} serving {info.model}", file=sys.stderr)
    notes = measure_server(
        info,
        wl,
        col,
        api_key=api_key,
        model=model,
        concurrency=concurrency,
        request_rate=rate,
        repeats=repeats,
        warmup=not args.no_warmup,
        skipped=skipped,
    )
    return {
        "schema": SCHEMA,
        "date": now_iso(),
        "commit": git_commit(),
        "device": f"server {url}",
        "mode": args.bench_mode,
        "workload": {
            **wl.summary(),
            "skipped": len(skipped),
            "concurrency": concurrency,
            "request_rate": rate,
        },
        "model": {"name": info.model, "params": None, "shape": None},
        "server": {
            "url": url,
            "model": info.model,
            "root": info.root,
            "max_model_len": info.max_model_len,
        },
        "ceilings": None,
        "floor": None,
        "configs": [col],
        "peer": None,
        "notes": notes,
    }
