"""Multi-LoRA kernels on the GPU (issue 47): one decoder layer's LoRA launches, old beside fused.

Per projection of a merged layer (qkv, o, gate_up, down) at the real shapes of qwen3-0.6b
and llama3-8b, rank 16 in every slot: the base GEMM alone (``torch.mm``, bf16), the
former path (a zeroed float32 intermediate, ``lora_shrink``, ``lora_expand_add``: three
launches) and ``lora_add`` (fused: one launch; ``--fused 0`` its two-launch path), each
captured ``--iters`` times in a CUDA graph and timed by replays (median of ``--repeats``);
then the GEMM and the engine's default LoRA path together (GEMM, shrink into a zeroed
workspace, expand), serial and with the shrink on a second stream beside the GEMM
(``lora.overlap``); then ``fused.layer``'s Triton GEMM (``fused_linear``, with its norm,
SiLU·mul or residual) alone and with the LoRA delta inside it (``lora=``: no launch of its
own), each at its default launch shape and at the fastest of the shapes the fused layer
times (``fused_linear.tile_candidates``), and at the fastest LoRA shape as under
``lora.shrink_before`` (the projection reads the shrink the GEMM before it summed, and sums
the next projection's in its epilogue). Prints µs per call and the layer's totals: the
LoRA cost beside the base GEMMs.

    python3 benchmarks/lora_bench.py [--case nano-1 single ...]
    python3 benchmarks/lora_bench.py --case nano-8 --tiles 32,64,128,2 16,64,128,4
    python3 benchmarks/lora_bench.py --case nano-8 nano-1 single --pack-tiles 32,64,128,1 16,32,256,2,8,2
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch

from pitstop.plugins.kernels.lora_reference import ProjectionLoRA
from pitstop.plugins.kernels.triton_ops import fused_linear, lora, lora_pack
from pitstop.testing.timing import graph_seconds

# case -> (hidden, q, kv, intermediate, rows, adapters in the batch)
CASES = {
    "nano-1": (1024, 2048, 1024, 3072, 256, 1),
    "nano-8": (1024, 2048, 1024, 3072, 256, 8),
    "single": (4096, 4096, 1024, 14336, 1, 1),
    "single-16": (4096, 4096, 1024, 14336, 16, 1),
    # a prompt step of nano (8,192 tokens): the stacked layout's large steps (pack or gemms)
    "nano-8-chunk": (1024, 2048, 1024, 3072, 8192, 8),
    "nano-1-chunk": (1024, 2048, 1024, 3072, 8192, 1),
}
RANK = 16


def _timed(fn, iters: int, repeats: int) -> float:
    """µs per call of ``fn`` captured ``iters`` times in one CUDA graph (median of repeats;
    :func:`pitstop.testing.timing.graph_seconds`)."""
    return 1e6 * graph_seconds([fn] * iters, repeats)


# lora.shrink_before: the projection whose shrink each projection's GEMM sums (the one that
# reads its output; q|k|v's output goes to attention, and the down GEMM's to the next layer's
# q|k|v), and the projections that read their shrink from the GEMM before them
SUMS_FOR = {"o": "gate_up", "gate_up": "down", "down": "qkv"}
READS_SUMMED = ("qkv", "gate_up", "down")


def _time_projection(
    proj, rows, k, widths, slot_of_row, meta, ranks, scaling, slots, iters, repeats, fused,
    after=None,
) -> dict[str, float]:  # fmt: skip
    """µs per call of each way of one projection; ``after``: ``(K, slice widths)`` of the
    projection whose shrink this one's fused GEMM sums under ``lora.shrink_before`` (None:
    none)."""
    dev, dt = "cuda", torch.bfloat16
    n = sum(widths)
    x = torch.randn(rows, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
    y = torch.zeros(rows, n, device=dev, dtype=dt)
    a = [torch.randn(slots, RANK, k, device=dev, dtype=dt) / k**0.5 for _ in widths]
    b = [torch.randn(slots, m, RANK, device=dev, dtype=dt) / RANK for m in widths]
    h = torch.empty(rows, len(widths) * RANK, device=dev, dtype=torch.float32)

    def gemm() -> None:
        torch.mm(x, w.t(), out=y)

    def old() -> None:
        lora.lora_shrink(x, a, slot_of_row, ranks, meta=meta, out=h)  # zeroes h first
        lora.lora_expand_add(y, h, b, slot_of_row, scaling, ranks, meta=meta)

    def new() -> None:
        lora.lora_add(y, x, a, b, slot_of_row, scaling, ranks, meta=meta, fused=fused)

    side = torch.cuda.Stream()

    def serial() -> None:  # the engine's default: GEMM, shrink into the zeroed workspace, expand
        gemm()
        lora.lora_shrink(x, a, slot_of_row, ranks, meta=meta, out=h, zeroed=True)
        lora.lora_expand_add(y, h, b, slot_of_row, scaling, ranks, meta=meta)

    def overlapped() -> None:  # lora.overlap: the shrink on a second stream beside the GEMM
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lora.lora_shrink(x, a, slot_of_row, ranks, meta=meta, out=h, zeroed=True)
        gemm()
        torch.cuda.current_stream().wait_stream(side)
        lora.lora_expand_add(y, h, b, slot_of_row, scaling, ranks, meta=meta)

    pad = fused_linear.lora_rank_pad(RANK)
    h_in = torch.zeros(rows, len(widths) * pad, device=dev, dtype=torch.float32)
    inside = ProjectionLoRA(tuple(a), tuple(b), slot_of_row, scaling, ranks, None, h_in=h_in)
    residual = torch.randn(rows, n, device=dev, dtype=dt)
    summing: dict = {}  # lora.shrink_before: this GEMM reads its h and sums the next one's
    if after is not None:
        k2, widths2 = after
        a2 = tuple(torch.randn(slots, RANK, k2, device=dev, dtype=dt) / k2**0.5 for _ in widths2)
        b2 = tuple(torch.randn(slots, m, RANK, device=dev, dtype=dt) / RANK for m in widths2)
        h2 = torch.zeros(rows, len(widths2) * pad, device=dev, dtype=torch.float32)
        summing["next_lora"] = ProjectionLoRA(a2, b2, slot_of_row, scaling, ranks, None, h_in=h2)
    if proj in READS_SUMMED:
        summing["h_in"] = True

    def layer_gemm(
        with_lora: bool, config: fused_linear.LinearConfig | None = None, summed: bool = False
    ) -> None:
        """fused.layer's GEMM of this projection (its default launch shape, or ``config``;
        ``summed``: as under ``lora.shrink_before``)."""
        kw = {"lora": inside} if with_lora else {}
        if summed:
            kw |= summing
        if config is not None:
            kw["config"] = config
        if proj == "qkv":
            kw.pop("next_lora", None)  # attention reads q|k|v
            fused_linear.norm_linear(x, w, 1e-6, **kw)
        elif proj == "gate_up":
            fused_linear.norm_gate_up(x, w, 1e-6, **kw)
        else:
            fused_linear.linear_residual(x, w, residual, **kw)

    ways: dict[str, float] = {}  # with the adapter: the fastest shape sharing its shrink, or not

    def best(with_lora: bool) -> tuple[float, fused_linear.LinearConfig]:
        """The fastest of the launch shapes the fused layer times (with the adapter: those
        whose tiles keep each slice apart) and its time; with the adapter, the fastest shape
        of each way of the shrink into ``ways``."""
        gate_up = proj == "gate_up"
        shapes = fused_linear.tile_candidates(
            rows, widths[0] if gate_up else n, k, dt, gate_up, fused_linear.num_sms(x.device),
            lora_rank=RANK if with_lora else 0,
        )  # fmt: skip
        if with_lora:
            shapes = [c for c in shapes if fused_linear.lora_fits(inside, gate_up, c.block_n)]
        times = {c: _timed(lambda c=c: layer_gemm(with_lora, c), iters, repeats) for c in shapes}
        if not times:  # no tile keeps these slices apart: the layer takes cuBLAS
            return float("nan"), None
        fastest = min(times, key=times.__getitem__)
        if with_lora:
            for way, shared in (("in the K loop", 0), ("shared", 1)):
                own = [us for c, us in times.items() if c.shared_shrink == shared]
                ways[way] = min(own, default=float("nan"))
        return times[fastest], fastest

    (layer_best, layer_cfg), (lora_best, lora_cfg) = best(False), best(True)  # (µs, shape or None)
    summed = float("nan")
    if lora_cfg is not None:  # lora.shrink_before at the fastest LoRA shape
        summed = _timed(lambda: layer_gemm(True, lora_cfg, summed=True), iters, repeats)
    return {
        "layer": _timed(lambda: layer_gemm(False), iters, repeats),
        "layer+lora": _timed(lambda: layer_gemm(True), iters, repeats),
        "layer+lora summed": summed,
        "layer best": layer_best,
        "layer+lora best": lora_best,
        "layer+lora best, shrink in the K loop": ways.get("in the K loop", float("nan")),
        "layer+lora best, shrink shared": ways.get("shared", float("nan")),
        "configs": (layer_cfg, lora_cfg),
        "gemm": _timed(gemm, iters, repeats),
        "old": _timed(old, iters, repeats),
        "new": _timed(new, iters, repeats),
        "serial": _timed(serial, iters, repeats),
        "overlap": _timed(overlapped, iters, repeats),
    }


class Case(NamedTuple):
    """A case's rows and adapters on the GPU: each projection's ``(K, slice widths)``, and the
    rows' slots (adapters in turn), their grouping, ranks and scaling."""

    rows: int
    adapters: int
    slots: int
    projections: dict[str, tuple[int, tuple[int, ...]]]
    slot_of_row: torch.Tensor
    meta: lora.LoRAMeta
    ranks: torch.Tensor
    scaling: torch.Tensor


