"""GPU busy fraction of engine steps: kernel time (union of intervals) over wall time.

    python benchmarks/gpu_busy.py [--shape nano|single|mixed|nano-prefill] [--overlap on|off|both]
                                  [--steps 40] [--top 8] [--lora-adapters N] [--option KEY=VALUE]

Shapes (dummy bf16 weights, fused kernels):

- ``nano``: qwen3-0.6b, 256 live sequences of nano's prompt lengths, steady
  decode (every sequence prefilled first), greedy as the bench's ``nano``
  (``--nano-temperature 0.6``: sampled, as this shape was before 2026-12-07's thirteenth
  session, whose profiles then held about 0.9 ms a step of sampler kernels);
- ``single``: llama3-8b, one sequence (128-token prompt, temperature 0.8,
  top-k 200), steady decode: the `single` workload's steps;
- ``mixed``: qwen3-8b, ``chunked`` with chunk_size 2048 and 32 sequences:
  31 decoding sequences and one 384-token prompt prefilled in each step (a
  new prompt joins as soon as the last one is prefilled): the small mixed
  steps that are most of `longtail`'s, which run without CUDA graphs;
- ``mixed-long``: the same with 4,096-token prompts, so each step carries a
  2,048-token chunk (compute-bound steps);
- ``nano-prefill``: qwen3-0.6b, `nano`'s 256 prompts (one output token each) from the first
  step to the last prompt's, after the same on other prompts (compiles and autotuning out):
  `nano`'s prompt phase, whose length over 8 LoRA adapters was twice the base model's on the
  H200 (2026-12-07). ``--steps`` does not apply.

``--lora-adapters N`` gives the requests N random rank-16 adapters in turn (the ``lora``
adapter plugin), ``--option KEY=VALUE`` a plugin setting (``lora.kernel=stacked``) or, for
a key without a dot, an engine setting (``piecewise_max_tokens=8192``).

Every run also prints the time the engine waited a step for the GPU (its event wait for the
step's tokens: near zero, the host's own work sets the pace, not the GPU) and Python's
garbage collections a step. ``--host-top N`` also runs Python's cProfile over the same
steps and prints the N host functions with the most time, cumulative and their own, and the
calls that wait for the GPU: where the host's time of a step goes when the GPU idles
(cProfile slows the host, so wall time then reads high).

``--steps`` steps are recorded with torch.profiler. The figure is the union
of the CUDA kernel intervals over the wall span of those steps, with the
mean wall and kernel time per step, then the ``--top`` kernels by time. Each
loop runs in a fresh process (one engine's KV cache takes most of the GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pitstop import LLM, SamplingParams
from pitstop.entrypoints.engine_args import parse_option
from pitstop.errors import ConfigError

SHAPES: dict[str, dict[str, Any]] = {
    "nano": dict(model="dummy:qwen3-0.6b", max_model_len=4096),
    "single": dict(model="dummy:llama3-8b", max_model_len=4096),
    "mixed": dict(
        model="dummy:qwen3-8b",
        max_model_len=8192,
        scheduler="chunked",
        chunk_size=2048,
        max_batch_size=32,
        max_prefill_batch=32,
    ),
}


SHAPES["mixed-long"] = SHAPES["mixed"]  # the same engine; only the prompts are longer
SHAPES["nano-prefill"] = SHAPES["nano"]  # nano's engine; only the prompt phase is profiled
PREFILL_PROMPTS = 256  # nano's requests


def busy_fraction(events: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, span) in microseconds from ``(start, duration)`` kernel intervals."""
    events.sort()
    busy = 0.0
    end = -1.0
    first = events[0][0]
    last = max(s + d for s, d in events)
    for start, dur in events:
        stop = start + dur
        if start >= end:
            busy += dur
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, last - first


