"""Profile the host side of a `nano`-like offline run (dummy qwen3-0.6b, fused kernels) on a GPU.

    python benchmarks/profile_nano.py

Prints the wall time, the engine's step count and the 18 functions with the
most own time: where the Python side of a step goes.
"""

import cProfile
import pstats
import random
import time

import torch

from pitstop import LLM, SamplingParams


def main() -> None:
    """Warm up on 8 requests, then profile 256 of nano's draw."""
    llm = LLM("dummy:qwen3-0.6b", kernels="fused", max_model_len=4096)
    random.seed(0)
    reqs = [
        [random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)
    ]
    params = [
        SamplingParams(max_tokens=random.randint(100, 1024), ignore_eos=True, temperature=0.6)
        for _ in range(256)
    ]
    llm.generate(prompt_token_ids=reqs[:8], sampling_params=params[:8], use_tqdm=False)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompt_token_ids=reqs, sampling_params=params, use_tqdm=False)
    torch.cuda.synchronize()
    profiler.disable()
    print("wall", time.perf_counter() - start, "steps", llm.engine.stats.steps)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
