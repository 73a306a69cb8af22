"""Which Triton kernels compile during the first steps of a run (after start-up), and how long
those steps take: a start-up warm-up should leave nothing to compile on the user's time.

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/first_steps.py --scheduler chunked
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import time
from pathlib import Path

from pitstop import LLM, SamplingParams


def _cache_entries(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*.json") if not p.name.startswith("__grp__")}


def _log_compiles() -> None:
    """Print each Triton kernel compiled from now on, with the call's argument signature."""
    from triton.runtime.jit import JITFunction

    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        return

    def logged(self, *args, **kwargs):
        print(f"  compiling {self.fn.__name__}: {str(args)[:300]}")
        return original(self, *args, **kwargs)

    JITFunction._do_compile = logged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="dummy:qwen3-0.6b")
    ap.add_argument("--scheduler", default="chunked")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="cProfile the steps; print the top 25")
    args = ap.parse_args()
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
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
    _log_compiles()
    seen = _cache_entries(cache)
    print(f"after start-up: {len(seen)} compiled kernels in {cache}")
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    for i in range(args.steps):
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        now = _cache_entries(cache)
        new = sorted(now - seen)
        seen = now
        print(
            f"step {i}: {took * 1e3:8.1f} ms, newly compiled: {', '.join(n.split('.')[0] for n in new) or '-'}"
        )
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