def idle_gaps(events: list[tuple[float, float, str]], steps: int, top: int) -> list[str]:
    """The device's idle time between kernels, by the pair of kernels around each gap.

    ``events``: ``(start, duration, name)`` in microseconds. A gap is time after every
    kernel so far has ended and before the next starts; gaps are summed per (kernel before,
    kernel after) and the ``top`` pairs printed as table rows, µs a step and gaps a step,
    with the gaps of 1 µs or less (the device's own launch spacing) in one row of their own.
    """
    events = sorted(events)
    by_pair: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    small = [0.0, 0]
    end, before = events[0][0] + events[0][1], events[0][2]
    for start, dur, name in events[1:]:
        if start > end:
            gap = start - end
            slot = small if gap <= 1.0 else by_pair[(before[:40], name[:40])]
            slot[0] += gap
            slot[1] += 1
        if start + dur >= end:
            end, before = start + dur, name
    total = small[0] + sum(v[0] for v in by_pair.values())
    rows = [
        f"|   | idle between kernels | {total / steps:.1f} us/step | gaps of 1 us or less: "
        f"{small[0] / steps:.1f} us/step, {small[1] / steps:.1f} a step |"
    ]
    for (a, b), (us, n) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]:
        rows.append(
            f"|   | idle {us / steps:.1f} us/step | {n / steps:.2f} a step | `{a}` -> `{b}` |"
        )
    return rows


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, 10000) for _ in range(n)]


def measure(
    shape: str,
    overlap: str,
    steps: int,
    top: int,
    adapters: int = 0,
    options: tuple = (),
    host_top: int = 0,
    nano_temperature: float = 0.0,
) -> None:
    """Settle ``shape`` into steady state, profile ``steps`` steps, print the figures
    (``nano_temperature``: the ``nano`` shape's sampling temperature; 0: greedy)."""
    kwargs: dict[str, Any] = dict(SHAPES[shape])
    pairs = [parse_option(o) for o in options]
    # a dotted key is a plugin's option, another an engine setting (piecewise_max_tokens=8192)
    kwargs.update((k, v) for k, v in pairs if "." not in k)
    if options or adapters:
        kwargs["options"] = {k: v for k, v in pairs if "." in k}
    if adapters:
        kwargs["adapter"] = "lora"
        kwargs["options"].setdefault("max_loras", adapters)
    llm = LLM(kernels="fused", overlap=overlap, **kwargs)
    engine = llm.engine
    rng = random.Random(0)
    n_long = 0
    loras: list[Any] = []
    if adapters:
        import tempfile
        from pathlib import Path

        from pitstop.bench.lora_adapters import lora_requests, write_random_adapters

        folder = Path(tempfile.mkdtemp(prefix="gpu-busy-lora-"))
        loras = lora_requests(write_random_adapters(engine.model_config, adapters, 16, folder))
    added = [0]

    def add(ids: list[int], params: SamplingParams, rid: str) -> None:
        lora = loras[added[0] % len(loras)] if loras else None
        added[0] += 1
        engine.add_request(params=params, prompt_token_ids=ids, request_id=rid, lora_request=lora)

    if shape == "nano-prefill":
        one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        for rnd in ("warm", "timed"):
            added[0] = 0
            for i in range(PREFILL_PROMPTS):
                add(_ids(rng, rng.randint(100, 1024)), one, f"{rnd}{i}")
            if rnd == "warm":
                while engine.has_unfinished_requests():
                    engine.step()
                torch.cuda.synchronize()
        _profile(
            engine, shape, overlap, top, engine.has_unfinished_requests, lambda: None, host_top
        )
        return
    if shape == "nano":
        for i in range(256):
            add(
                _ids(rng, rng.randint(100, 1024)),
                SamplingParams(max_tokens=2000, ignore_eos=True, temperature=nano_temperature),
                f"d{i}",
            )
    elif shape == "single":
        add(
            _ids(rng, 128),
            SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.8, top_k=200),
            "s0",
        )
    else:
        for i in range(31):
            add(_ids(rng, 256), SamplingParams(max_tokens=4000, ignore_eos=True), f"d{i}")

    def feed() -> None:  # mixed: keep one long prompt prefilling beside the decodes
        nonlocal n_long
        if (
            shape.startswith("mixed")
            and not engine.scheduler.waiting
            and not any(
                s.is_prefill for s in engine.scheduler.running if s.request_id.startswith("long")
            )
        ):
            for s in list(engine.scheduler.running):
                if s.request_id.startswith("long"):
                    engine.abort(s.request_id)
            length = 4096 if shape == "mixed-long" else 384
            add(_ids(rng, length), SamplingParams(max_tokens=1, ignore_eos=True), f"long{n_long}")
            n_long += 1

    while engine.scheduler.waiting or any(
        s.is_prefill for s in engine.scheduler.running if not s.request_id.startswith("long")
    ):
        feed()
        engine.step()
    for _ in range(10):
        feed()
        engine.step()
    torch.cuda.synchronize()
    left = [steps]

    def more() -> bool:
        left[0] -= 1
        return left[0] >= 0

    _profile(engine, shape, overlap, top, more, feed, host_top)
    for rid in list(engine._requests):
        engine.abort(rid)


