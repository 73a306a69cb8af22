"""Which Triton kernels compile during the first steps of a run (after start-up), and how long
those steps take: a start-up warm-up should leave nothing to compile on the user's time.

    python3 benchmarks/first_steps.py --scheduler chunked [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from pitstop import LLM, SamplingParams


def _record_compiles() -> list[str] | None:
    """From now on, append the name of each Triton kernel compiled to the returned list.

    The hook is Triton's ``JITFunction._do_compile`` (Triton 3.x), which runs only on a
    cache miss; None (nothing recorded) where this Triton has no such method.
    """
    from triton.runtime.jit import JITFunction

    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        return None
    compiled: list[str] = []

    def recording(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    JITFunction._do_compile = recording
    return compiled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--model", default="dummy:qwen3-0.6b")
    ap.add_argument("--scheduler", default="chunked")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="cProfile the steps; print the top 25")
    args = ap.parse_args()
    llm = LLM(args.model, kernels="fused", scheduler=args.scheduler, max_model_len=4096)
    engine = llm.engine
    rng = random.Random(0)
    for _ in range(args.requests):
        n = rng.randint(100, 1024)
        engine.add_request(
            None,
            SamplingParams(max_tokens=rng.randint(100, 1024), ignore_eos=True),
            prompt_token_ids=[rng.randint(10, 30000) for _ in range(n)],
        )
    compiled = _record_compiles()
    if compiled is None:
        print("this Triton has no JITFunction._do_compile: compiles are not reported")
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    for i in range(args.steps):
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        new = ", ".join(compiled) if compiled else "-"
        if compiled:
            compiled.clear()
        print(f"step {i}: {took * 1e3:8.1f} ms, compiled: {new}")
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
