"""fused_linear's skinny GEMMs against today's unfused sequence and cuBLAS, on the GPU.

For qwen3-0.6b and llama3-8b, each of a layer's four projections (QKV with the norm
before it, o_proj with the residual add, gate-up with the norm and SiLU·mul, down with
the residual add) and M in {1, 4, 16, 64, 128, 256}, times:

  unfused  today's engine: triton rms_norm -> F.linear; F.linear -> add;
           rms_norm -> F.linear -> triton silu_and_mul (no PDL)
  cublas   F.linear alone (the GEMM only)
  fused    fused_linear with its default config (PDL on where supported)
  best     the best of a small sweep of configs (within --sweep-budget seconds)

Each time is the median over graph replays of many calls per graph (a CUDA graph of
``calls`` launches, the weights rotated over copies summing > 256 MB so they are read
from HBM, not L2), divided by the calls. Bytes = weights + x + output (+ residual);
bw% = bytes / time against 4.23 TB/s. Then the "layer chain": the four fused ops of
one layer, 28 times (a qwen3-0.6b decode step without attention), in one graph, PDL
on against off, beside the unfused chain and cuBLAS alone.

    python benchmarks/fused_linear_bench.py --out /tmp/fused_linear.json

Prints a compact table last; the full results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pitstop.plugins.kernels.triton_ops import fused_linear as fl
from pitstop.plugins.kernels.triton_ops import pdl, rmsnorm, silu
from pitstop.testing.timing import graph_seconds

COPY_BW = 4.23e12  # bytes/s, the H200's measured copy bandwidth
EPS = 1e-6
ROTATE_BYTES = 256 << 20
MODELS = {  # hidden, qkv N, o_proj K, intermediate F, layers
    "qwen3-0.6b": (1024, 4096, 2048, 3072, 28),
    "llama3-8b": (4096, 6144, 4096, 14336, 32),
}
OPS = ("qkv", "o", "gate_up", "down")
ROWS = (1, 4, 16, 64, 128, 256)


def shape(model: str, op: str) -> tuple[int, int, int]:
    """(weight rows, K, output columns) of one projection."""
    hidden, qkv, o_k, f, _ = MODELS[model]
    return {
        "qkv": (qkv, hidden, qkv),
        "o": (hidden, o_k, hidden),
        "gate_up": (2 * f, hidden, f),
        "down": (hidden, f, hidden),
    }[op]


def time_calls(fns: list[Callable[[], Any]], reps: int = 7) -> float:
    """Seconds per call: ``fns`` (run in order) captured in one CUDA graph, median of replays
    (:func:`pitstop.testing.timing.graph_seconds`)."""
    return graph_seconds(fns, reps)


class Case:
    """One (model, op, M): weight copies to rotate over, the inputs, and the callables."""

    def __init__(self, model: str, op: str, m: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model, self.op, self.m = model, op, m
        rows, k, n_out = shape(model, op)
        self.rows, self.k, self.n_out = rows, k, n_out
        wbytes = rows * k * 2
        self.copies = max(2, min(64, math.ceil(ROTATE_BYTES / wbytes)))
        self.ws = [
            (torch.randn(rows, k, device="cuda") / k**0.5).to(dtype) for _ in range(self.copies)
        ]
        self.gain = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
        self.x = (3 * torch.randn(m, k, device="cuda")).to(dtype)
        self.res = torch.randn(m, n_out, device="cuda").to(dtype)
        self.calls = max(self.copies, 64)
        io = (m * k + m * n_out * (2 if op in ("o", "down") else 1)) * 2
        self.bytes = wbytes + io

    def unfused(self, i: int) -> Callable[[], Any]:
        w = self.ws[i % self.copies]
        if self.op == "qkv":
            return lambda: F.linear(rmsnorm.rms_norm(self.x, self.gain, EPS, pdl=False)[0], w)
        if self.op == "gate_up":
            return lambda: silu.silu_and_mul(
                F.linear(rmsnorm.rms_norm(self.x, self.gain, EPS, pdl=False)[0], w), pdl=False
            )
        return lambda: self.res + F.linear(self.x, w)

    def cublas(self, i: int) -> Callable[[], Any]:
        w = self.ws[i % self.copies]
        return lambda: F.linear(self.x, w)

    def fused(self, i: int, cfg: fl.LinearConfig | None, on: bool | None = None):
        w = self.ws[i % self.copies]
        if self.op == "qkv":
            return lambda: fl.norm_linear(self.x, w, EPS, config=cfg, pdl=on)
        if self.op == "gate_up":
            return lambda: fl.norm_gate_up(self.x, w, EPS, config=cfg, pdl=on)
        return lambda: fl.linear_residual(self.x, w, self.res, config=cfg, pdl=on)

    def error(self, cfg: fl.LinearConfig | None) -> float:
        """Max relative error of the fused op against float64 (the first weight copy)."""
        out = self.fused(0, cfg)().double()
        w, x = self.ws[0].double(), self.x.double()
        rstd = 1.0 / torch.sqrt((x * x).mean(1, keepdim=True) + EPS)
        if self.op == "qkv":
            ref = rstd * (x @ w.T)
        elif self.op == "gate_up":
            h = rstd * (x @ w.T)
            g, u = h[:, : self.n_out], h[:, self.n_out :]
            ref = g / (1 + torch.exp(-g)) * u
        else:
            ref = self.res.double() + x @ w.T
        if not torch.isfinite(out).all():
            return float("inf")
        return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()

    def time(self, make: Callable[[int], Callable[[], Any]]) -> float:
        return time_calls([make(i) for i in range(self.calls)])


def candidates(case: Case) -> list[fl.LinearConfig]:
    """A few configs around the rule's: split halved/doubled/off, BLOCK_N and BLOCK_K changed,
    and up to 16 rows the rule's tile under stream-K."""
    base = fl.choose_config(
        case.m, case.n_out, case.k, torch.bfloat16, case.op == "gate_up", True, fl.num_sms(
            torch.device("cuda")
        )
    )  # fmt: skip
    out = [base]

    def add(cfg: fl.LinearConfig) -> None:
        per_split = case.k / cfg.split_k
        if cfg not in out and per_split >= cfg.block_k and cfg.split_k <= 32:
            out.append(cfg)

    add(base._replace(split_k=1))
    add(base._replace(split_k=base.split_k * 2))
    if base.split_k > 1:
        add(base._replace(split_k=base.split_k // 2))
    add(base._replace(block_n=base.block_n // 2, split_k=max(1, base.split_k // 2)))
    if base.block_n <= 64:
        add(base._replace(block_n=base.block_n * 2, split_k=base.split_k * 2))
    add(base._replace(block_k=64 if base.block_k > 64 else 128))
    add(base._replace(num_stages=base.num_stages + 1 if base.num_stages < 5 else 2))
    if case.m <= fl.UNSPLIT_ROWS:  # every program the same K steps (fused_linear_stream_k)
        sms = fl.num_sms(torch.device("cuda"))
        for cfg in fl.stream_k_tiles(base, case.op == "gate_up", sms):
            add(cfg)
    if case.m >= 64:  # fewer, shorter tiles; no split
        add(base._replace(block_m=32, block_n=64, block_k=128, split_k=1, num_stages=4))
        add(base._replace(block_n=64, split_k=1))
    return out


def fmt_cfg(cfg: fl.LinearConfig) -> str:
    extra = (f"/streamk{cfg.stream_k}" if cfg.stream_k else "") + (
        "/shared" if cfg.shared_shrink else ""
    )
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/s{cfg.split_k}/w{cfg.num_warps}/st{cfg.num_stages}{extra}"


def bench_ops(models: list[str], rows: list[int], sweep_budget: float) -> list[dict[str, Any]]:
    results = []
    sweep_until = time.monotonic() + sweep_budget
    for model in models:
        for op in OPS:
            for m in rows:
                case = Case(model, op, m)
                cfg = fl.choose_config(
                    m, case.n_out, case.k, torch.bfloat16, op == "gate_up", True,
                    fl.num_sms(torch.device("cuda")),
                )  # fmt: skip
                row: dict[str, Any] = {
                    "model": model, "op": op, "m": m, "n": case.n_out, "k": case.k,
                    "bytes": case.bytes, "copies": case.copies, "config": fmt_cfg(cfg),
                }  # fmt: skip
                try:
                    row["error"] = case.error(cfg)
                    row["unfused_s"] = case.time(case.unfused)
                    row["cublas_s"] = case.time(case.cublas)
                    row["fused_s"] = case.time(lambda i, c=case, g=cfg: c.fused(i, g))
                    row["fused_nopdl_s"] = case.time(
                        lambda i, c=case, g=cfg: c.fused(i, g, on=False)
                    )
                except Exception as exc:  # report and go on: the table says which failed
                    row["failure"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    print(f"{model} {op} M={m}: {row['failure']}", flush=True)
                    results.append(row)
                    continue
                sweep = []
                if time.monotonic() < sweep_until:
                    for cand in candidates(case)[1:]:
                        entry: dict[str, Any] = {"config": fmt_cfg(cand)}
                        try:
                            entry["error"] = case.error(cand)
                            entry["s"] = case.time(lambda i, c=case, g=cand: c.fused(i, g))
                        except Exception as exc:
                            entry["failure"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                        sweep.append(entry)
                row["sweep"] = sweep
                good = [e for e in sweep if "s" in e and e["error"] < 2e-2]
                best = min(good, key=lambda e: e["s"], default=None)
                if best is not None and best["s"] < row["fused_s"]:
                    row["best_s"], row["best_config"] = best["s"], best["config"]
                else:
                    row["best_s"], row["best_config"] = row["fused_s"], row["config"]
                print(
                    f"{model:10s} {op:7s} M={m:3d} unfused {row['unfused_s'] * 1e6:7.1f} us "
                    f"cublas {row['cublas_s'] * 1e6:7.1f} fused {row['fused_s'] * 1e6:7.1f} "
                    f"({row['config']}, err {row['error']:.1e}) best {row['best_s'] * 1e6:7.1f} "
                    f"({row['best_config']})",
                    flush=True,
                )
                results.append(row)
                del case
                torch.cuda.empty_cache()
    return results


def bench_chain(rows: list[int]) -> list[dict[str, Any]]:
    """qwen3-0.6b's 28 layers of the four GEMM ops (no attention) in one graph."""
    hidden, qkv_n, o_k, f, layers = MODELS["qwen3-0.6b"]
    dt = torch.bfloat16

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device="cuda") / k**0.5).to(dt)

    ws = [(w(qkv_n, hidden), w(hidden, o_k), w(2 * f, hidden), w(hidden, f)) for _ in range(layers)]
    gain = torch.ones(hidden, device="cuda", dtype=dt)
    wbytes = sum(t.numel() * 2 for lay in ws for t in lay)
    out = []
    for m in rows:
        h0 = torch.randn(m, hidden, device="cuda").to(dt)
        attn = torch.randn(m, o_k, device="cuda").to(dt)  # stands in for attention's output
        act_in = torch.randn(m, f, device="cuda").to(dt)

        def fused_step(on: bool, h0=h0, attn=attn) -> None:
            h = h0
            for w_qkv, w_o, w_gu, w_down in ws:
                fl.norm_linear(h, w_qkv, EPS, pdl=on)
                h = fl.linear_residual(attn, w_o, h, pdl=on)
                act = fl.norm_gate_up(h, w_gu, EPS, pdl=on)
                h = fl.linear_residual(act, w_down, h, pdl=on)

        def unfused_step(h0=h0, attn=attn) -> None:
            h = h0
            for w_qkv, w_o, w_gu, w_down in ws:
                F.linear(rmsnorm.rms_norm(h, gain, EPS, pdl=False)[0], w_qkv)
                h = h + F.linear(attn, w_o)
                g = F.linear(rmsnorm.rms_norm(h, gain, EPS, pdl=False)[0], w_gu)
                h = h + F.linear(silu.silu_and_mul(g, pdl=False), w_down)

        def cublas_step(h0=h0, attn=attn, act_in=act_in) -> None:
            h = h0
            for w_qkv, w_o, w_gu, w_down in ws:
                F.linear(h, w_qkv)
                F.linear(attn, w_o)
                F.linear(h, w_gu)
                F.linear(act_in, w_down)

        row: dict[str, Any] = {"m": m, "weight_bytes": wbytes}
        for name, fn in (
            ("fused_pdl", lambda: fused_step(True)),
            ("fused_nopdl", lambda: fused_step(False)),
            ("unfused", unfused_step),
            ("cublas_only", cublas_step),
        ):
            try:
                row[name + "_s"] = time_calls([fn], reps=11)
            except Exception as exc:
                row[name + "_failure"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"chain M={m}: " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--out", default="fused_linear_bench.json", help="full results (JSON)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--sweep-budget", type=float, default=75.0, help="seconds of config sweeping")
    p.add_argument("--chain-rows", default="1,16,64")
    p.add_argument("--no-chain", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    torch.manual_seed(0)
    fl.workspace(torch.device("cuda"))
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "pdl": pdl.enabled(torch.device("cuda")),
    }
    print(info, flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    ops = bench_ops(args.models.split(","), rows, args.sweep_budget)
    chain = [] if args.no_chain else bench_chain([int(r) for r in args.chain_rows.split(",")])
    info["seconds"] = time.monotonic() - t0
    with open(args.out, "w") as fh:
        json.dump({"info": info, "ops": ops, "chain": chain}, fh, indent=1)

    def us(row: dict[str, Any], key: str) -> str:
        return f"{row[key] * 1e6:7.1f}" if key in row else "   fail"

    print(f"\n== fused_linear (bf16, us per call; bw% of {COPY_BW / 1e12:.2f} TB/s at fused)")
    print(
        f"{'model':10s} {'op':7s} {'M':>3s} {'unfused':>7s} {'cublas':>7s} {'fused':>7s} "
        f"{'noPDL':>7s} {'bw%':>5s} {'xcub':>5s} {'best':>7s} best config / err"
    )
    for r in ops:
        bw = f"{100 * r['bytes'] / r['fused_s'] / COPY_BW:5.1f}" if "fused_s" in r else "  -  "
        speed = f"{r['cublas_s'] / r['fused_s']:5.2f}" if "fused_s" in r else "  -  "
        tail = f"{r.get('best_config', '-')} {r.get('error', float('nan')):.0e}"
        if "failure" in r:
            tail = r["failure"][:60]
        print(
            f"{r['model']:10s} {r['op']:7s} {r['m']:3d} {us(r, 'unfused_s')} {us(r, 'cublas_s')} "
            f"{us(r, 'fused_s')} {us(r, 'fused_nopdl_s')} {bw} {speed} {us(r, 'best_s')} {tail}"
        )
    if chain:
        print("\n== qwen3-0.6b layer chain: 28 x (qkv, o, gate_up, down), us per step")
        print(f"{'M':>3s} {'PDL':>8s} {'noPDL':>8s} {'unfused':>8s} {'cublas':>8s} {'bw%PDL':>6s}")
        for r in chain:
            bw = (
                f"{100 * r['weight_bytes'] / r['fused_pdl_s'] / COPY_BW:6.1f}"
                if "fused_pdl_s" in r
                else "   -  "
            )
            print(
                f"{r['m']:3d} {us(r, 'fused_pdl_s'):>8s} {us(r, 'fused_nopdl_s'):>8s} "
                f"{us(r, 'unfused_s'):>8s} {us(r, 'cublas_only_s'):>8s} {bw}"
            )
    bad = [r for r in ops if "failure" in r or r.get("error", 1) > 2e-2]
    print(f"\n{len(bad)} failed or inaccurate rows; {info['seconds']:.0f} s; JSON: {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
