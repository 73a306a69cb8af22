"""GPU busy fraction in steady decode: kernel time (union of intervals) over wall time.

    python benchmarks/gpu_busy.py [--overlap on|off|both] [--steps 40] [--seqs 256]

Dummy qwen3-0.6b (the `nano` shape), fused kernels, bf16: ``--seqs`` requests
of nano's prompt lengths are prefilled, then ``--steps`` decode steps with
every sequence live are recorded with torch.profiler. The figure is the
union of the CUDA kernel intervals over the wall span of those steps (from
the first kernel to the last), with the mean wall time per step.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pitstop import LLM, SamplingParams


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


def measure(overlap: str, steps: int, seqs: int) -> dict[str, float]:
    """Run ``steps`` steady decode steps with ``seqs`` live sequences; return the figures."""
    llm = LLM("dummy:qwen3-0.6b", kernels="fused", max_model_len=4096, overlap=overlap)
    engine = llm.engine
    rng = random.Random(0)
    for i in range(seqs):
        ids = [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
        engine.add_request(
            params=SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.6),
            prompt_token_ids=ids,
            request_id=f"busy-{i}",
        )
    # prefill everything, then a few decode steps to settle
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [
        (e.time_range.start, e.time_range.end - e.time_range.start)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    busy, span = busy_fraction(kernels)
    running = engine.scheduler.num_running
    for rid in list(engine._requests):
        engine.abort(rid)
    return {
        "overlap": overlap,
        "live": running,
        "busy_fraction": busy / span if span else 0.0,
        "wall_ms_per_step": 1e3 * wall / steps,
        "kernel_ms_per_step": busy / 1e3 / steps,
    }


def main() -> None:
    """Print the busy fraction for the chosen loop(s)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlap", default="both", choices=("on", "off", "both"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seqs", type=int, default=256)
    args = parser.parse_args()
    if args.overlap == "both":  # each loop in a fresh process: the first engine's cache is gone
        for overlap in ("off", "on"):
            cmd = [sys.executable, __file__, "--overlap", overlap, "--steps", str(args.steps)]
            subprocess.run([*cmd, "--seqs", str(args.seqs)], check=True)
        return
    rows = [measure(args.overlap, args.steps, args.seqs)]
    print("| overlap | live seqs | GPU busy | wall ms/step | kernel ms/step |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['overlap']} | {r['live']} | {100 * r['busy_fraction']:.1f}% "
            f"| {r['wall_ms_per_step']:.2f} | {r['kernel_ms_per_step']:.2f} |"
        )


if __name__ == "__main__":
    main()