def _case(name: str) -> Case:
    """:data:`CASES`' ``name`` on the GPU (see :class:`Case`)."""
    hidden, q, kv, inter, rows, adapters = CASES[name]
    slots, dev = max(adapters, 1), "cuda"
    slot_of_row = (torch.arange(rows, device=dev) % adapters).to(torch.int32)
    return Case(
        rows,
        adapters,
        slots,
        {
            "qkv": (hidden, (q, kv, kv)),
            "o": (q, (hidden,)),
            "gate_up": (hidden, (inter, inter)),
            "down": (inter, (hidden,)),
        },
        slot_of_row,
        lora.lora_meta(slot_of_row, slots),
        torch.full((slots,), RANK, dtype=torch.int32, device=dev),
        torch.full((slots,), 2.0, device=dev),
    )


def run_tiles(name: str, tiles: list[lora.LoRAConfig], iters: int, repeats: int) -> None:
    """``--tiles``: per projection of ``name``, the cuBLAS GEMM with the engine's default LoRA
    path (shrink into the zeroed workspace, expand) at :func:`lora.default_config`'s launch
    shape and at each of ``tiles`` (both kernels), the layer's totals last."""
    case = _case(name)
    rows, slots, dev, dt = case.rows, case.slots, "cuda", torch.bfloat16
    slot_of_row, meta, ranks, scaling = case.slot_of_row, case.meta, case.ranks, case.scaling
    shapes = {"default": None, **{str(tuple(c)): c for c in tiles}}
    totals = dict.fromkeys(["gemm", *shapes], 0.0)
    print(f"== {name} tiles: T={rows}, {case.adapters} adapter(s), rank {RANK}, bf16")
    for proj, (k, widths) in case.projections.items():
        x = torch.randn(rows, k, device=dev, dtype=dt)
        w = torch.randn(sum(widths), k, device=dev, dtype=dt) / k**0.5
        y = torch.zeros(rows, sum(widths), device=dev, dtype=dt)
        a = [torch.randn(slots, RANK, k, device=dev, dtype=dt) / k**0.5 for _ in widths]
        b = [torch.randn(slots, m, RANK, device=dev, dtype=dt) / RANK for m in widths]
        h = torch.zeros(rows, len(widths) * RANK, device=dev, dtype=torch.float32)

        def serial(cfg: lora.LoRAConfig | None, x=x, w=w, y=y, a=a, b=b, h=h) -> None:
            torch.mm(x, w.t(), out=y)
            lora.lora_shrink(x, a, slot_of_row, ranks, meta=meta, out=h, zeroed=True, config=cfg)
            lora.lora_expand_add(y, h, b, slot_of_row, scaling, ranks, meta=meta, config=cfg)

        times = {"gemm": _timed(lambda x=x, w=w, y=y: torch.mm(x, w.t(), out=y), iters, repeats)}
        times |= {
            label: _timed(lambda c=c: serial(c), iters, repeats) for label, c in shapes.items()
        }
        for key, us in times.items():
            totals[key] += us
        default = lora.default_config(rows, k, dt, x.device)
        print(f"{proj:>8}: K={k:>5} N={sum(widths):>5} default {tuple(default)}: "
              + ", ".join(f"{key} {us:.2f} us" for key, us in times.items()))  # fmt: skip
    print("   layer: " + ", ".join(f"{key} {us:.1f} us" for key, us in totals.items()))


