"""Time the ``standard`` sampler on the device, with and without the logits processors.

One call of ``StandardSampler.sample`` on ``[rows, vocab]`` float32 logits,
averaged over ``--iters`` calls after a warm-up, CUDA-synchronized: plain
greedy and top-p sampling, then with presence/frequency/repetition
penalties over a ``--history``-token history per row, ``logit_bias``,
``min_tokens`` masks and ``logprobs=5``. Prints one Markdown row per case; the history rows are the steady state
(the runner's TokenHistories already holds the old tokens).
Usage: python3 benchmarks/sampler_bench.py [--rows 256] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import time

import torch

from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.plugin_system.sampler import RowInputs
from pitstop.plugins.samplers.batch import TokenHistories, make_sampling_batch, make_step_inputs
from pitstop.plugins.samplers.standard import StandardSampler


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    """Print the sampler's time per call for each case."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    device = torch.device("cuda")
    logits = torch.randn(args.rows, args.vocab, device=device)
    last = torch.zeros(args.rows, dtype=torch.int64, device=device)
    history = [list(range(i, i + args.history)) for i in range(args.rows)]
    cases = {
        "greedy": (SamplingParams(temperature=0), False),
        "top-p 0.9": (SamplingParams(temperature=0.8, top_p=0.9), False),
        "greedy + penalties": (
            SamplingParams(
                temperature=0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
            ),
            True,
        ),
        "top-p + penalties + bias + min_tokens + logprobs=5": (
            SamplingParams(
                temperature=0.8,
                top_p=0.9,
                presence_penalty=0.5,
                frequency_penalty=0.5,
                repetition_penalty=1.1,
                logit_bias={1: 2.0, 2: -2.0},
                min_tokens=1,
                logprobs=5,
            ),
            True,
        ),
    }
    sampler = StandardSampler(device, seed=0)
    histories = TokenHistories()  # as the runner keeps it: steady state copies no old token
    print(f"| case ({args.rows} rows, vocab {args.vocab}, history {args.history}) | ms per call |")
    print("|---|---|")
    for name, (params, per_step) in cases.items():
        batch = make_sampling_batch([params] * args.rows, [None] * args.rows, device)

        def step(batch=batch, params=params, per_step=per_step):
            b = batch
            if per_step:  # what the runner builds each step: histories and masks
                rows = [
                    RowInputs(
                        history=h if params.needs_penalties else None,
                        num_prompt_tokens=args.history // 2,
                        blocked_token_ids=(0,) if params.min_tokens else (),
                    )
                    for h in history
                ]
                b = make_step_inputs(
                    batch,
                    rows,
                    [0] * args.rows,
                    last,
                    args.vocab,
                    seq_ids=range(args.rows),
                    histories=histories,
                )
            return sampler.sample(logits, b)

        print(f"| {name} | {_time(step, args.iters):.3f} |")


if __name__ == "__main__":
    main()
