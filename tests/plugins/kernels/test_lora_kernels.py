"""Multi-LoRA kernels (triton_ops.lora) and their PyTorch reference against float64 arithmetic.

On a machine without CUDA the kernels run on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton's first import, as in
tests/plugins/kernels/test_fused_kernels.py); with CUDA the same tests run compiled, small shapes
(tests/plugins/kernels/test_lora_kernels_gpu.py has the real ones).

Hypothesis draws the batch (rows, K, slices of different widths at packed or
explicit column offsets, rank_max and each slot's rank, including 0 and
``< rank_max``, split-K) and the mix of slots: all one adapter, none, every row
different, random with repeats and out-of-range values. The truth is a per-row
loop in float64 over the very inputs the kernels read. What must not be written
is poisoned with NaN and checked bit for bit afterwards: y's rows without an
adapter (or whose slot has rank 0) and y's columns outside the slices; the
padding of A and B beyond each slot's rank is NaN too, so a read of it fails.
``lora_add`` (the fused shrink-expand, one launch, and its shrink + expand path for
many rows) is checked the same way on y, and the two paths against each other.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pitstop.plugins.kernels import lora_reference as ref  # noqa: E402

pytest.importorskip("triton")

from pitstop.plugins.kernels.triton_ops import lora, lora_pack  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
DTYPES = list(TOL)
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included)."""
    return a.shape == b.shape and bool((a.view(torch.uint8) == b.view(torch.uint8)).all())


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: {tuple(actual.shape)} != {expected.shape}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite output"
    if actual.numel() == 0:
        return
    scale = expected.abs().max().clamp_min(1e-6)
    err = ((actual.double() - expected).abs().max() / scale).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _slots_mix(draw: st.DrawFn, rows: int, slots: int) -> list[int]:
    mix = draw(st.sampled_from(["one", "none", "distinct", "interleaved", "random"]))
    if mix == "one":
        return [draw(st.integers(0, slots - 1))] * rows
    if mix == "none":
        return [-1] * rows
    if mix == "distinct":  # every row a different slot (or none), as many rows as fit
        values = draw(st.permutations(list(range(-1, slots))))
        return [values[i % len(values)] for i in range(rows)]
    if mix == "interleaved":
        return [(i % (slots + 1)) - 1 for i in range(rows)]
    # random, with repeats; `slots` itself is out of range and must count as -1
    return draw(st.lists(st.integers(-1, slots), min_size=rows, max_size=rows))