def run_stacked(name: str, tiles: list[lora_pack.PackTiles], iters: int, repeats: int) -> None:
    """``--pack-tiles``: per projection of ``name``, the cuBLAS GEMM alone, with the
    ``shrink_expand`` path after it (shrink into the zeroed workspace, expand), with the
    large steps' library GEMMs after it (``gemms``: ``x A_allᵀ``, the rows' scales, ``y +=
    h Bᵀ``), and the stacked layout
    (``lora_pack`` then one GEMM over ``[x | h']`` and ``[W | B']``) at the default pack shape
    and at each of ``tiles``; then the pack alone at each; the layer's totals last."""
    case = _case(name)
    rows, slots, dev, dt = case.rows, case.slots, "cuda", torch.bfloat16
    slot_of_row, meta, ranks, scaling = case.slot_of_row, case.meta, case.ranks, case.scaling
    shapes = {"default": None, **{str(tuple(c)): c for c in tiles}}
    keys = [
        "gemm",
        "shrink_expand",
        "gemms",
        *[f"stacked {k}" for k in shapes],
        *[f"pack {k}" for k in shapes],
    ]
    totals = dict.fromkeys(keys, 0.0)
    print(f"== {name} stacked: T={rows}, {case.adapters} adapter(s), rank {RANK}, bf16")
    # each row's scale in each slot (its own: the case's scaling, 2.0), as _large_step writes it
    row_scale = torch.zeros(rows, slots, device=dev, dtype=torch.float32)
    row_scale[torch.arange(rows, device=dev), slot_of_row.long()] = 2.0
    for proj, (k, widths) in case.projections.items():
        n, width = sum(widths), len(widths) * RANK
        e = slots * width
        x = torch.randn(rows, k, device=dev, dtype=dt)
        w_ext = torch.randn(n, k + e, device=dev, dtype=dt) / k**0.5
        w = w_ext[:, :k]
        y = torch.zeros(rows, n, device=dev, dtype=dt)
        a = [torch.randn(slots, RANK, k, device=dev, dtype=dt) / k**0.5 for _ in widths]
        b = [torch.randn(slots, m, RANK, device=dev, dtype=dt) / RANK for m in widths]
        a_all = torch.cat([torch.cat([ai[s] for ai in a]) for s in range(slots)]).contiguous()
        h = torch.zeros(rows, width, device=dev, dtype=torch.float32)
        packed = torch.empty(rows, k + e, device=dev, dtype=dt)
        work = lora_pack.pack_workspace(rows, e, x.device)

        def serial(x=x, w=w, y=y, a=a, b=b, h=h) -> None:
            torch.mm(x, w.t(), out=y)
            lora.lora_shrink(x, a, slot_of_row, ranks, meta=meta, out=h, zeroed=True)
            lora.lora_expand_add(y, h, b, slot_of_row, scaling, ranks, meta=meta)

        def gemms(x=x, w=w, y=y, a_all=a_all, w_ext=w_ext, k=k, width=width) -> None:
            # lora.large_steps=gemms (LoRASlots._add_large): the base GEMM, then the delta
            torch.mm(x, w.t(), out=y)
            h = x @ a_all.T
            h.view(rows, slots, width).mul_(row_scale[:, :, None])
            y.addmm_(h, w_ext[:, k:].T)

        def pack(cfg, x=x, a_all=a_all, width=width, packed=packed, work=work) -> None:
            lora_pack.lora_pack(
                x, a_all, slot_of_row, scaling, width, out=packed, tiles=cfg, workspace=work
            )

        def stacked(cfg, packed=packed, w_ext=w_ext, y=y) -> None:
            pack(cfg)
            torch.mm(packed, w_ext.t(), out=y)

        times = {
            "gemm": _timed(lambda x=x, w=w, y=y: torch.mm(x, w.t(), out=y), iters, repeats),
            "shrink_expand": _timed(serial, iters, repeats),
            "gemms": _timed(gemms, iters, repeats),
        }
        for label, c in shapes.items():
            times[f"stacked {label}"] = _timed(lambda c=c: stacked(c), iters, repeats)
        for label, c in shapes.items():
            times[f"pack {label}"] = _timed(lambda c=c: pack(c), iters, repeats)
        for key, us in times.items():
            totals[key] += us
        default = lora_pack.pack_tiles(rows, e, k, dt, x.device)
        print(f"{proj:>8}: K={k:>5} N={n:>5} E={e:>4} default pack {tuple(default)}: "
              + ", ".join(f"{key} {us:.2f} us" for key, us in times.items()))  # fmt: skip
    print("   layer: " + ", ".join(f"{key} {us:.1f} us" for key, us in totals.items()))


