"""The rollout engine's figures (issue 49) on one GPU: in-place weight updates, sleep and wake.

    python3 benchmarks/rl_bench.py --out rl_h200.json                  # dummy:qwen3-8b, bf16
    python3 benchmarks/rl_bench.py --model PATH --device cpu --dtype float32 --out x.json

Measures, each the median of ``--repeats`` (the first run reported on its own too):

- ``update_weights`` of every tensor of the model from tensors already on the device, in
  this process (target <= 0.5 s for qwen3-8b on the H200);
- ``sleep(level=1)`` and ``wake_up()`` (target <= 2 s each) and the fraction of the
  engine's device memory freed (``torch.cuda.mem_get_info``; target >= 95%);
- ``sleep(level=2)``: the fraction freed, and ``wake_up()`` + a full update after it;
- whether greedy output is the same before and after the cycles.

Writes one JSON object to ``--out``. On CPU the memory figures are RSS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="dummy:qwen3-8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.7,
        help="the engine's share; the rest holds the update's source tensors",
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="fixed KV size (CPU runs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True, help="JSON file to write")
    return ap.parse_args(argv)


def _free_bytes(device_type: str) -> int:
    """Free device memory (CUDA), or minus this process's RSS (CPU): higher is freer."""
    import torch

    if device_type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return -int(line.split()[1]) * 1024
    return 0


def _timed(fn) -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _stats(times: list[float]) -> dict[str, float]:
    return {"first_s": times[0], "median_s": statistics.median(times), "all_s": times}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pitstop import LLM, SamplingParams
    from pitstop.runner.memory_plan import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
    free_start = _free_bytes(device.type)
    settings: dict[str, Any] = dict(
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enable_sleep_mode=True,
    )
    if args.kv_cache_gib is not None:
        settings["kv_cache_gib"] = args.kv_cache_gib
    elif device.type == "cuda":
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    llm = LLM(args.model, **settings)
    engine_bytes = free_start - _free_bytes(device.type)
    prompts = [{"prompt_token_ids": [11, 22, 33, 44, 55, 66, 77, 88]}]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def tokens() -> list[int]:
        return list(llm.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids)

    before = tokens()
    # every tensor, in Hugging Face names, already on the device: the current values
    weights = llm.rollout.weight_map()
    source = []
    for name in weights.names:
        place = weights.placement(name)
        rows = weights.shapes[name][0] if weights.shapes[name] else 0
        data = place.param.data
        part = data if place.offset is None else data[place.offset : place.offset + rows]
        source.append((name, part.clone()))
    update_bytes = sum(t.numel() * t.element_size() for _, t in source)
    update = [_timed(lambda: llm.update_weights(source)) for _ in range(args.repeats)]
    source.clear()  # frees the copies (the lambda above holds the list)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    awake_free = _free_bytes(device.type)
    sleep1, wake1, freed1 = [], [], []
    for _ in range(args.repeats):
        sleep1.append(_timed(lambda: llm.sleep(level=1)))
        freed1.append(_free_bytes(device.type) - awake_free)
        wake1.append(_timed(llm.wake_up))
    after_level1 = tokens()
    level2 = _timed(lambda: llm.sleep(level=2))
    freed2 = _free_bytes(device.type) - awake_free
    wake2 = _timed(llm.wake_up)
    return {
        "model": args.model,
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "dtype": args.dtype,
        "memory_backend": llm.rollout.sleep_state.memory.name,
        "engine_bytes": engine_bytes,
        "tensors": len(weights.names),
        "update_bytes": update_bytes,
        "update_weights": {
            **_stats(update),
            "GB_per_s": update_bytes / statistics.median(update) / 1e9,
        },
        "sleep_level1": _stats(sleep1),
        "wake_up_level1": _stats(wake1),
        "freed_fraction_level1": statistics.median(freed1) / engine_bytes if engine_bytes else None,
        "sleep_level2_s": level2,
        "wake_up_level2_s": wake2,
        "freed_fraction_level2": freed2 / engine_bytes if engine_bytes else None,
        "outputs_identical_after_level1": before == after_level1,
        "note": "after level 2 the weights are undefined until updated; not generated from",
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