@st.composite
def batches(draw: st.DrawFn) -> dict:
    """One projection's LoRA inputs and a batch; see the module docstring."""
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(1, 40))
    k = draw(st.integers(1, 72))
    slots = draw(st.integers(1, 4))
    rank_max = draw(st.sampled_from([1, 4, 8, 16, 20]))
    widths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=lora.MAX_SLICES))
    ranks = draw(st.lists(st.integers(0, rank_max), min_size=slots, max_size=slots))
    lead, gap, tail = draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(0, 5))
    packed = gap == 0 or draw(st.booleans())
    offsets, at = [], lead
    for w in widths:
        offsets.append(at)
        at += w + (0 if packed else gap)
    return {
        "dtype": dtype,
        "rows": rows,
        "k": k,
        "slots": slots,
        "rank_max": rank_max,
        "widths": widths,
        "ranks": ranks,
        "offsets": offsets,
        "packed": packed,
        "n_total": at + tail,
        "slot_of_row": _slots_mix(draw, rows, slots),
        "x_stride_pad": draw(st.sampled_from([0, 3])),
        "per_slice_scaling": draw(st.booleans()),
        "split_k": draw(st.sampled_from([1, 2, 3])),
        "n_loop": draw(st.sampled_from([1, 2, 3, 5])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _make(case: dict) -> dict:
    """Tensors of a drawn case: weights NaN beyond each slot's rank, y NaN where untouched."""
    g = torch.Generator().manual_seed(case["seed"])
    dt, slots, r_max = case["dtype"], case["slots"], case["rank_max"]
    rows, k = case["rows"], case["k"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.5).to(dt)

    ranks = case["ranks"]
    a_list = [rand(slots, r_max, k) for _ in case["widths"]]
    b_list = [rand(slots, w, r_max) for w in case["widths"]]
    for s, r in enumerate(ranks):
        for a in a_list:
            a[s, r:] = float("nan")
        for b in b_list:
            b[s, :, r:] = float("nan")
    x = rand(rows, k + case["x_stride_pad"])[:, :k]  # a row stride wider than K, sometimes
    n_slices = len(case["widths"])
    shape = (slots, n_slices) if case["per_slice_scaling"] else (slots,)
    scaling = torch.rand(*shape, generator=g) * 2
    slot_of_row = torch.tensor(case["slot_of_row"], dtype=torch.int32)
    y0 = rand(rows, case["n_total"])
    active = torch.tensor([0 <= s < slots and ranks[s] > 0 for s in case["slot_of_row"]])
    covered = torch.zeros(case["n_total"], dtype=torch.bool)
    for off, w in zip(case["offsets"], case["widths"], strict=True):
        covered[off : off + w] = True
    y0[~active] = float("nan")
    y0[:, ~covered] = float("nan")
    dev = torch.device(DEVICE)
    return {
        "x": x.to(dev),
        "A": [a.to(dev) for a in a_list],
        "B": [b.to(dev) for b in b_list],
        "ranks": torch.tensor(ranks, dtype=torch.int32, device=dev),
        "scaling": scaling.to(dev),
        "slot_of_row": slot_of_row.to(dev),
        "y0": y0.to(dev),
        "active": active.to(dev),
        "covered": covered.to(dev),
    }


def _truth(case: dict, t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """h and y in float64, one row at a time."""
    r_max, slots = case["rank_max"], case["slots"]
    n_slices = len(case["widths"])
    h = torch.zeros(case["rows"], n_slices * r_max, dtype=torch.float64)
    y = t["y0"].double().cpu().clone()
    scaling = t["scaling"].double().cpu()
    for row, s in enumerate(case["slot_of_row"]):
        if not 0 <= s < slots:
            continue
        r = case["ranks"][s]
        xr = t["x"][row].double().cpu()
        for i, (a, b, off) in enumerate(zip(t["A"], t["B"], case["offsets"], strict=True)):
            hi = a[s, :r].double().cpu() @ xr
            h[row, i * r_max : i * r_max + r] = hi
            scale = scaling[s] if scaling.dim() == 1 else scaling[s, i]
            y[row, off : off + b.shape[1]] += scale * (b[s, :, :r].double().cpu() @ hi)
    return h, y


def _run(mod, case: dict, t: dict, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    slot_kw = {"offsets": case["offsets"]} if not case["packed"] else {"offset": case["offsets"][0]}
    h = mod.lora_shrink(t["x"], t["A"], t["slot_of_row"], t["ranks"], **kwargs)
    y = t["y0"].clone()
    out = mod.lora_expand_add(
        y, h, t["B"], t["slot_of_row"], t["scaling"], t["ranks"], **slot_kw, **kwargs
    )
    assert out is y, "expand works in place and returns y"
    return h, y


def _check(case: dict, t: dict, h: torch.Tensor, y: torch.Tensor, what: str) -> None:
    h_true, y_true = _truth(case, t)
    _close(h.cpu(), h_true, 1e-5, f"{what} h")
    # nothing where it must not be: h zero beyond each rank and for idle rows
    assert bool((h.cpu()[h_true == 0] == 0).all()), f"{what}: h nonzero where it must be zero"
    touched = t["active"][:, None] & t["covered"][None, :]
    assert _same_bits(y[~touched], t["y0"][~touched]), f"{what}: wrote outside its rows/columns"
    _close(y.cpu()[touched.cpu()], y_true[touched.cpu()], TOL[case["dtype"]], f"{what} y")


@FAST
@given(case=batches())
def test_kernels_match_float64(case: dict) -> None:
    t = _make(case)
    cfg = lora.default_config(case["rows"], case["k"], case["dtype"], torch.device(DEVICE))
    cfg = cfg._replace(split_k=case["split_k"])
    h, y = _run(lora, case, t, config=cfg)
    _check(case, t, h, y, "triton")


@settings(max_examples=15, deadline=None)
@given(case=batches())
def test_reference_matches_float64(case: dict) -> None:
    t = _make(case)
    h, y = _run(ref, case, t)
    _check(case, t, h, y, "reference")


@settings(max_examples=25, deadline=None)
@given(
    slot_of_row=st.lists(st.integers(-3, 6), min_size=0, max_size=90),
    slots=st.integers(1, 5),
    spare=st.integers(0, 7),
)
def test_meta_groups_rows_by_slot(slot_of_row: list[int], slots: int, spare: int) -> None:
    """Each slot's segment holds exactly its rows in row order; -1 and out-of-range: nowhere."""
    s = torch.tensor(slot_of_row, dtype=torch.int32, device=DEVICE)
    out = lora.new_meta(len(slot_of_row) + spare, slots + 1, DEVICE)  # static, oversized
    meta = lora.lora_meta(s, slots, out=out)
    assert meta is out
    start, length = meta.seg_start.cpu().tolist(), meta.seg_len.cpu().tolist()
    rows = meta.sorted_rows.cpu().tolist()
    at = 0
    for slot in range(slots):
        mine = [i for i, v in enumerate(slot_of_row) if v == slot]
        assert (start[slot], length[slot]) == (at, len(mine))
        assert rows[at : at + len(mine)] == mine
        at += len(mine)


def test_full_rank_shared_meta_and_static_buffers() -> None:
    """``ranks=None`` (every slot at rank_max), one meta for both launches, ``out=`` prefilled."""
    g = torch.Generator().manual_seed(3)
    dt, rows, k, r_max, slots = torch.bfloat16, 19, 33, 8, 3
    x = torch.randn(rows, k, generator=g).to(dt).to(DEVICE)
    a = [torch.randn(slots, r_max, k, generator=g).to(dt).to(DEVICE) for _ in range(2)]
    b = [torch.randn(slots, w, r_max, generator=g).to(dt).to(DEVICE) for w in (24, 8)]
    slot_of_row = torch.tensor([i % 4 - 1 for i in range(rows)], dtype=torch.int32, device=DEVICE)
    scaling = torch.tensor([0.5, 2.0, 1.0], device=DEVICE)
    meta = lora.lora_meta(slot_of_row, slots, out=lora.new_meta(64, slots, DEVICE))
    h_out = torch.full((rows, 2 * r_max), float("nan"), device=DEVICE)
    h = lora.lora_shrink(x, a, slot_of_row, meta=meta, out=h_out)
    assert h is h_out
    y = torch.randn(rows, 32, generator=g).to(dt).to(DEVICE)
    y_ref = y.clone()
    lora.lora_expand_add(y, h, b, slot_of_row, scaling, meta=meta)
    h_ref = ref.lora_shrink(x, a, slot_of_row)
    ref.lora_expand_add(y_ref, h_ref, b, slot_of_row, scaling)
    _close(h.cpu(), h_ref.double().cpu(), 1e-5, "h")
    _close(y.cpu(), y_ref.double().cpu(), TOL[dt], "y")
    idle = (slot_of_row == -1).cpu()
    assert bool((h.cpu()[idle] == 0).all())


@pytest.mark.parametrize("split_k", [1, 3])
def test_shrink_into_a_zeroed_workspace_block(split_k: int) -> None:
    """``zeroed=True`` (the plugin's workspace, zeroed once a step for every projection):
    the shrink writes its block of a wider, strided buffer without clearing it first, the
    other blocks untouched, and the expand reads it: as with a fresh intermediate, split K too."""
    g = torch.Generator().manual_seed(4)
    dt, rows, k, r_max, slots = torch.float32, 21, 40, 8, 2
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    a = [torch.randn(slots, r_max, k, generator=g).to(DEVICE) for _ in range(2)]
    b = [torch.randn(slots, w, r_max, generator=g).to(DEVICE) for w in (16, 8)]
    slot_of_row = torch.tensor([i % 3 - 1 for i in range(rows)], dtype=torch.int32, device=DEVICE)
    scaling = torch.tensor([0.5, 2.0], device=DEVICE)
    workspace = torch.full((32, 3, 3 * r_max), 7.0, device=DEVICE)  # 3 projections' blocks
    workspace[:rows].zero_()
    block = workspace[:rows, 1, : 2 * r_max]
    config = lora.default_config(rows, k, dt, x.device)._replace(split_k=split_k)
    h = lora.lora_shrink(x, a, slot_of_row, out=block, zeroed=True, config=config)
    assert h.data_ptr() == block.data_ptr() and h.stride(0) == 3 * 3 * r_max
    y = torch.randn(rows, 24, generator=g).to(DEVICE)
    y_ref = y.clone()
    lora.lora_expand_add(y, h, b, slot_of_row, scaling)
    ref.lora_expand_add(y_ref, ref.lora_shrink(x, a, slot_of_row), b, slot_of_row, scaling)
    _close(y.cpu(), y_ref.double().cpu(), TOL[dt], "y")
    assert bool((workspace[:rows, 0] == 0).all()) and bool((workspace[:rows, 2] == 0).all())
    assert bool((workspace[rows:] == 7.0).all())  # past the step's rows: never written


def test_meta_over_a_longer_buffer_serves_any_batch_within_it() -> None:
    """The ``lora`` plugin groups its whole static ``slot_of_row`` buffer once a step (rows
    past the step's are -1) and hands that meta to every launch, whatever the launch's row
    count (a captured graph's batch): the same results as grouping the launch's rows."""
    g = torch.Generator().manual_seed(4)
    slots, r_max, k, n = 3, 4, 32, 24
    buffer = torch.full((64,), -1, dtype=torch.int32)
    buffer[:10] = torch.tensor([0, 2, -1, 1, 0, 0, 2, -1, 1, 0], dtype=torch.int32)
    buffer = buffer.to(DEVICE)
    meta = lora.lora_meta(buffer, slots, out=lora.new_meta(64, slots, DEVICE))
    ranks = torch.tensor([4, 2, 3], dtype=torch.int32, device=DEVICE)
    scaling = torch.tensor([0.5, 1.0, 2.0], device=DEVICE)
    a = torch.randn(slots, r_max, k, generator=g).to(DEVICE)
    b = torch.randn(slots, n, r_max, generator=g).to(DEVICE)
    for rows in (10, 16):
        x = torch.randn(rows, k, generator=g).to(DEVICE)
        shared = lora.lora_shrink(x, a, buffer[:rows], ranks, meta=meta)
        own = lora.lora_shrink(x, a, buffer[:rows], ranks)
        assert torch.equal(shared, own)
        y = torch.randn(rows, n, generator=g).to(DEVICE)
        y_own = y.clone()
        lora.lora_expand_add(y, shared, b, buffer[:rows], scaling, ranks, meta=meta)
        lora.lora_expand_add(y_own, own, b, buffer[:rows], scaling, ranks)
        assert torch.equal(y, y_own)


def _run_add(mod, case: dict, t: dict, **kwargs) -> torch.Tensor:
    slot_kw = {"offsets": case["offsets"]} if not case["packed"] else {"offset": case["offsets"][0]}
    y = t["y0"].clone()
    args = (t["x"], t["A"], t["B"], t["slot_of_row"], t["scaling"], t["ranks"])
    out = mod.lora_add(y, *args, **slot_kw, **kwargs)
    assert out is y, "lora_add works in place and returns y"
    return y


def _check_y(case: dict, t: dict, y: torch.Tensor, what: str) -> None:
    _, y_true = _truth(case, t)
    touched = t["active"][:, None] & t["covered"][None, :]
    assert _same_bits(y[~touched], t["y0"][~touched]), f"{what}: wrote outside its rows/columns"
    _close(y.cpu()[touched.cpu()], y_true[touched.cpu()], TOL[case["dtype"]], f"{what} y")


@FAST
@given(case=batches())
def test_fused_add_matches_float64_and_the_two_launches(case: dict) -> None:
    """``lora_add``'s one launch (every slice, the intermediate in registers) against the
    float64 truth, and its shrink + expand path (``fused=False``) against the same; through
    the interpreter, with the same tiles, the two are equal bit for bit (the same sums in
    the same order: the fused kernel's shrink is ``split_k=1``'s). ``n_loop``: column tiles
    per program (groups that end inside a slice, or past its last column)."""
    t = _make(case)
    cfg = lora.fused_config(
        case["rows"], case["k"], case["widths"], case["dtype"], torch.device(DEVICE)
    )
    fused = _run_add(lora, case, t, fused=True, config=cfg._replace(n_loop=case["n_loop"]))
    _check_y(case, t, fused, "fused")
    two = _run_add(lora, case, t, fused=False)
    _check_y(case, t, two, "shrink+expand")
    if DEVICE == "cpu":
        assert _same_bits(fused, two), "fused and shrink+expand differ"


# slots 0 (rank 16), 3 (9), 2 (5), 1 (0: empty); -1 and 4, 5 (out of range): no adapter
MIX = [3, -1, 0, 4, 2, 1, 0, 5, 3, -1, 2, 0]


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_mixed_slots_rows_and_ranks(rows: int, dtype: torch.dtype) -> None:
    """Row counts at and across the row tile, q|k|v slices of different widths (each wider
    than a column tile), slots of rank 0 (empty), below rank_max and at it, rows of no
    adapter and of an out-of-range slot, per-slice scaling."""
    widths = [40, 24, 17]
    case = {
        "dtype": dtype,
        "rows": rows,
        "k": 70,
        "slots": 4,
        "rank_max": 16,
        "widths": widths,
        "ranks": [16, 0, 5, 9],
        "offsets": [0, 40, 64],
        "packed": True,
        "n_total": sum(widths),
        "slot_of_row": [MIX[i % len(MIX)] for i in range(rows)],
        "x_stride_pad": 3,
        "per_slice_scaling": True,
        "split_k": 1,
        "seed": rows,
    }
    t = _make(case)
    _check_y(case, t, _run_add(lora, case, t), "fused")
    cfg = lora.fused_config(rows, 70, widths, dtype, torch.device(DEVICE))._replace(n_loop=2)
    _check_y(case, t, _run_add(lora, case, t, config=cfg), "fused, 2 column tiles a program")
    _check_y(case, t, _run_add(ref, case, t), "reference")


@pytest.mark.parametrize("fused", [True, False])
def test_many_slots_whose_segments_span_several_row_tiles(fused: bool) -> None:
    """Twenty slots (more than the 16 lanes :func:`lora._tile_of` reads at least), segments
    of 0 to 40 rows (up to three row tiles of 16 each, interleaved in the batch), a slot of
    rank 0 among them and rows of no adapter: each row tile of the compact row axis finds
    its slot, and the launch has ``row_tiles`` row programs, not row tiles x slots."""
    import triton

    slots, rows = 20, 150
    lengths = [(7 * s) % 41 for s in range(slots)]  # 0, 7, 14, ..., 40, 6, 13, ...
    slot_of_row = [s for s in range(slots) for _ in range(lengths[s])][:rows]
    slot_of_row += [-1] * (rows - len(slot_of_row))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(3)).tolist()
    widths = [40, 24]
    case = {
        "dtype": torch.float32,
        "rows": rows,
        "k": 36,
        "slots": slots,
        "rank_max": 8,
        "widths": widths,
        "ranks": [0 if s == 4 else 1 + s % 8 for s in range(slots)],
        "offsets": [0, 40],
        "packed": True,
        "n_total": sum(widths),
        "slot_of_row": [slot_of_row[i] for i in order],
        "x_stride_pad": 0,
        "per_slice_scaling": False,
        "split_k": 1,
        "seed": 11,
    }
    t = _make(case)
    grids: list[tuple[int, ...]] = []
    get_item = triton.runtime.jit.KernelInterface.__getitem__

    def recorded(kernel, grid):
        grids.append(tuple(grid))
        return get_item(kernel, grid)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton.runtime.jit.KernelInterface, "__getitem__", recorded)
        y = _run_add(lora, case, t, fused=fused)
    _check_y(case, t, y, f"fused={fused}")
    block_m = lora.INTERPRETER_TILES[0] if DEVICE == "cpu" else None
    if block_m is not None:
        launches = [g for g in grids if len(g) == 2]
        assert launches and all(g[0] == lora.row_tiles(rows, slots, block_m) for g in launches)


@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=40),
    block_m=st.sampled_from([1, 16, 32, 64]),
)
def test_row_tiles_cover_every_mix(lengths: list[int], block_m: int) -> None:
    """However the rows split among the slots, their tiles fit the row axis."""
    tiles = sum(-(-n // block_m) for n in lengths)
    assert tiles <= lora.row_tiles(sum(lengths), len(lengths), block_m)


@settings(max_examples=10, deadline=None)
@given(case=batches())
def test_reference_add_matches_float64(case: dict) -> None:
    t = _make(case)
    _check_y(case, t, _run_add(ref, case, t), "reference")


def test_lora_add_picks_the_path_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``FUSED_MAX_ROWS`` rows one launch of the fused kernel; above it the shrink and
    the expand (no memset of the intermediate either way); ``fused=`` overrides the rule."""
    import triton

    launched: list[str] = []
    get_item = triton.runtime.jit.KernelInterface.__getitem__

    def counted(kernel, grid):
        launch = get_item(kernel, grid)

        def run(*args, **kwargs):
            launched.append(kernel.fn.__name__)
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(triton.runtime.jit.KernelInterface, "__getitem__", counted)
    monkeypatch.setattr(lora, "FUSED_MAX_ROWS", 8)
    g = torch.Generator().manual_seed(9)
    slots, r_max, k = 2, 8, 24
    a = [torch.randn(slots, r_max, k, generator=g).to(DEVICE) for _ in range(2)]
    b = [torch.randn(slots, w, r_max, generator=g).to(DEVICE) for w in (20, 12)]
    scaling = torch.tensor([0.5, 2.0], device=DEVICE)
    for rows, fused, want in [
        (8, None, ["_fused_kernel"]),
        (9, None, ["_shrink_kernel", "_expand_kernel"]),
        (9, True, ["_fused_kernel"]),
        (3, False, ["_shrink_kernel", "_expand_kernel"]),
    ]:
        x = torch.randn(rows, k, generator=g).to(DEVICE)
        slot_of_row = torch.tensor([i % 3 - 1 for i in range(rows)], dtype=torch.int32)
        slot_of_row = slot_of_row.to(DEVICE)
        meta = lora.lora_meta(slot_of_row, slots)
        y = torch.randn(rows, 32, generator=g).to(DEVICE)
        y_ref = ref.lora_add(y.clone(), x, a, b, slot_of_row, scaling)
        launched.clear()
        lora.lora_add(y, x, a, b, slot_of_row, scaling, meta=meta, fused=fused)
        assert launched == want, f"{rows} rows, fused={fused}"
        _close(y.cpu(), y_ref.double().cpu(), 1e-5, f"{rows} rows, fused={fused}")


def test_scaling_of() -> None:
    assert ref.scaling_of(32, 16) == 2.0
    assert ref.scaling_of(32, 16, use_rslora=True) == 8.0


@st.composite
def packs(draw: st.DrawFn) -> dict:
    """The stacked layout's inputs: rows, K, slots, a slot's width (slices x rank), the mix."""
    rows, slots = draw(st.integers(1, 40)), draw(st.integers(1, 4))
    return {
        "dtype": draw(st.sampled_from(DTYPES)),
        "rows": rows,
        "k": draw(st.integers(1, 72)),
        "slots": slots,
        "width": draw(st.sampled_from([1, 8, 12, 48])),
        "slot_of_row": _slots_mix(draw, rows, slots),
        "x_stride_pad": draw(st.sampled_from([0, 5])),
        "split_k": draw(st.sampled_from([1, 2, 3])),
        "seed": draw(st.integers(0, 2**16)),
    }


@given(case=packs())
@FAST
def test_pack_matches_float64(case: dict) -> None:
    """``lora_pack`` (Triton) and its reference write ``[x | h']``: x copied bit for bit, h'
    the float64 truth of each row's scaled product in its own slot's columns and exactly
    zero elsewhere (rows without an adapter, out-of-range slots, other slots' columns)."""
    g = torch.Generator().manual_seed(case["seed"])
    dt, rows, k, slots, width = (case[n] for n in ("dtype", "rows", "k", "slots", "width"))
    e = slots * width
    x_full = (torch.randn(rows, k + case["x_stride_pad"], generator=g) * 0.5).to(dt)
    x = x_full[:, :k].to(DEVICE)
    a_all = (torch.randn(e, k, generator=g) * 0.5).to(dt).to(DEVICE)
    scaling = (torch.rand(slots, generator=g) + 0.5).to(DEVICE)
    slot_of_row = torch.tensor(case["slot_of_row"], dtype=torch.int32, device=DEVICE)
    truth = torch.zeros(rows, e, dtype=torch.float64)
    for t, s in enumerate(case["slot_of_row"]):
        if 0 <= s < slots:
            cols = slice(s * width, (s + 1) * width)
            product = x[t].cpu().double() @ a_all[cols].cpu().double().T
            truth[t, cols] = product * scaling[s].cpu().double()
    bm, bn, bk = lora_pack.INTERPRETER_TILES  # small tiles on the GPU too: splits cross tiles
    tiles = lora_pack.PackTiles(bm, bn, bk, case["split_k"])
    workspace = lora_pack.pack_workspace(rows, e, torch.device(DEVICE))
    # unsplit, the op is given no workspace (it passes placeholders the kernel never touches)
    given = workspace if case["split_k"] > 1 else None
    for op, kw in ((lora.lora_pack, {"tiles": tiles, "workspace": given}), (ref.lora_pack, {})):
        for _ in range(2):  # the split launch leaves its workspace and counters clear for the next
            out = torch.full((rows, k + e), float("nan"), dtype=dt, device=DEVICE)
            p = op(x, a_all, slot_of_row, scaling, width, out=out, **kw)
            assert p.data_ptr() == out.data_ptr()
            assert _same_bits(p[:, :k].cpu(), x.cpu().contiguous()), "x copied exactly"
            h = p[:, k:].cpu()
            assert _same_bits(h[truth == 0], torch.zeros_like(h[truth == 0])), "zero: no slot"
            _close(h, truth, TOL[dt], f"h' ({op.__module__})")
    assert not workspace[0].any() and not workspace[1].any(), "workspace left clear"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 256, 1030, 2048])
@pytest.mark.parametrize("slots", [1, 8])
def test_on_the_gpu_pack_at_its_own_launch_shapes(
    dtype: torch.dtype, rows: int, slots: int
) -> None:
    """``lora_pack`` at the launch shapes :func:`lora_pack.pack_tiles` picks on CUDA for
    qwen3-0.6b's q|k|v (K 1,024, rank 16: 48 columns a slot): decode's small tiles with K
    split (1 and 256 rows) and a prefill chunk's wide tiles of 8 warps (from
    ``LARGE_ROWS``: 64 or 128 columns of h' as E is narrow or wide). x copied bit for bit, h'
    the float64 truth in each row's own slot and zero elsewhere."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(rows * 10 + slots)
    k, width = 1024, 48
    e = slots * width
    x = (torch.randn(rows, k, generator=g) * 0.5).to(dtype)
    a_all = (torch.randn(e, k, generator=g) * 0.05).to(dtype)
    scaling = torch.rand(slots, generator=g) + 0.5
    slot_of_row = torch.randint(-1, slots, (rows,), generator=g, dtype=torch.int32)
    truth = torch.zeros(rows, e, dtype=torch.float64)
    for s in range(slots):
        mine = slot_of_row == s
        cols = slice(s * width, (s + 1) * width)
        truth[mine, cols] = (x[mine].double() @ a_all[cols].double().T) * float(scaling[s])
    tiles = lora_pack.pack_tiles(rows, e, k, dtype, torch.device("cuda"))
    assert (tiles.block_m, tiles.num_warps) == (
        (64, 8) if rows >= lora_pack.LARGE_ROWS else (16, 4)
    )
    p = lora.lora_pack(x.cuda(), a_all.cuda(), slot_of_row.cuda(), scaling.cuda(), width)
    assert _same_bits(p[:, :k].cpu(), x), "x copied exactly"
    h = p[:, k:].cpu()
    assert _same_bits(h[truth == 0], torch.zeros_like(h[truth == 0])), "zero: no slot"
    _close(h, truth, TOL[dtype], f"h' at {tiles}")