def _pack_tiles(text: str) -> lora_pack.PackTiles:
    """``BM,BN,BK,SPLIT[,WARPS,STAGES]`` as a pack launch shape (4 warps, 3 stages by default)."""
    return lora_pack.PackTiles(*[int(part) for part in text.split(",")])


def _tiles(text: str) -> lora.LoRAConfig:
    """``BM,BN,BK,SPLIT[,WARPS,STAGES]`` as a launch shape (4 warps, 3 stages by default)."""
    v = [int(part) for part in text.split(",")]
    return lora.LoRAConfig(*v[:4], *(v[4:6] if len(v) >= 6 else (4, 3)))


def _shape(config: fused_linear.LinearConfig | None) -> str:
    """A launch shape as its numbers, or why there is none."""
    return str(tuple(config)) if config is not None else "(no shape fits the slices)"


def run_case(name: str, iters: int, repeats: int, fused: bool) -> None:
    case = _case(name)
    rows, adapters, slots, projections = case.rows, case.adapters, case.slots, case.projections
    slot_of_row, meta, ranks, scaling = case.slot_of_row, case.meta, case.ranks, case.scaling
    keys = ["gemm", "old", "new", "serial", "overlap", "layer", "layer+lora"]
    ways = ["layer+lora best, shrink in the K loop", "layer+lora best, shrink shared"]
    totals = dict.fromkeys(
        [*keys, "layer best", "layer+lora best", "layer+lora summed", *ways], 0.0
    )
    print(f"== {name}: T={rows}, {adapters} adapter(s), rank {RANK}, bf16")
    common = (slot_of_row, meta, ranks, scaling, slots, iters, repeats, fused)
    for proj, (k, widths) in projections.items():
        after = projections[SUMS_FOR[proj]] if proj in SUMS_FOR else None
        t = _time_projection(proj, rows, k, widths, *common, after=after)
        cfg = lora.fused_config(rows, k, widths, torch.bfloat16, torch.device("cuda"))
        for key in totals:
            totals[key] += t[key]
        print(
            f"{proj:>8}: K={k:>5} N={sum(widths):>5}  gemm {t['gemm']:7.2f} us  old lora "
            f"{t['old']:7.2f} us  lora_add {t['new']:7.2f} us  (fused config {tuple(cfg)}); "
            f"gemm+lora serial {t['serial']:7.2f} us, shrink overlapped {t['overlap']:7.2f} us; "
            f"fused.layer GEMM {t['layer']:7.2f} us, with the LoRA inside {t['layer+lora']:7.2f} us; "
            f"the fastest shapes: {t['layer best']:7.2f} us {_shape(t['configs'][0])}, with the "
            f"LoRA inside {t['layer+lora best']:7.2f} us {_shape(t['configs'][1])}, as under "
            f"lora.shrink_before {t['layer+lora summed']:7.2f} us; the fastest with the shrink "
            f"in the K loop {t[ways[0]]:7.2f} us, shared {t[ways[1]]:7.2f} us"
        )
    g = totals["gemm"]
    print(
        f"   layer: gemm {g:.1f} us; + old lora {totals['old']:.1f} us "
        f"({g / (g + totals['old']):.3f}x); + lora_add {totals['new']:.1f} us "
        f"({g / (g + totals['new']):.3f}x); gemm + lora serial {totals['serial']:.1f} us "
        f"({g / totals['serial']:.3f}x), shrink overlapped {totals['overlap']:.1f} us "
        f"({g / totals['overlap']:.3f}x)"
    )
    fl, fl_lora = totals["layer"], totals["layer+lora"]
    print(
        f"   fused.layer GEMMs {fl:.1f} us, with the LoRA inside {fl_lora:.1f} us "
        f"({fl / fl_lora:.3f}x); against the GEMMs + serial LoRA: {totals['serial'] / fl_lora:.2f}x"
    )
    fb, fb_lora = totals["layer best"], totals["layer+lora best"]
    print(
        f"   fused.layer GEMMs, each projection's fastest shape: {fb:.1f} us, with the LoRA "
        f"inside {fb_lora:.1f} us ({fb / fb_lora:.3f}x); against cuBLAS + serial LoRA: "
        f"{totals['serial'] / fb_lora:.2f}x; as under lora.shrink_before (each reading the h "
        f"the GEMM before summed, and summing the next one's): {totals['layer+lora summed']:.1f}"
        f" us ({fb / totals['layer+lora summed']:.3f}x); the fastest with the shrink in the K "
        f"loop {totals[ways[0]]:.1f} us ({fb / totals[ways[0]]:.3f}x), shared "
        f"{totals[ways[1]]:.1f} us ({fb / totals[ways[1]]:.3f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--case", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fused", type=int, default=1, help="1: one launch; 0: two")
    parser.add_argument(
        "--tiles",
        nargs="*",
        type=_tiles,
        default=None,
        metavar="BM,BN,BK,SPLIT[,WARPS,STAGES]",
        help="only the GEMM with the default LoRA path, at the default and these launch shapes",
    )
    parser.add_argument(
        "--pack-tiles",
        nargs="*",
        type=_pack_tiles,
        default=None,
        metavar="BM,BN,BK,SPLIT[,WARPS,STAGES]",
        help="the stacked layout (lora_pack and one GEMM) beside the GEMM and the default path, "
        "at the default and these pack launch shapes",
    )
    args = parser.parse_args()
    for name in args.case:
        if args.pack_tiles is not None:
            run_stacked(name, args.pack_tiles, args.iters, args.repeats)
        elif args.tiles is not None:
            run_tiles(name, args.tiles, args.iters, args.repeats)
        else:
            run_case(name, args.iters, args.repeats, bool(args.fused))


if __name__ == "__main__":
    main()
