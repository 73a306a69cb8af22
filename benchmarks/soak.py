"""Soak a ``pitstop serve`` on CPU over loopback: many short requests, then check for leaks.

Starts the server as a subprocess on 127.0.0.1, sends ``--sequential``
requests one after another on one keep-alive connection, then
``--concurrent`` requests with ``--concurrency`` in flight at once (half of
each streamed, half not), every one a short greedy completion with
``ignore_eos`` so that it produces exactly ``--max-tokens`` tokens. At the
end it checks that the server holds no open request, that every KV page is
free again, and how much the server's resident memory (RSS) grew after a
warm-up. The whole run is bounded by ``--time-limit``::

    OMP_NUM_THREADS=2 python benchmarks/soak.py smollm2-135m          # 5,000 + 1,000
    python benchmarks/soak.py /path/to/hf-folder --sequential 200 --concurrent 100

Prints one JSON object (the figures) and exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx

from pitstop.bench.local_server import (
    ServerExited,
    ServerStartTimeout,
    free_port,
    stop,
    wait_healthy,
)


def rss_mib(pid: int) -> float:
    """The resident set size of process ``pid`` in MiB (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _body(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": [(i * 13 + k) % 1000 + 10 for k in range(8 + i % 8)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": i % 2 == 1,
        **({"stream_options": {"include_usage": True}} if i % 2 else {}),
    }


def _tokens_of(response: httpx.Response, streamed: bool) -> int:
    """completion_tokens of an answer (the usage chunk of a stream)."""
    if not streamed:
        return int(response.json()["usage"]["completion_tokens"])
    usage = None
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
    assert response.text.rstrip().endswith("data: [DONE]"), response.text[-200:]
    return int(usage["completion_tokens"]) if usage else -1


def _check(r: httpx.Response, body: dict[str, Any], errors: list[str]) -> None:
    if r.status_code != 200:
        errors.append(f"{r.status_code}: {r.text[:200]}")
        return
    got = _tokens_of(r, body["stream"])
    if got != body["max_tokens"]:
        errors.append(f"{got} tokens instead of {body['max_tokens']}")


def sequential(url: str, model: str, count: int, max_tokens: int, deadline: float) -> list[str]:
    """``count`` requests one after another; the errors met."""
    errors: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(count):
            if time.monotonic() > deadline:
                errors.append(f"time limit reached after {i} sequential requests")
                break
            body = _body(model, i, max_tokens)
            _check(c.post("/v1/completions", json=body), body, errors)
    return errors


def concurrent(
    url: str, model: str, count: int, concurrency: int, max_tokens: int, deadline: float
) -> list[str]:
    """``count`` requests, ``concurrency`` at a time; the errors met."""
    errors: list[str] = []

    async def main() -> None:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:

            async def one(i: int) -> None:
                async with gate:
                    if time.monotonic() > deadline:
                        errors.append("time limit reached")
                        return
                    body = _body(model, i, max_tokens)
                    _check(await c.post("/v1/completions", json=body), body, errors)

            await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(main())
    return errors


def wait_idle(url: str, within: float) -> dict[str, Any]:
    """``/health`` once no request is open and every page is free (or after ``within`` s)."""
    end = time.monotonic() + within
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        idle = health["num_open_requests"] == 0 and health["pages_free"] == health["num_pages"]
        if idle or time.monotonic() > end:
            return health
        time.sleep(0.05)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak (see the module docstring); the figures, with ``ok`` and ``errors``."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pitstop.entrypoints.cli",
        "serve",
        args.model,
        "--port",
        str(port),
    ]
    cmd += ["--device", "cpu", "--dtype", "float32", "--max-model-len", str(args.max_model_len)]
    cmd += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-connections", "4096", *args.serve_arg]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    deadline = start + args.time_limit
    try:
        try:
            wait_healthy(url, proc, timeout_s=args.time_limit)
        except ServerExited as exc:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"the server exited with {exc.returncode}:\n{out}") from None
        except ServerStartTimeout:
            raise RuntimeError("the server did not start within the time limit") from None
        warm = sequential(url, args.model, args.warmup, args.max_tokens, deadline)
        warm += concurrent(
            url, args.model, args.warmup, args.concurrency, args.max_tokens, deadline
        )
        wait_idle(url, 5.0)
        rss_start = rss_mib(proc.pid)
        t0 = time.monotonic()
        errors = sequential(url, args.model, args.sequential, args.max_tokens, deadline)
        t1 = time.monotonic()
        errors += concurrent(
            url, args.model, args.concurrent, args.concurrency, args.max_tokens, deadline
        )
        t2 = time.monotonic()
        health = wait_idle(url, 5.0)
        rss_end = rss_mib(proc.pid)
    finally:
        stop(proc, grace_s=15)
    growth = rss_end - rss_start
    checks = {
        "no_errors": not (warm or errors),
        "pages_all_free": health["pages_free"] == health["num_pages"],
        "no_open_requests": health["num_open_requests"] == 0,
        "rss_growth_within_limit": growth <= args.max_rss_growth_mib,
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "errors": (warm + errors)[:10],
        "num_errors": len(warm + errors),
        "sequential": {"requests": args.sequential, "seconds": round(t1 - t0, 2)},
        "concurrent": {
            "requests": args.concurrent,
            "concurrency": args.concurrency,
            "seconds": round(t2 - t1, 2),
        },
        "rss_mib": {"after_warmup": round(rss_start, 1), "end": round(rss_end, 1)},
        "rss_growth_mib": round(growth, 1),
        "pages": {"free": health["pages_free"], "total": health["num_pages"]},
        "threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "exit_code": proc.returncode,
        "total_seconds": round(time.monotonic() - start, 2),
    }


def parser() -> argparse.ArgumentParser:
    """The soak's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("model", help="what `pitstop serve` loads (e.g. smollm2-135m or a folder)")
    p.add_argument("--sequential", type=int, default=5000, help="requests one at a time")
    p.add_argument("--concurrent", type=int, default=1000, help="requests in the concurrent part")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--warmup", type=int, default=50, help="requests before RSS is first read")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per request")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=float, default=0.1)
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument(
        "--max-rss-growth-mib", type=float, default=64.0, help="RSS growth allowed after warm-up"
    )
    p.add_argument(
        "--serve-arg", action="append", default=[], help="one more `pitstop serve` argument"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print its figures as JSON; 1 when a check failed."""
    report = soak(parser().parse_args(argv))
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
