"""The engine's host time a step, without a device: scheduling, inputs, results, outputs.

    python benchmarks/host_turn.py [--seqs 256] [--steps 200] [--repeats 3] [--profile N]
                                   [--stream]

A decode step of many sequences costs the host the same work on any device: the scheduler
plans it, the engine builds each sequence's input, and applies each sampled token (stop
checks, detokenizing, outputs). This runs that loop over a tiny random Qwen3 (CPU) whose
runner is replaced by one that returns a token per sampling sequence at once, so the time
measured is the engine's alone (not the runner's staging, replay or sampler), in ms a step,
median of ``--repeats`` (range), with ``--seqs`` sequences decoding. ``--stream`` steps as
a server does (an output for every request each step, its new text decoded), else as
``LLM.generate`` does (outputs at the end only). ``--profile N`` prints cProfile's N
functions with the most cumulative time. Timings are this machine's: compare
them only within one run (the CPU may be shared).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pitstop import LLM, SamplingParams
from pitstop.ground.step import NO_TOKENS, SeqResult, StepInput, StepOutput
from pitstop.runner.launched import LaunchedStep


def tiny_model(folder: Path) -> Path:
    """A tiny random Qwen3 checkpoint with SmolLM2's tokenizer (tests' helper)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.models import make_tiny_checkpoint

    return make_tiny_checkpoint(folder, "qwen3")


def instant_launch(rng: random.Random):
    """A runner's ``launch`` that samples at once: a random token per sampling sequence."""

    def launch(step: StepInput) -> LaunchedStep:
        results = [SeqResult([rng.randint(3, 40000)]) if s.sample else NO_TOKENS for s in step.seqs]
        return LaunchedStep(step.seqs, ready=StepOutput(results))

    return launch


def engine_for(path: Path, seqs: int, steps: int) -> Any:
    """An engine with ``seqs`` sequences decoding (prompts computed by the real model first),
    each with room for ``steps`` more tokens, its runner's launch then replaced."""
    llm = LLM(
        str(path), device="cpu", dtype="float32", kv_cache_gib=1.0, max_model_len=64 + steps + 16,
        max_batch_size=seqs, allow_long_max_model_len=True,
    )  # fmt: skip
    engine = llm.engine
    rng = random.Random(0)
    for i in range(seqs):
        ids = [rng.randint(3, 40000) for _ in range(rng.randint(16, 64))]
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0)
        engine.add_request(params=params, prompt_token_ids=ids, request_id=f"r{i}")
    engine.runner.launch = instant_launch(rng)
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step(stream=False)
    for _ in range(3):
        engine.step(stream=False)
    assert engine.scheduler.num_running == seqs, "every sequence decoding"
    return engine


def main() -> None:
    """Print the engine's host ms a step (median, range) and, with ``--profile``, where it goes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--stream", action="store_true", help="step as a server does")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="host-turn-") as folder:
        engine = engine_for(tiny_model(Path(folder)), args.seqs, args.steps * (args.repeats + 1))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step(stream=args.stream)
            times.append(1e3 * (time.perf_counter() - start) / args.steps)
        print(
            f"host turn, {args.seqs} decoding sequences{', streamed' if args.stream else ''}: "
            f"{statistics.median(times):.3f} ms a step "
            f"(median of {args.repeats} x {args.steps} steps; {min(times):.3f}–{max(times):.3f})"
        )
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                engine.step(stream=args.stream)
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(args.profile)
            print(out.getvalue())


if __name__ == "__main__":
    main()