def _profile(
    engine: Any, shape: str, overlap: str, top: int, more: Any, feed: Any, host_top: int = 0
) -> None:
    """Profile steps while ``more()``, ``feed()`` before each, and print the figures
    (``host_top``: cProfile's too, see :func:`_host_report`)."""
    synchronized = _synchronizing_calls(engine, more, feed)  # before: the steps run out
    steps = 0
    host = cProfile.Profile() if host_top else None
    collections = _Collections()
    waited = [0.0]  # seconds the engine spent in a step's event wait (the host ahead of the GPU)
    synchronize = torch.cuda.Event.synchronize

    def timed_synchronize(event: torch.cuda.Event) -> None:
        began = time.perf_counter()
        synchronize(event)
        waited[0] += time.perf_counter() - began

    # CUDA activity only: recording every host-side op would slow the host it measures
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.Event.synchronize = timed_synchronize  # type: ignore[method-assign]
        gc.callbacks.append(collections.record)
        start = time.perf_counter()
        if host is not None:
            host.enable()
        try:
            while more():
                feed()
                engine.step(stream=False)  # as the bench steps: outputs of finished requests only
                steps += 1
            torch.cuda.synchronize()
        finally:
            if host is not None:
                host.disable()
            gc.callbacks.remove(collections.record)
            torch.cuda.Event.synchronize = synchronize  # type: ignore[method-assign]
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end - e.time_range.start) for e in kernels]
    busy, span = busy_fraction(intervals)
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_name[e.name] += e.time_range.end - e.time_range.start
    total = sum(by_name.values())
    print(
        f"| {shape} | {overlap} | {engine.scheduler.num_running} | {100 * busy / span:.1f}% "
        f"| {1e3 * wall / steps:.2f} | {busy / 1e3 / steps:.2f} |"
    )
    print(f"|   | {steps} steps | wall {1e3 * wall:.1f} ms | kernels {busy / 1e3:.1f} ms |")
    # near zero: the host never waits for the GPU, so the host's own work sets the pace
    print(
        f"|   | host waits for the GPU | {1e3 * waited[0] / steps:.2f} ms/step "
        f"({100 * waited[0] / wall:.0f}% of wall) | {collections.summary(steps)} |"
    )
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"|   | {100 * us / total:.1f}% | {us / 1e3 / steps:.3f} ms/step | `{name[:90]}` |")
    named = [(e.time_range.start, e.time_range.end - e.time_range.start, e.name) for e in kernels]
    print("\n".join(idle_gaps(named, steps, top)))
    if host is not None:
        _host_report(host, steps, host_top)
    print("\n".join(synchronized))


def _synchronizing_calls(engine: Any, more: Any, feed: Any, steps: int = 5) -> list[str]:
    """Up to ``steps`` steps under torch's sync debug mode (before the profiled ones): each call that made the host
    wait for the device (a blocking copy, ``.item()``, a stream synchronize) where it was
    made, with its count a step, as table rows. The event wait for the step's tokens is
    the loop's one intended wait and does not show here (it is an event's, not a stream's)."""
    found: dict[str, int] = defaultdict(int)
    done = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while done < steps and more():
                feed()
                engine.step(stream=False)
                done += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchronizing" in str(w.message):  # not the mode's own "prototype" notice
            where = f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}"
            found[f"{where} {str(w.message).splitlines()[0][:60]}"] += 1
    rows = [
        f"|   | synchronizing calls | {sum(found.values()) / max(done, 1):.1f} a step over {done} steps |"
    ]
    for where, n in sorted(found.items(), key=lambda kv: -kv[1])[:8]:
        rows.append(f"|   | sync {n / max(done, 1):.1f} a step | `{where}` |")
    return rows


# host calls that wait for the GPU (their time is the GPU's, not the host's own work): cProfile
# names builtin methods "<method 'NAME' of ...>"
WAITS = ("'synchronize'", "'tolist'", "'item'", "'cpu'", "'wait_event'", "'query'")


