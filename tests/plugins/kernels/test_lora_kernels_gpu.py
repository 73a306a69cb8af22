"""Multi-LoRA kernels on the GPU at real shapes, eager and captured in a CUDA graph.

Marked ``gpu``: skipped where torch sees no CUDA device (tests/conftest.py). Run on
the H200 with ``pytest -q -m gpu tests/plugins/kernels/test_lora_kernels_gpu.py``.

Shapes: hidden 1024 (qwen3-0.6b) and 4096 (llama3-8b), the merged QKV (three slices
of different widths), the merged gate-up (two) and down_proj (one), rank 16 in 8
slots (two of them at rank 8, zero-padded), T in {1, 16, 256}, rows spread over the
slots and rows without an adapter. The truth is the PyTorch reference
(:mod:`pitstop.plugins.kernels.lora_reference`) run in float64 over the kernels'
own inputs. The graph test captures ``lora_meta`` + shrink + expand once per T and
replays it with new slot assignments written into the same ``slot_of_row`` buffer
(none, one adapter, every row different, random), each replay checked against the
truth, and rows without an adapter checked bit for bit unchanged. ``lora_add`` (the
fused shrink-expand, one launch a projection, and its two-launch path) is checked
beside them, eager and captured.
"""

from __future__ import annotations

import pytest
import torch

from pitstop.plugins.kernels import lora_reference as ref

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
SLOTS, RANK = 8, 16
# hidden -> projection -> (K, slice widths)
SHAPES = {
    1024: {"qkv": (1024, (2048, 1024, 1024)), "gate_up": (1024, (3072, 3072)), "down": (3072, (1024,))},
    4096: {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))},
}  # fmt: skip


def _lora():
    from pitstop.plugins.kernels.triton_ops import lora

    return lora


class Projection:
    """One projection's adapter slots: A and B per slice, ranks (two slots at 8) and scalings."""

    def __init__(self, k: int, widths: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev = "cuda"
        self.k, self.widths, self.dtype = k, widths, dtype
        self.ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device=dev)
        self.ranks[[2, 5]] = 8
        self.A = [
            (torch.randn(SLOTS, RANK, k, generator=g, device=dev) / k**0.5).to(dtype)
            for _ in widths
        ]
        self.B = [
            (torch.randn(SLOTS, n, RANK, generator=g, device=dev) / RANK**0.5).to(dtype)
            for n in widths
        ]
        for s in (2, 5):  # zero-padded beyond the rank, as the loader leaves them
            for a, b in zip(self.A, self.B, strict=True):
                a[s, 8:] = 0
                b[s, :, 8:] = 0
        alphas = torch.tensor([16, 32, 8, 16, 64, 16, 32, 16], dtype=torch.float32, device=dev)
        self.scaling = alphas / self.ranks.float()

    def truth(self, x: torch.Tensor, y0: torch.Tensor, slot_of_row: torch.Tensor) -> torch.Tensor:
        h = ref.lora_shrink(x.double(), [a.double() for a in self.A], slot_of_row, self.ranks)
        y = y0.double().clone()
        b64 = [b.double() for b in self.B]
        return ref.lora_expand_add(y, h, b64, slot_of_row, self.scaling.double(), self.ranks)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(actual).all(), f"{what}: non-finite output"
    delta = (expected - actual.double()).abs().max()
    err = (delta / expected.abs().max().clamp_min(1e-6)).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


def _mixes(rows: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    dev = "cuda"
    return {
        "none": torch.full((rows,), -1, dtype=torch.int32, device=dev),
        "one": torch.full((rows,), 3, dtype=torch.int32, device=dev),
        "every-row": (torch.arange(rows, device=dev) % (SLOTS + 1) - 1).to(torch.int32),
        "random": torch.randint(-1, SLOTS, (rows,), generator=g, device=dev, dtype=torch.int32),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize("proj", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_eager_matches_reference(hidden: int, proj: str, rows: int, dtype: torch.dtype) -> None:
    lora = _lora()
    k, widths = SHAPES[hidden][proj]
    p = Projection(k, widths, dtype)
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    y0 = torch.randn(rows, sum(widths), generator=g, device="cuda").to(dtype)
    for name, slot_of_row in _mixes(rows, g).items():
        meta = lora.lora_meta(slot_of_row, SLOTS)
        h = lora.lora_shrink(x, p.A, slot_of_row, p.ranks, meta=meta)
        y = lora.lora_expand_add(y0.clone(), h, p.B, slot_of_row, p.scaling, p.ranks, meta=meta)
        truth = p.truth(x, y0, slot_of_row)
        _close(y, truth, dtype, f"{name}")
        idle = slot_of_row < 0
        assert torch.equal(y[idle], y0[idle]), f"{name}: rows without an adapter changed"
        for fused in (True, False):  # lora_add: one launch, or shrink + expand without memset
            y = y0.clone()
            lora.lora_add(y, x, p.A, p.B, slot_of_row, p.scaling, p.ranks, meta=meta, fused=fused)
            _close(y, truth, dtype, f"lora_add fused={fused} {name}")
            assert torch.equal(y[idle], y0[idle]), f"{name}: rows without an adapter changed"


@pytest.mark.parametrize("path", ["shrink_expand", "fused"])
@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_graph_replays_new_slot_assignments(hidden: int, rows: int, path: str) -> None:
    lora = _lora()
    dtype = torch.bfloat16
    k, widths = SHAPES[hidden]["qkv"]
    p = Projection(k, widths, dtype, seed=1)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    y_base = torch.randn(rows, sum(widths), generator=g, device="cuda").to(dtype)
    slot_buf = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    meta = lora.new_meta(rows, SLOTS, "cuda")
    h = torch.empty(rows, len(widths) * RANK, dtype=torch.float32, device="cuda")
    y = torch.empty_like(y_base)

    def step() -> None:
        lora.lora_meta(slot_buf, SLOTS, out=meta)
        if path == "fused":
            y.copy_(y_base)
            lora.lora_add(y, x, p.A, p.B, slot_buf, p.scaling, p.ranks, meta=meta, fused=True)
            return
        lora.lora_shrink(x, p.A, slot_buf, p.ranks, meta=meta, out=h)
        y.copy_(y_base)
        lora.lora_expand_add(y, h, p.B, slot_buf, p.scaling, p.ranks, meta=meta)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        for name, slots in _mixes(rows, g).items():
            slot_buf.copy_(slots)
            graph.replay()
            torch.cuda.synchronize()
            _close(y, p.truth(x, y_base, slots), dtype, f"replay {name}")
            idle = slots < 0
            assert torch.equal(y[idle], y_base[idle]), f"{name}: rows without an adapter changed"
