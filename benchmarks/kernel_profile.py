"""Kernel-by-kernel time of one step, pitstop beside vLLM, on the same requests (issue 29).

    python benchmarks/kernel_profile.py --scenario nano-decode [--model dummy:qwen3-0.6b]
        [--peer vllm] [--json OUT.json] [--trace-dir DIR] [--kernels fused] [--device cuda]
        [--kv-cache-dtype fp8_e4m3] [--lora-adapters N] [--warm-prompts]

Scenarios (pitstop.bench.kernel_profile.SCENARIOS): nano-decode (256 x 512 tokens, a
decode step), single-decode (1 x 512, dummy:llama3-8b for the `single` workload),
prefill-2048 (per 2,048-token prompt). Prints the table by category (time per step in
each engine, what the category moves, the fraction of the H200 ceiling), then each
engine's top kernels. vLLM is found as `pitstop bench --peer vllm` finds it
(PITSTOP_VLLM_PYTHON, PITSTOP_VLLM_PYTHONPATH).

A decode scenario's step is the difference of a long and a short run over N. With chunked
prefill the long run's prefill shares its steps with the decode rows of prompts already
prefilled, so the two runs do not prefill alike and the difference can hold prefill work
(on `dummy:qwen3-30b-a3b` at 256 rows it held 153 grouped-GEMM launches a step, where a
decode step makes 96). `--warm-prompts` (pitstop alone) caches the prompts first, so that
both runs prefill only each prompt's last tokens and the difference is the decode steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from pitstop.bench.kernel_profile import (
    SCENARIOS,
    category_table,
    markdown,
    profile_pitstop,
    profile_vllm,
    top_kernels,
)


def main(argv: list[str] | None = None) -> int:
    """Profile pitstop (and vLLM with ``--peer vllm``); print the tables; 3 if the peer failed."""
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="nano-decode")
    parser.add_argument("--model", default="dummy:qwen3-0.6b")
    parser.add_argument("--peer", choices=["vllm"], default=None)
    parser.add_argument("--kernels", default="fused")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", type=int, default=None, help="override the scenario's batch")
    parser.add_argument("--prompt-len", type=int, default=None, help="override its prompt length")
    parser.add_argument("--decode-steps", type=int, default=None, help="override its N")
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="both engines' KV cache (auto, bfloat16, fp8_e4m3, ...; vLLM gets the fp8 ones)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pitstop plugin setting (e.g. fused.layer=true); repeat for more",
    )
    parser.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        metavar="N",
        help="pitstop's requests take N random rank-16 LoRA adapters in turn (no peer then)",
    )
    parser.add_argument(
        "--warm-prompts",
        action="store_true",
        help="pitstop's prompts cached before the profile (the prefix allocator), so that the "
        "two runs' difference is the decode steps alone, without prefill chunks (no peer then)",
    )
    parser.add_argument("--trace-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    scenario = SCENARIOS[args.scenario]
    changes = {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes:
        import attrs

        scenario = attrs.evolve(scenario, **changes)
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="kernel-profile-"))
    engine_kwargs = {"kernels": args.kernels}
    if args.device:
        engine_kwargs["device"] = args.device
    if args.option:
        engine_kwargs["options"] = dict(_option(text) for text in args.option)
    peer_extra = {}
    if args.kv_cache_dtype:
        from pitstop.bench.vllm_peer import kv_cache_dtype as vllm_kv_cache_dtype

        engine_kwargs["kv_cache_dtype"] = args.kv_cache_dtype
        peer_extra["kv_cache_dtype"] = vllm_kv_cache_dtype(args.kv_cache_dtype)  # fp8 or auto
    if args.lora_adapters and args.peer:
        parser.error("--lora-adapters profiles pitstop alone: drop --peer")
    if args.warm_prompts and args.peer:
        parser.error("--warm-prompts profiles pitstop alone: drop --peer")
    pitstop_kernels, mc = profile_pitstop(
        args.model,
        scenario,
        trace_dir,
        lora_adapters=args.lora_adapters,
        warm_prompts=args.warm_prompts,
        **engine_kwargs,
    )
    engines = {"pitstop": pitstop_kernels}
    status, version = 0, None
    if args.peer == "vllm":
        from pitstop.bench.vllm_peer import VllmPeerError

        try:
            engines["vllm"], version = profile_vllm(
                args.model, mc, scenario, trace_dir, extra=peer_extra
            )
        except VllmPeerError as exc:
            print(f"peer vllm failed: {exc}", file=sys.stderr)
            status = 3
    unit = "µs per prompt" if scenario.decode_steps == 0 else "µs per step"
    import torch

    from pitstop.bench.floor import H200, ceilings_for

    on_gpu = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    # the "of ceiling" column: the H200's ceilings there, measured on another GPU
    rows = category_table(engines, mc, scenario, ceilings_for("cuda") if on_gpu else H200)
    if args.json:  # first: a reader that stops early (head) must not cost the file
        args.json.write_text(
            json.dumps(
                {
                    "scenario": scenario.name,
                    "batch": scenario.batch,
                    "prompt_len": scenario.prompt_len,
                    "decode_steps": scenario.decode_steps,
                    "model": args.model,
                    "vllm_version": version,
                    "categories": rows,
                    "kernels": {e: k for e, k in engines.items()},
                },
                indent=1,
            )
        )
    print(
        f"scenario {scenario.name}: batch {scenario.batch}, prompt {scenario.prompt_len}, "
        f"model {args.model}"
        + (f", KV cache {args.kv_cache_dtype}" if args.kv_cache_dtype else "")
        + (f", vLLM {version}" if version else "")
    )
    print(markdown(rows, list(engines), unit))
    for engine, kernels in engines.items():
        launches = sum(n for _, n in kernels.values())
        print(
            f"{engine}: {launches:.1f} launches {unit.removeprefix('µs ')}, "
            f"{launches / mc.num_layers:.2f} per layer ({mc.num_layers} layers, head and sampler included)"
        )
    for engine, kernels in engines.items():
        print(f"\n{engine}: top kernels ({unit}, launches)")
        for name, us, launches in top_kernels(kernels):
            print(f"  {us:10.1f}  {launches:6.1f}  {name[:110]}")
    for key, config in moe_tiles_used().items():
        print(f"pitstop: fused MoE tiles {key}: {tuple(config)}")
    return status


def moe_tiles_used() -> dict[str, tuple[int, ...]]:
    """The fused MoE op's tiles this process chose (cached or autotuned), by shape bucket: the
    ``(block_m, block_n, block_k, warps, stages, split)`` each MoE step size ran with
    (empty when no MoE model ran here)."""
    tiles = sys.modules.get("pitstop.plugins.kernels.triton_ops.moe_tiles")
    cache = getattr(tiles, "_default_cache", None)
    return {} if cache is None else {key: tuple(c) for key, c in cache._memory.items()}


def _option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--option``: true/false as booleans, integers as integers."""
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--option {text!r}: write KEY=VALUE, e.g. fused.layer=true")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


if __name__ == "__main__":
    sys.exit(main())