class _Collections:
    """Python's garbage collections during the profiled steps (``gc.callbacks``): their count
    and time per generation; cProfile charges a collection to whatever call triggered it."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]

    def record(self, phase: str, info: dict) -> None:
        """The ``gc.callbacks`` hook."""
        if phase == "start":
            self.started = time.perf_counter()
            return
        generation = info["generation"]
        self.seconds[generation] += time.perf_counter() - self.started
        self.count[generation] += 1

    def summary(self, steps: int) -> str:
        """Per step: each generation's collections and milliseconds."""
        return ", ".join(
            f"gen {g}: {self.count[g] / steps:.2f} a step, {1e3 * self.seconds[g] / steps:.3f} ms"
            for g in range(3)
        )


def _host_report(host: cProfile.Profile, steps: int, top: int) -> None:
    """Print the ``top`` host functions by own time a step, then the calls that wait for the GPU."""
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in pstats.Stats(host).stats.items():  # type: ignore[attr-defined]
        where = name if file == "~" else f"{file.rsplit('/', 2)[-1]}:{line}({name})"
        rows.append((own, cumulative, calls, where))
    total = sum(r[0] for r in rows)
    waits = [r for r in rows if any(w in r[3] for w in WAITS)]
    waited = sum(r[0] for r in waits)
    print(
        f"|   | host (cProfile) | {1e3 * total / steps:.2f} ms/step in all, "
        f"{1e3 * waited / steps:.2f} of it waiting for the GPU |"
    )
    for cumulative, own, calls, where in sorted(
        ((r[1], r[0], r[2], r[3]) for r in rows), reverse=True
    )[:top]:
        print(
            f"|   | host cumulative | {1e3 * cumulative / steps:.3f} ms/step, "
            f"{1e3 * own / steps:.3f} own | {calls / steps:.0f} calls/step | `{where[:90]}` |"
        )
    for own, cumulative, calls, where in sorted(rows, reverse=True)[:top]:
        print(
            f"|   | host | {1e3 * own / steps:.3f} ms/step own, {1e3 * cumulative / steps:.3f} "
            f"cumulative | {calls / steps:.0f} calls/step | `{where[:90]}` |"
        )
    for own, _, calls, where in sorted(waits, reverse=True)[:4]:
        print(
            f"|   | host wait | {1e3 * own / steps:.3f} ms/step | {calls / steps:.0f} calls/step "
            f"| `{where[:90]}` |"
        )


def main() -> None:
    """Print the busy fraction for the chosen shape and loop(s)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--shape", default="nano", choices=sorted(SHAPES))
    parser.add_argument("--overlap", default="both", choices=("on", "off", "both"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--lora-adapters", type=int, default=0, metavar="N")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--host-top", type=int, default=0, metavar="N")
    parser.add_argument(
        "--nano-temperature", type=float, default=0.0,
        help="the nano shape's sampling temperature: 0 (greedy, as the bench's nano) or e.g. "
        "0.6 (nano-vllm's, and this script's before 2026-12-07's thirteenth session)",
    )  # fmt: skip
    args = parser.parse_args()
    for option in args.option:  # a malformed one before any engine starts
        try:
            parse_option(option)
        except ConfigError as exc:
            parser.error(str(exc))
    extra = [f"--lora-adapters={args.lora_adapters}", f"--host-top={args.host_top}"]
    extra.append(f"--nano-temperature={args.nano_temperature}")
    extra += [f"--option={o}" for o in args.option]
    if args.overlap == "both":  # each loop in a fresh process: the first engine's cache is gone
        print("| shape | overlap | live seqs | GPU busy | wall ms/step | kernel ms/step |")
        print("|---|---|---|---|---|---|")
        for overlap in ("off", "on"):
            cmd = [sys.executable, __file__, "--shape", args.shape, "--overlap", overlap]
            subprocess.run(
                [*cmd, "--steps", str(args.steps), "--top", str(args.top), *extra], check=True
            )
        return
    measure(
        args.shape,
        args.overlap,
        args.steps,
        args.top,
        args.lora_adapters,
        tuple(args.option),
        args.host_top,
        args.nano_temperature,
    )


if __name__ == "__main__":
    main()
