"""Microbenchmark of the fused MoE op (issue 48): expert-weight bandwidth at decode batches.

For each batch ``T`` at the ``qwen3-30b-a3b`` layer shape (H 2048, E 128, top-8, F 768,
bf16 activations; ``--fp8``: e4m3 experts with row scales), random router logits route
the tokens; the op (:func:`pitstop.plugins.kernels.triton_ops.moe.fused_moe`, routing
included) is captured in a CUDA graph and its replay timed with
:func:`~pitstop.plugins.kernels.triton_ops.tuning.cold_median_ms` (median, a 256 MB read
before each run: the weights out of L2 and L2 clean; ``do_bench``'s flush by a write left
L2 dirty, whose write-back slowed every tile alike). Bytes are the expert
weights the step must read, each distinct expert hit once: ``hit * 3 * H * F`` elements
(``gate_up`` and ``down``; the ``engine`` row also the router's ``E * H``); the rate is
given in GB/s and as a fraction of the device's copy bandwidth, measured first (a 1 GiB
device-to-device copy, bytes read + written, as docs/workloads.md counts the H200's
4.23 TB/s; on the CPU that figure, nothing measured). Rows per batch:

- ``tuned``: the autotune's pick (``choose_config``, into a fresh cache directory), run
  as :func:`~pitstop.plugins.kernels.triton_ops.moe_tiles.launch_plan` has it for the batch
  (the five grouped launches: route, align, gate-up, grouped down, slot sum);
- ``engine``: the call a sparse layer makes under ``fused.layer``: the router's weight
  instead of its logits (one launch projects, routes and groups at 1 or 2 tokens:
  :func:`~pitstop.plugins.kernels.triton_ops.moe_router.fuses_router`), the post-attention
  RMSNorm inside (``norm_eps``) and the residual added by the op, tuned tiles;
- ``early`` and ``engine-early`` (batch 1): the ``tuned`` and ``engine`` rows with
  :attr:`~pitstop.plugins.kernels.triton_ops.moe_tiles.LaunchPlan.early_down` (the down
  GEMM launched as the gate-up's programs start, each of its programs holding its whole
  weight tile before it waits: ``fused.moe_early_down``);
- ``fewest`` (where fewer launches can run the batch): the same tiles,
  :func:`~pitstop.plugins.kernels.triton_ops.moe_tiles.fewest_launches` (three launches at
  T 1..4, four up to 128 flat rows), measured slower on an H100 on 2026-12-05;
- ``split<N>`` (``--split N``, repeatable): the tuned tiles with ``split_k`` N (a split
  gate-up keeps the grouped down and the slot sum);
- ``cand<i>`` (``--candidates``): every tile config the autotune times for the batch
  (:func:`~pitstop.plugins.kernels.triton_ops.moe_tiles.candidates`, in its order), each
  with the default plan: what the autotune chose from, one row each;
- ``cfg<i>`` (``--config M,N,K,WARPS,STAGES[,SPLIT]``, repeatable): any tiles, for sweeps.

Each row gives its kernel launches (memsets not counted) and its max difference from the
``tuned`` row's output over the output's max magnitude (split-K and the token-major
down re-associate float32 sums: about bf16 rounding; the ``engine`` row's from ``x`` plus
the op on ``x`` normalized, with its own logits: the norm's rounding too). (Split-K left the autotune, so the
old ``split1`` and ``unsplit`` rows were the ``tuned`` tiles again; they are gone.)

Usage::

    python benchmarks/moe_bench.py                       # H200: T = 1, 8, 64, 256
    python benchmarks/moe_bench.py --fp8 --batch 1 --batch 256
    python benchmarks/moe_bench.py --batch 1 --split 2 --split 4 --split 8 --split 16
    python benchmarks/moe_bench.py --batch 1 --batch 8 --kernels   # each row's kernels too
    python benchmarks/moe_bench.py --batch 1 --candidates          # every candidate's time
    python benchmarks/moe_bench.py --device cpu          # tiny shapes in Triton's interpreter:
                                                         # checks the script, measures nothing
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

COPY_BW = 4.23e12  # bytes/s, H200 device-to-device copy (docs/workloads.md); CPU rows use it
NORM_EPS = 1e-6  # qwen3-30b-a3b's rms_norm_eps
LAYER = dict(hidden=2048, experts=128, top_k=8, inter=768)  # qwen3-30b-a3b
TINY = dict(hidden=64, experts=8, top_k=2, inter=32)  # --device cpu


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, action="append", help="default 1, 8, 64, 256")
    p.add_argument("--fp8", action="store_true", help="e4m3 experts with row scales")
    p.add_argument("--split", type=int, action="append", default=[],
                   help="also the tuned tiles with this split_k (a row 'split<N>')")  # fmt: skip
    p.add_argument("--kernels", action="store_true",
                   help="CUDA: also each row's kernels, microseconds a call from the profiler")  # fmt: skip
    p.add_argument("--candidates", action="store_true",
                   help="also every tile config the autotune times (rows 'cand<i>')")  # fmt: skip
    p.add_argument("--config", action="append", default=[], metavar="M,N,K,WARPS,STAGES[,SPLIT]",
                   help="also these tiles (rows 'cfg<i>'), repeatable")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    args = parse(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton's first import
    import torch.nn.functional as F

    from pitstop.plugins.kernels import reference
    from pitstop.plugins.kernels.triton_ops import moe, moe_routing, moe_tiles
    from pitstop.plugins.kernels.triton_ops.rmsnorm import unit_gain

    dev = torch.device(args.device)
    shape = LAYER if dev.type == "cuda" else TINY
    h, e, top_k, f = shape["hidden"], shape["experts"], shape["top_k"], shape["inter"]
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    router = (torch.randn(e, h, device=dev, generator=gen) / h**0.5).bfloat16()
    gate_up = (torch.randn(e, 2 * f, h, device=dev, generator=gen) / h**0.5).bfloat16()
    down = (torch.randn(e, h, f, device=dev, generator=gen) / f**0.5).bfloat16()
    scales = None
    if args.fp8:
        from pitstop.plugins.weight_formats.fp8 import quantize_rows

        def quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
            return q.reshape(w.shape), s.reshape(w.shape[:2]).contiguous()

        (gate_up, gu_s), (down, d_s) = quantized(gate_up), quantized(down)
        scales = (gu_s, d_s)
    elem = gate_up.element_size()
    copy_bw = _copy_rate(dev)
    print(
        f"device copy bandwidth {copy_bw / 1e9:.0f} GB/s ({'measured' if dev.type == 'cuda' else 'the H200 figure'})"
    )
    cache = moe_tiles.ConfigCache(Path(tempfile.mkdtemp(prefix="moe_bench_")))
    rows: list[dict[str, object]] = []
    print(
        f"fused MoE, H {h} E {e} top-{top_k} F {f}, bf16 x, "
        f"{'fp8' if args.fp8 else 'bf16'} experts, {dev.type}"
    )
    print(f"{'T':>4} {'config':>8} {'tiles (m n k warps stages split)':>34} {'launches':>8} "
          f"{'us':>9} {'GB/s':>7} {'of copy':>7} {'diff':>8}")  # fmt: skip
    for t in args.batch or [1, 8, 64, 256]:
        x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
        logits = F.linear(x, router)
        weights, ids = moe_routing.route(logits, top_k, True, torch.bfloat16)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * h * f * elem

        def run(cfg: moe_tiles.MoEConfig, plan=None, x=x, logits=logits) -> torch.Tensor:
            return moe.fused_moe(x, logits, gate_up, down, top_k, renormalize=True,
                                 weights_dtype=torch.bfloat16, config=cfg, scales=scales,
                                 plan=plan)  # fmt: skip

        def run_engine(cfg: moe_tiles.MoEConfig, plan=None, x=x) -> torch.Tensor:
            return moe.fused_moe(x, None, gate_up, down, top_k, renormalize=True,
                                 weights_dtype=torch.bfloat16, config=cfg, scales=scales,
                                 router=router, residual=x, norm_eps=NORM_EPS,
                                 plan=plan)  # fmt: skip

        tuned = moe.choose_config(x, weights, ids, gate_up, down, cache, scales)
        configs = {"tuned": (tuned, moe_tiles.launch_plan(t, top_k, tuned))}
        configs["engine"] = configs["tuned"]
        if t == 1 and moe_tiles.early_down_columns(f):  # the down's weights read before its wait
            early = configs["tuned"][1]._replace(early_down=True)
            configs["early"] = configs["engine-early"] = (tuned, early)
        fewest = moe_tiles.fewest_launches(t, top_k)
        if fewest != configs["tuned"][1]:
            configs["fewest"] = (tuned, fewest)
        if args.candidates and dev.type == "cuda":
            for i, cfg in enumerate(moe_tiles.candidates(t, e, top_k, x.dtype)):
                configs[f"cand{i}"] = (cfg, moe_tiles.launch_plan(t, top_k, cfg))
        for i, spec in enumerate(args.config):
            cfg = moe_tiles.MoEConfig(*(int(v) for v in spec.split(",")))
            configs[f"cfg{i}"] = (cfg, moe_tiles.launch_plan(t, top_k, cfg))
        for n in args.split:
            split = tuned._replace(split_k=n)
            configs[f"split{n}"] = (split, moe_tiles.launch_plan(t, top_k, split))
        base = run(tuned)
        for name, (cfg, plan) in configs.items():
            engine = name.startswith("engine")  # the engine's call: router, norm, residual
            call = run_engine if engine else run
            try:
                seconds = _time(dev, lambda cfg=cfg, plan=plan, call=call: call(cfg, plan))
            except Exception as err:  # noqa: BLE001 - a candidate that cannot run (shared memory)
                print(f"{t:>4} {name:>8} {_tiles(cfg):>34} did not run: {str(err)[:80]}")
                continue
            out = call(cfg, plan)
            want = base
            if engine:  # x + the op on x normalized (unit gain) and its own logits
                xn = reference.rms_norm(x, unit_gain(h, x.dtype, x.device), NORM_EPS)[0]
                want = x + run(tuned, x=xn, logits=F.linear(xn, router))
            diff = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
            rate = (nbytes + (e * h * elem if engine else 0)) / seconds
            down_splits = moe_tiles.effective_split(f, cfg.down.block_k, cfg.split_k)[0]
            launches = (
                _engine_launches(t, top_k, plan, down_splits)
                if engine
                else plan.launches_for(t, down_splits)
            )
            row = dict(batch=t, config=name, tiles=list(cfg), launches=launches,
                       us=seconds * 1e6, gbps=rate / 1e9, of_copy=rate / copy_bw, diff=diff,
                       experts_hit=hit)  # fmt: skip
            rows.append(row)
            print(f"{t:>4} {name:>8} {_tiles(cfg):>34} {launches:>8} "
                  f"{seconds * 1e6:9.1f} {rate / 1e9:7.0f} {rate / copy_bw:7.1%} {diff:8.2g}")  # fmt: skip
            if args.kernels and dev.type == "cuda":
                row["kernels"] = _kernel_times(
                    lambda cfg=cfg, plan=plan, call=call: call(cfg, plan)
                )
                print(f"{'':>14} " + ", ".join(f"{k} {us:.1f}" for k, us in row["kernels"]))
    return rows


def _tiles(cfg) -> str:
    """``(m, n, k, warps, stages, split)``, and ``down (n, k, warps, stages)`` where the down
    GEMM has tiles of its own."""
    own = f" down {tuple(cfg.down)[1:5]}" if tuple(cfg.down)[:6] != tuple(cfg)[:6] else ""
    return f"{tuple(cfg)[:6]}{own}"


def _copy_rate(dev: torch.device) -> float:
    """Bytes a second of a 1 GiB device-to-device copy, read plus written (CUDA: the
    median of :func:`.tuning.cold_median_ms`); :data:`COPY_BW` on the CPU."""
    if dev.type != "cuda":
        return COPY_BW
    from pitstop.plugins.kernels.triton_ops import tuning

    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    seconds = tuning.cold_median_ms(lambda: dst.copy_(src), warmup=3, rep=20) * 1e-3
    return 2 * src.numel() / seconds


def _engine_launches(t: int, top_k: int, plan, down_splits: int) -> int:
    """Kernel launches of the ``engine`` row: the plan's, its routing launches (one or two)
    replaced by the one-launch router at 1 or 2 tokens; else the unit-gain norm and torch's
    router projection before them."""
    from pitstop.plugins.kernels.triton_ops.moe_router import fuses_router

    launches = plan.launches_for(t, down_splits)
    if fuses_router(t, top_k):
        return launches - (1 if plan.route_with_align else 2) + 1
    return 2 + launches


def _time(dev: torch.device, fn) -> float:
    """Seconds per call: CUDA: :func:`.tuning.cold_median_ms` over replays of a CUDA graph
    of it; CPU: one call by the wall clock."""
    if dev.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    from pitstop.plugins.kernels.triton_ops import tuning

    fn()  # compiled before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return tuning.cold_median_ms(g.replay, warmup=10, rep=100) * 1e-3


def _kernel_times(fn, replays: int = 50) -> list[tuple[str, float]]:
    """Each GPU kernel of ``fn`` (captured in a CUDA graph) with its mean microseconds a
    replay, from torch's profiler, in launch order; a 256 MB read before every replay (its
    reduction kernel left out), so the weights come from HBM and L2 holds nothing dirty."""
    from torch.profiler import ProfilerActivity, profile

    from pitstop.plugins.kernels.triton_ops.tuning import flush_l2

    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    device = torch.device("cuda", torch.cuda.current_device())
    flush_l2(device)  # its buffer made before the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush_l2(device)
            g.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (event.time_range.start, event.name, event.device_time)
        for event in prof.events()
        if event.device_type.name == "CUDA" and "reduce_kernel" not in event.name
    )
    per_replay = max(1, len(kernels) // replays)
    names = [name for _, name, _ in kernels[:per_replay]]
    totals: dict[str, float] = {}
    for i, (_, name, us) in enumerate(kernels[: per_replay * replays]):
        j = i % per_replay  # a kernel launched twice a replay (the two grouped GEMMs): by position
        label = name if names.count(name) == 1 else f"{name}#{names[: j + 1].count(name)}"
        label = label if len(label) <= 60 else label[:57] + "..."
        totals[label] = totals.get(label, 0.0) + us
    return [(name, us / replays) for name, us in totals.items()]


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
