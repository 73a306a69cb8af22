"""The fused MoE op on the GPU at the Qwen3-30B-A3B layer shape, eager and in a CUDA graph.

Marked ``gpu``: skipped where torch sees no CUDA device (tests/conftest.py). Run on the
H200 with ``pytest -q -m gpu tests/plugins/kernels/test_moe_kernels_gpu.py``.

Shape: H 2048, E 128, k 8, F 768, bf16, ``norm_topk_prob`` on (Qwen3-MoE), T in
{1, 16, 256, 2048} (and 1..4 for the three-launch path of issue 48). Truth is
:mod:`moe_reference`'s loop in float64 over the kernel's routing, which must pick the same
experts as ``torch.topk`` (random logits: no ties). The autotune runs for real, into a
temporary cache directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pitstop.plugins.kernels import moe_reference as ref

pytestmark = pytest.mark.gpu

H, E, TOP_K, INTER = 2048, 128, 8, 768
TOL = 2e-2  # max |fused - float64| / max |float64|, bf16 (transformers' own loop: about 1e-2)


@pytest.fixture(scope="module")
def layer() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router weight ``[E, H]``, ``gate_up [E, 2F, H]``, ``down [E, H, F]`` (bf16, on the GPU)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    router = torch.randn(E, H, device="cuda", generator=gen) / H**0.5
    gate_up = torch.randn(E, 2 * INTER, H, device="cuda", generator=gen) / H**0.5
    down = torch.randn(E, H, INTER, device="cuda", generator=gen) / INTER**0.5
    return router.bfloat16(), gate_up.bfloat16(), down.bfloat16()


def _captured(fn: Callable[[], Any]) -> tuple[torch.CUDAGraph, Any]:
    """``fn`` run once on a side stream (as torch's capture wants: its allocations warm), then
    captured in a CUDA graph: the graph and the captured call's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    return graph, captured


def relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Max absolute error over max magnitude; NaN fails."""
    assert torch.isfinite(actual).all(), "an unwritten or NaN output element"
    return ((actual.double() - truth).abs().max() / truth.abs().max()).item()


@pytest.mark.parametrize("mode", ["random", "same"])
@pytest.mark.parametrize("t", [1, 16, 256, 2048])
def test_qwen3_30b_a3b_layer(layer, t: int, mode: str, tmp_path: Path) -> None:
    """fused_moe == the float64 loop; ``same``: every token picks the same 8 experts."""
    from pitstop.plugins.kernels.triton_ops import moe, moe_routing, moe_tiles

    router, gate_up, down = layer
    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
    logits = F.linear(x, router)
    if mode == "same":
        logits[:, 40:48] += 30.0
    cache = moe_tiles.ConfigCache(tmp_path)
    out = moe.fused_moe(
        x, logits, gate_up, down, TOP_K, renormalize=True, weights_dtype=torch.bfloat16, cache=cache
    )
    weights, ids = moe_routing.route(logits, TOP_K, True, torch.bfloat16)
    _, want_ids = ref.route(logits, TOP_K, True, torch.bfloat16)
    assert torch.equal(ids.sort(dim=-1).values.long(), want_ids.sort(dim=-1).values)
    truth = ref.experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    err = relative_error(out, truth)
    hf = relative_error(ref.experts(x, weights, ids, gate_up, down), truth)
    assert err <= TOL, f"T={t} {mode}: fused {err:.3g}, transformers' loop {hf:.3g}"
    assert torch.equal(out, moe.fused_moe(x, logits, gate_up, down, TOP_K, renormalize=True,
                                          weights_dtype=torch.bfloat16, cache=cache))  # fmt: skip
    entries = json.loads((tmp_path / moe_tiles.ConfigCache.FILE).read_text())
    assert list(entries) == [moe_tiles.ConfigCache.key(t, E, TOP_K, H, INTER, torch.bfloat16,
                                                 torch.cuda.get_device_name())]  # fmt: skip


@pytest.mark.parametrize("t", [1, 4, 16, 256])
def test_captured_in_a_cuda_graph(layer, t: int, tmp_path: Path) -> None:
    """Tuned eagerly, then captured: replays over new inputs give the eager bits (T 1 and 4:
    three launches, 16: four, 256: five)."""
    from pitstop.plugins.kernels.triton_ops import moe, moe_tiles

    router, gate_up, down = layer
    cache = moe_tiles.ConfigCache(tmp_path)
    x = torch.randn(t, H, device="cuda").bfloat16()
    logits = F.linear(x, router)

    def run() -> torch.Tensor:
        return moe.fused_moe(x, logits, gate_up, down, TOP_K, renormalize=True,
                             weights_dtype=torch.bfloat16, cache=cache)  # fmt: skip

    run()  # autotune + compile, outside the capture
    graph, captured = _captured(run)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        x.copy_(torch.randn(t, H, device="cuda", generator=gen).bfloat16())
        logits.copy_(F.linear(x, router))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, run())


def test_capture_of_an_untuned_shape_uses_the_heuristic(
    layer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket first seen inside a capture runs the heuristic tiles (logged), and is right."""
    from pitstop.plugins.kernels.triton_ops import moe, moe_tiles

    router, gate_up, down = layer
    t = 16
    x = torch.randn(t, H, device="cuda").bfloat16()
    logits = F.linear(x, router)
    config = moe_tiles.heuristic_config(t, E, TOP_K, torch.bfloat16, True)
    eager = moe.fused_moe(x, logits, gate_up, down, TOP_K, renormalize=True,
                          weights_dtype=torch.bfloat16, config=config)  # fmt: skip
    moe_tiles._logged.discard("capture")
    cache = moe_tiles.ConfigCache(tmp_path)  # empty: nothing tuned
    graph = torch.cuda.CUDAGraph()
    with caplog.at_level(logging.WARNING, logger=moe_tiles.__name__), torch.cuda.graph(graph):
        captured = moe.fused_moe(x, logits, gate_up, down, TOP_K, renormalize=True,
                                 weights_dtype=torch.bfloat16, cache=cache)  # fmt: skip
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert any("CUDA graph capture" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / moe_tiles.ConfigCache.FILE).exists()


@pytest.mark.parametrize("split", [2, 4, 8])
@pytest.mark.parametrize("t", [1, 16, 256])
def test_split_k_at_the_layer_shape(layer, t: int, split: int) -> None:
    """Split-K (issue 48), bf16 and fp8 experts: the float64 loop's answer within the
    bound, the unsplit tiles' within the bound, the same bits on a second run (no atomics),
    and the same bits eagerly and from a CUDA graph."""
    from pitstop.plugins.kernels.triton_ops import moe, moe_routing, moe_tiles
    from pitstop.plugins.weight_formats.fp8 import quantize_rows

    router, gate_up, down = layer
    gen = torch.Generator(device="cuda").manual_seed(1000 + t)
    x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
    logits = F.linear(x, router)
    base = moe_tiles.FEW_ROWS[0]
    weights, ids = moe_routing.route(logits, TOP_K, True, torch.bfloat16)

    def quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
        return q.reshape(w.shape), s.reshape(w.shape[:2]).contiguous()

    (gu8, gu_s), (d8, d_s) = quantized(gate_up), quantized(down)
    for experts, scales, wide in (
        ((gate_up, down), None, (gate_up.double(), down.double())),
        ((gu8, d8), (gu_s, d_s), (gu8.double() * gu_s.double()[..., None],
                                  d8.double() * d_s.double()[..., None])),
    ):  # fmt: skip

        def run(cfg: moe_tiles.MoEConfig, experts=experts, scales=scales) -> torch.Tensor:
            return moe.fused_moe(x, logits, *experts, TOP_K, renormalize=True,
                                 weights_dtype=torch.bfloat16, config=cfg, scales=scales)  # fmt: skip

        truth = ref.experts(x.double(), weights.double(), ids, *wide)
        unsplit, out = run(base), run(base._replace(split_k=split))
        assert relative_error(out, truth) <= TOL, f"split {split}, fp8 {scales is not None}"
        assert ((out.double() - unsplit.double()).abs().max() / truth.abs().max()) <= TOL
        assert torch.equal(out, run(base._replace(split_k=split)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run(base._replace(split_k=split))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)


def test_autotune_at_decode_caches_its_pick(layer, tmp_path: Path) -> None:
    """Batch 1: the autotune times the unsplit decode candidates (splits lost at every
    measured batch) and caches its pick (6 fields)."""
    from pitstop.plugins.kernels.triton_ops import moe, moe_tiles

    router, gate_up, down = layer
    x = torch.randn(1, H, device="cuda").bfloat16()
    logits = F.linear(x, router)
    cache = moe_tiles.ConfigCache(tmp_path)
    moe.fused_moe(x, logits, gate_up, down, TOP_K, renormalize=True,
                  weights_dtype=torch.bfloat16, cache=cache)  # fmt: skip
    (entry,) = json.loads((tmp_path / moe_tiles.ConfigCache.FILE).read_text()).values()
    tuned = moe_tiles.MoEConfig(*entry)
    assert len(entry) == len(moe_tiles.MoEConfig._fields)
    gate_up_tiles = tuned._replace(down_block_n=0, down_block_k=0, down_warps=0, down_stages=0)
    assert gate_up_tiles in moe_tiles.FEW_ROWS
    downs = {c.down for c in moe_tiles.FEW_ROWS if c.block_m == tuned.block_m}
    downs |= {moe_tiles.MoEConfig(tuned.block_m, *d) for d in moe_tiles.DOWN_TILES}
    assert tuned.down in downs
    assert {c.split_k for c in moe_tiles.candidates(1, E, TOP_K, torch.bfloat16)} == {1}


def quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` as e4m3 with a float32 scale per row."""
    from pitstop.plugins.weight_formats.fp8 import quantize_rows

    q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
    return q.reshape(w.shape), s.reshape(w.shape[:2]).contiguous()


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, None])
@pytest.mark.parametrize("mode", ["random", "same"])
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16])
def test_route_and_align_equals_route_then_align(
    layer, t: int, mode: str, weights_dtype: torch.dtype | None
) -> None:
    """Issue 48: the one-launch routing half gives route + align's bits on the GPU too (the
    same routing tiles and warps: the softmax sums reduce in the same order)."""
    from pitstop.plugins.kernels.triton_ops import moe_routing

    router, _, _ = layer
    gen = torch.Generator(device="cuda").manual_seed(2000 + t)
    logits = F.linear(torch.randn(t, H, device="cuda", generator=gen).bfloat16(), router)
    if mode == "same":
        logits[:, 40:48] += 30.0
    for block_m in (16, 64):
        weights, ids, grouping = moe_routing.route_and_align(
            logits, TOP_K, True, weights_dtype, block_m
        )
        want_weights, want_ids = moe_routing.route(logits, TOP_K, True, weights_dtype)
        want = moe_routing.align(want_ids, E, block_m)
        assert torch.equal(ids, want_ids)
        assert torch.equal(weights.view(torch.uint8), want_weights.view(torch.uint8))
        total = int(want.num_padded)
        assert int(grouping.num_padded) == total
        assert torch.equal(grouping.sorted_rows[:total], want.sorted_rows[:total])
        assert torch.equal(grouping.expert_ids, want.expert_ids)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_three_launches_replay_from_a_cuda_graph(layer, t: int, fp8: bool, tmp_path: Path) -> None:
    """Issue 48, batch 1..4: route+align, gate-up, token-major down+sum. The float64 loop's
    answer within the bound, the grouped path's (five launches) within the bound, and,
    captured in a CUDA graph, replays over new inputs give the eager bits."""
    from pitstop.plugins.kernels.triton_ops import moe, moe_routing, moe_tiles

    router, gate_up, down = layer
    scales, wide = None, (gate_up.double(), down.double())
    if fp8:
        (gate_up, gu_s), (down, d_s) = quantized(gate_up), quantized(down)
        scales = (gu_s, d_s)
        wide = (gate_up.double() * gu_s.double()[..., None],
                down.double() * d_s.double()[..., None])  # fmt: skip
    three = moe_tiles.fewest_launches(t, TOP_K)
    assert three.launches == 3
    cache = moe_tiles.ConfigCache(tmp_path)
    gen = torch.Generator(device="cuda").manual_seed(3000 + t)
    x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
    logits = F.linear(x, router)

    def run(plan: moe_tiles.LaunchPlan = three) -> torch.Tensor:
        return moe.fused_moe(x, logits, gate_up, down, TOP_K, renormalize=True,
                             weights_dtype=torch.bfloat16, cache=cache, scales=scales,
                             plan=plan)  # fmt: skip

    out = run()  # autotune + compile, outside the capture
    weights, ids = moe_routing.route(logits, TOP_K, True, torch.bfloat16)
    truth = ref.experts(x.double(), weights.double(), ids, *wide)
    assert relative_error(out, truth) <= TOL
    grouped = run(moe_tiles.GROUPED)
    assert ((out.double() - grouped.double()).abs().max() / truth.abs().max()) <= TOL
    assert torch.equal(out, run())
    graph, captured = _captured(run)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(4000 + seed)
        x.copy_(torch.randn(t, H, device="cuda", generator=gen).bfloat16())
        logits.copy_(F.linear(x, router))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, run())


@pytest.mark.parametrize("fp8", [False, True])
def test_early_down_in_chained_layers_replays_from_a_cuda_graph(
    layer, fp8: bool, tmp_path: Path
) -> None:
    """``LaunchPlan.early_down`` at one token, as a decode step runs it: four sparse layers
    one after another in one CUDA graph, each the one-launch router (the norm inside),
    the gate-up and the early down (its grouping and its weights read before its wait,
    launched as soon as the gate-up's programs start), chained by programmatic dependent
    launch. Each replay over new inputs: every layer's output is the grouped down's on
    that layer's input within the bound, and the eager chain's bits."""
    from pitstop.plugins.kernels.triton_ops import moe, moe_tiles

    router, gate_up, down = layer
    scales = None
    if fp8:
        (gate_up, gu_s), (down, d_s) = quantized(gate_up), quantized(down)
        scales = (gu_s, d_s)
    cache = moe_tiles.ConfigCache(tmp_path)
    x = torch.randn(1, H, device="cuda").bfloat16()

    def sparse(y: torch.Tensor, early: bool) -> torch.Tensor:
        return moe.fused_moe(y, None, gate_up, down, TOP_K, renormalize=True,
                             weights_dtype=torch.bfloat16, cache=cache, scales=scales,
                             router=router, residual=y, norm_eps=1e-6,
                             early_down=early)  # fmt: skip

    def chain() -> list[torch.Tensor]:
        outs = [x]
        for _ in range(4):
            outs.append(sparse(outs[-1], True))
        return outs

    chain()  # autotune + compile, outside the capture
    graph, captured = _captured(chain)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(5000 + seed)
        x.copy_(torch.randn(1, H, device="cuda", generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        for i in range(4):
            grouped = sparse(captured[i].clone(), False)
            diff = (captured[i + 1].double() - grouped.double()).abs().max()
            assert diff / grouped.double().abs().max() <= TOL, f"layer {i}"
        eager = chain()
        assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True))
