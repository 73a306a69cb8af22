"""A LoRA delta inside fused_linear's GEMMs (``lora=``): against float64 arithmetic.

Each token row ``t`` of slot ``s`` (``slot_of_row[t]``, -1: none) gets
``scaling[s] * B_s (A_s x_t)`` added to its accumulator, per slice (q|k|v: a column
tile's slice; gate|up: both), before the row scale, bias, SiLU·mul or residual. Drawn by
Hypothesis: the rows' slots (one adapter for the whole tile, several in one tile, rows
without any, slots of smaller ranks), the shapes, the dtype and the K split (each split's
shrink summed by the last program). The reference is the formula in float64 over the very
inputs the kernel reads. Triton's interpreter runs the kernels on a machine without CUDA
(set before Triton's first import, as in test_fused_linear.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from helpers.poison import poisoned_outputs  # noqa: E402

from pitstop.plugins.kernels.lora_reference import ProjectionLoRA  # noqa: E402
from pitstop.plugins.kernels.triton_ops import fused_linear as fl  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
FEW = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SLOTS, RANK_MAX = 3, 8
SM90_SHARED_BYTES = 232_448  # the most shared memory one program may have on sm_90 (227 KiB)
TILE_N = 16  # the interpreter's (and the configs below) column tile


def _unused(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the fused GEMM must not call the plugin's own delta")


def make_lora(
    k: int, widths: list[int], slots: list[int], dtype, seed: int, n_slots=SLOTS, rank_max=RANK_MAX
) -> ProjectionLoRA:
    """Random slots of ranks ``rank_max``, ``rank_max - 3``, ``rank_max - 6``, ... (padding
    zero, as the plugin loads them); ``slots``: each row's slot (-1: none), in a static buffer
    longer than M."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.tensor(
        [max(1, rank_max - 3 * (s % 3)) for s in range(n_slots)], dtype=torch.int32
    )
    a_list, b_list = [], []
    for w in widths:
        a = torch.randn(n_slots, rank_max, k, generator=gen) / k**0.5
        b = torch.randn(n_slots, w, rank_max, generator=gen)
        for s, r in enumerate(ranks.tolist()):
            a[s, r:] = 0
            b[s, :, r:] = 0
        a_list.append(a.to(DEVICE, dtype))
        b_list.append(b.to(DEVICE, dtype))
    buf = torch.full((len(slots) + 7,), -1, dtype=torch.int32)
    buf[: len(slots)] = torch.tensor(slots, dtype=torch.int32)
    scaling = torch.tensor([(2.0, 0.5, 1.5)[s % 3] for s in range(n_slots)], dtype=torch.float32)
    return ProjectionLoRA(
        tuple(a_list), tuple(b_list), buf.to(DEVICE), scaling.to(DEVICE), ranks.to(DEVICE), _unused
    )


def deltas(x: torch.Tensor, lora: ProjectionLoRA) -> list[torch.Tensor]:
    """float64 ``scaling[s] * x_t A_s^T B_s^T`` per slice, zero for rows without a slot."""
    out = []
    for a, b in zip(lora.A, lora.B, strict=True):
        d = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64, device=x.device)
        for t in range(x.shape[0]):
            s = int(lora.slot_of_row[t])
            if s >= 0:
                h = a[s].double() @ x[t].double()
                d[t] = float(lora.scaling[s]) * (b[s].double() @ h)
        out.append(d)
    return out


def rstd(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    if eps is None:
        return torch.ones(x.shape[0], 1, dtype=torch.float64, device=x.device)
    xd = x.double()
    return 1.0 / torch.sqrt((xd * xd).mean(dim=1, keepdim=True) + eps)


def assert_close(actual, expected, dtype, what: str, plain=None) -> None:
    assert torch.isfinite(actual).all(), f"{what}: non-finite output"
    scale = expected.abs().max().clamp_min(1e-6)
    err = ((actual.double() - expected).abs().max() / scale).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g}"
    if plain is not None:  # the delta is large enough to fail a kernel that dropped it
        miss = ((plain.double() - expected).abs().max() / scale).item()
        assert miss > 20 * TOL[dtype], f"{what}: the delta ({miss:.3g}) is too small to test"


slot_mixes = st.sampled_from(["one", "mixed", "none-and-one", "lead-not-first"])


def draw_slots(kind: str, m: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "one":
        return [1] * m
    if kind == "none-and-one":
        return [2 if bool(torch.rand(1, generator=gen) < 0.5) else -1 for _ in range(m)]
    if kind == "lead-not-first":  # the tile's largest slot is not its first row's
        return [(0, -1, 2, 1)[i % 4] for i in range(m)]
    return torch.randint(-1, SLOTS, (m,), generator=gen).tolist()


common = dict(
    m=st.integers(1, 36),
    k=st.sampled_from([24, 64, 130]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    split=st.sampled_from([1, 2, 3]),
    mix=slot_mixes,
    seed=st.integers(0, 2**16),
)


def inputs(m: int, n: int, k: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(m, k, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = (0.5 * torch.randn(n, generator=gen)).to(DEVICE, dtype)
    return x, w, b


@FEW
@given(eps=st.sampled_from([1e-6, None]), with_bias=st.booleans(), **common)
def test_qkv_slices_match_float64(m, k, dtype, split, mix, seed, eps, with_bias) -> None:
    """Three slices on tile borders (q 32, k 16, v 16 columns), each tile its slice's A, B."""
    widths = [2 * TILE_N, TILE_N, TILE_N]
    x, w, b = inputs(m, sum(widths), k, dtype, seed)
    bias = b if with_bias else None
    lora = make_lora(k, widths, draw_slots(mix, m, seed), dtype, seed)
    cfg = fl.LinearConfig(16, TILE_N, 32, split, 1, 1)
    with poisoned_outputs():
        out = fl.norm_linear(x, w, eps, bias, config=cfg, lora=lora)
    plain = fl.norm_linear(x, w, eps, bias, config=cfg)
    d = torch.cat(deltas(x, lora), dim=1)
    want = rstd(x, eps) * (x.double() @ w.double().T + d)
    want = want if bias is None else want + bias.double()
    has = any(s >= 0 for s in lora.slot_of_row[:m].tolist())
    assert_close(out, want, dtype, f"qkv {mix}", plain if has else None)


@FEW
@given(**common)
def test_gate_up_slices_match_float64(m, k, dtype, split, mix, seed) -> None:
    """Gate and up each take their own delta, before the row scale and SiLU·mul."""
    f, eps = 24, 1e-6
    x, w, _ = inputs(m, 2 * f, k, dtype, seed)
    lora = make_lora(k, [f, f], draw_slots(mix, m, seed), dtype, seed)
    cfg = fl.LinearConfig(16, TILE_N, 32, split, 1, 1)
    with poisoned_outputs():
        out = fl.norm_gate_up(x, w, eps, config=cfg, lora=lora)
    dg, du = deltas(x, lora)
    scale = rstd(x, eps)
    g = scale * (x.double() @ w[:f].double().T + dg)
    u = scale * (x.double() @ w[f:].double().T + du)
    assert_close(out, g / (1.0 + torch.exp(-g)) * u, dtype, f"gate_up {mix}")


@FEW
@given(n=st.integers(1, 40), **common)
def test_residual_writer_matches_float64(n, m, k, dtype, split, mix, seed) -> None:
    """One slice of any width (the last tile partial), added before the residual."""
    x, w, _ = inputs(m, n, k, dtype, seed)
    residual = (2 * torch.randn(m, n, generator=torch.Generator().manual_seed(seed))).to(
        DEVICE, dtype
    )
    lora = make_lora(k, [n], draw_slots(mix, m, seed), dtype, seed)
    cfg = fl.LinearConfig(16, TILE_N, 32, split, 1, 1)
    with poisoned_outputs():
        out = fl.linear_residual(x, w, residual, config=cfg, lora=lora)
    want = residual.double() + x.double() @ w.double().T + deltas(x, lora)[0]
    assert_close(out, want, dtype, f"residual {mix}")
    assert bool((fl.workspace(DEVICE).counters == 0).all()), "split-K counters back at zero"


def test_slices_off_tile_borders_are_refused() -> None:
    """q 24 columns with 16-column tiles would put q and k in one tile: not taken."""
    lora = make_lora(32, [24, 8], [0], torch.float32, 0)
    assert not fl.lora_fits(lora, False, 16)
    assert fl.lora_fits(lora, False, 8)
    x, w, _ = inputs(1, 32, 32, torch.float32, 0)
    with pytest.raises(AssertionError, match="do not fit 16-column tiles"):
        fl.norm_linear(x, w, None, config=fl.LinearConfig(16, 16, 32, 1, 1, 1), lora=lora)


def every_lora_shape_matches_float64(
    m: int, slots: list[int], dtype, layer: tuple[list[int], int, int, int], n_slots: int, what: str
) -> list[fl.LinearConfig]:
    """Every launch shape the fused layer times with an adapter (:func:`fl.tile_candidates`)
    for a layer ``(q|k|v widths, hidden K, intermediate F, down's width N)``, rank 16, rows
    in ``slots``: q|k|v, gate-up and the residual writer (down) each against float64, every
    shape keeping the slices apart. Returns the q|k|v shapes."""
    widths, k, f, n = layer
    eps, sms = 1e-6, fl.num_sms(DEVICE)
    x, w, _ = inputs(m, sum(widths), k, dtype, m)
    lora = make_lora(k, widths, slots, dtype, m, n_slots=n_slots, rank_max=16)
    want = rstd(x, eps) * (x.double() @ w.double().T + torch.cat(deltas(x, lora), dim=1))
    qkv_shapes = fl.tile_candidates(m, sum(widths), k, torch.bfloat16, False, sms, lora_rank=16)
    for cfg in qkv_shapes:
        assert fl.lora_fits(lora, False, cfg.block_n), cfg
        out = fl.norm_linear(x, w, eps, config=cfg, lora=lora)
        assert_close(out, want, dtype, f"qkv {what} {cfg}")
    x, w, _ = inputs(m, 2 * f, k, dtype, m + 1)
    lora = make_lora(k, [f, f], slots, dtype, m + 1, n_slots=n_slots, rank_max=16)
    dg, du = deltas(x, lora)
    g = rstd(x, eps) * (x.double() @ w[:f].double().T + dg)
    u = rstd(x, eps) * (x.double() @ w[f:].double().T + du)
    for cfg in fl.tile_candidates(m, f, k, torch.bfloat16, True, sms, lora_rank=16):
        out = fl.norm_gate_up(x, w, eps, config=cfg, lora=lora)
        assert_close(out, g / (1.0 + torch.exp(-g)) * u, dtype, f"gate_up {what} {cfg}")
    x, w, _ = inputs(m, n, f, dtype, m + 2)
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    lora = make_lora(f, [n], slots, dtype, m + 2, n_slots=n_slots, rank_max=16)
    want = residual.double() + x.double() @ w.double().T + deltas(x, lora)[0]
    for cfg in fl.tile_candidates(m, n, f, torch.bfloat16, False, sms, lora_rank=16):
        out = fl.linear_residual(x, w, residual, config=cfg, lora=lora)
        assert_close(out, want, dtype, f"down {what} {cfg}")
    assert bool((fl.workspace(DEVICE).counters == 0).all()), "split-K counters back at zero"
    return qkv_shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("m", [1, 5, 16, 64, 200])
def test_real_shapes_on_the_gpu(m: int) -> None:
    """qwen3-0.6b's layer (q|k|v 2048|1024|1024 and gate-up 2 x 3072 over K 1,024, down over
    K 3,072), rank 16, bf16, every launch shape the fused layer times with an adapter
    (split K at few rows, the wide tiles at 200): one adapter for every row, then four mixed
    with rows of the base model."""
    for mix in ("one", "mixed"):
        slots = [1] * m if mix == "one" else [(s % 5) - 1 for s in range(m)]
        layer = ([2048, 1024, 1024], 1024, 3072, 1024)
        every_lora_shape_matches_float64(m, slots, torch.bfloat16, layer, 4, mix)


class _TimedHere:
    """A LayerChoice that 'times' on the CPU: cuBLAS (timed first) 2 ms, every Triton shape 1."""

    @staticmethod
    def make(directory):  # noqa: ANN001, ANN205
        from pitstop.plugins.kernels.triton_ops.layer_choice import LayerChoice

        class Choice(LayerChoice):
            def can_time(self, x: torch.Tensor) -> bool:
                return True

            def device_name(self, x: torch.Tensor) -> str:
                return "Fake GPU"

            def capturing(self) -> bool:
                return False

        calls = []

        def timer(fn, n: int) -> float:  # noqa: ANN001
            fn()
            calls.append(fn)
            return 2.0 if len(calls) == 1 else 1.0

        return Choice(4, 64, True, directory, timer=timer)


def test_the_fused_layer_times_a_lora_inside_under_its_own_key(tmp_path) -> None:  # noqa: ANN001
    """``FusedLayer`` with ``lora=``: the timed choice keys the op ``…+lora``, times only the
    shapes whose tiles keep the slices apart, checks Triton against the reference plus the
    plugin's delta, and gives the reference's result; slices off every tile border take
    cuBLAS and the plugin's own delta, untimed, and so do rows that may mix adapters in a
    tile (several rows, several slots). The timing calls the delta's repeatable
    ``add_again``, never the step's ``add`` (its workspace is cleared once a step), which
    runs at most once, for the op itself."""

    from pitstop.plugins.kernels import reference
    from pitstop.plugins.kernels.fused_layer import FusedLayer

    if DEVICE.type == "cuda":
        pytest.skip("times on the CPU with a fake timer")
    eps, m, k = 1e-6, 5, 64
    x, w, _ = inputs(m, 64, k, torch.float32, 3)
    added: list[int] = []  # the step's add
    again: list[int] = []  # the repeatable one

    def with_add(made: ProjectionLoRA) -> ProjectionLoRA:
        def counted(calls: list[int]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
            def add(x_rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                calls.append(x_rows.shape[0])
                y += torch.cat(deltas(x_rows, made), dim=1).to(y.dtype)
                return y

            return add

        return made._replace(add=counted(added), add_again=counted(again))

    def row_scaled(rows: torch.Tensor, eps_: float | None) -> torch.Tensor:
        return rows if eps_ is None else (rows * reference.rms_scale(rows, eps_)).to(rows.dtype)

    layer = FusedLayer(fl, _TimedHere.make(tmp_path), row_scaled, None, reference.silu_and_mul)
    cases = (
        ([32, 16, 16], [0, -1, 0, 0, -1], 1, True),  # one slot: rows with it and without
        ([24, 24, 16], [0, -1, 0, 0, -1], 1, False),  # q and k in one 16-column tile
        ([32, 16, 16], [1, -1, 0, 1, 2], 3, False),  # three slots: tiles may mix adapters
    )
    for widths, slots, n_slots, timed in cases:
        lora = with_add(make_lora(k, widths, slots, torch.float32, 3, n_slots=n_slots))
        added.clear()
        again.clear()
        out = layer.norm_linear(x, w, eps, None, lora=lora)
        want = rstd(x, eps) * (x.double() @ w.double().T + torch.cat(deltas(x, lora), dim=1))
        assert_close(out, want, torch.float32, f"norm_linear, LoRA slices {widths}")
        if timed:  # cuBLAS's way and the reference add the repeatable delta; the op's own
            assert len(again) >= 2 and added in ([], [m]), (again, added)  # way: add, once
        else:  # no Triton shape, or mixed adapters: cuBLAS and the delta once, untimed
            assert added == [m] and again == []
    keys = list(json.loads((tmp_path / "fused_layer.json").read_text()))
    assert len(keys) == 1 and keys[0].startswith("norm_linear+lora|"), keys


def _sharing(lora: ProjectionLoRA, like: ProjectionLoRA, rows: int) -> ProjectionLoRA:
    """``lora`` reading ``like``'s slots and ranks (one adapter plugin's), with a zeroed
    ``h_in`` of its slices' padded ranks."""
    width = len(lora.A) * fl.lora_rank_pad(lora.A[0].shape[1])
    h_in = torch.zeros(rows + 7, width, dtype=torch.float32, device=DEVICE)
    return lora._replace(slot_of_row=like.slot_of_row, ranks=like.ranks, h_in=h_in)


SUMMED_CASES = [(split, slots) for split in (1, 2) for slots in ([0], [0, -1, 0, 0])]


@pytest.mark.parametrize(("split", "slots"), SUMMED_CASES)
def test_a_shrink_summed_by_the_projection_before_gives_the_same_output(split, slots) -> None:  # noqa: ANN001
    """``next_lora=``: the O projection (``linear_residual``) sums the gate-up projection's
    shrink of the stream it writes, and the down projection the next QKV projection's, each
    into that projection's ``h_in``; the consumer run with ``h_in=True`` reads it instead of
    computing it and gives what it gives computing its own (rows of one adapter and of
    none, with and without split-K on both sides); the producer's own output is unchanged."""
    summed_shrink_matches(split, slots)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device (run on the H200)")
def test_on_the_gpu_a_shrink_summed_by_the_projection_before_gives_the_same_output() -> None:
    """The same on the GPU (bf16; the epilogue's atomics and the read after the
    programmatic-dependent-launch wait as they run there)."""
    for split, slots in SUMMED_CASES:
        summed_shrink_matches(split, slots)


def summed_shrink_matches(split: int, slots: list[int]) -> None:
    """O -> gate-up -> down -> QKV with ``next_lora=``/``h_in=True`` against each consumer
    computing its own shrink (``test_a_shrink_summed_by_the_projection_before_...``)."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    m, hidden, inter, eps = len(slots), 64, 96, 1e-6
    on_gpu = DEVICE.type == "cuda"
    x_o, w_o, _ = inputs(m, hidden, hidden, dtype, 11)
    residual = torch.randn(m, hidden, generator=torch.Generator().manual_seed(12)).to(DEVICE, dtype)
    o_lora = make_lora(hidden, [hidden], slots, dtype, 13, n_slots=1)
    gu = _sharing(make_lora(hidden, [inter, inter], slots, dtype, 14, n_slots=1), o_lora, m)
    down = _sharing(make_lora(inter, [hidden], slots, dtype, 15, n_slots=1), o_lora, m)
    qkv = _sharing(make_lora(hidden, [32, 16, 16], slots, dtype, 16, n_slots=1), o_lora, m)
    w_gu = (torch.randn(2 * inter, hidden, generator=torch.Generator().manual_seed(17)) / 8).to(
        DEVICE, dtype
    )
    w_down = (torch.randn(hidden, inter, generator=torch.Generator().manual_seed(18)) / 8).to(
        DEVICE, dtype
    )
    w_qkv = (torch.randn(64, hidden, generator=torch.Generator().manual_seed(19)) / 8).to(
        DEVICE, dtype
    )

    def config(n: int, k: int, gate_up: bool) -> fl.LinearConfig:
        made = fl.choose_config(m, n, k, dtype, gate_up, on_gpu, fl.num_sms(DEVICE))
        return made._replace(split_k=split, block_n=16)

    def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        scale = want.double().abs().max().clamp_min(1e-6)
        err = ((got.double() - want.double()).abs().max() / scale).item()
        assert err <= TOL[dtype], f"{what}: relative error {err:.3g}"

    stream = fl.linear_residual(x_o, w_o, residual, config=config(hidden, hidden, False), lora=o_lora, next_lora=gu)  # fmt: skip
    plain = fl.linear_residual(x_o, w_o, residual, config=config(hidden, hidden, False), lora=o_lora)  # fmt: skip
    assert torch.equal(stream, plain), "the producer's own output is unchanged"
    act_cfg = config(inter, hidden, True)
    act = fl.norm_gate_up(stream, w_gu, eps, config=act_cfg, lora=gu, h_in=True)
    close(act, fl.norm_gate_up(stream, w_gu, eps, config=act_cfg, lora=gu), "gate-up")
    no_delta = fl.norm_gate_up(stream, w_gu, eps, config=act_cfg)
    assert not torch.allclose(act, no_delta), "the adapter's delta shows"
    out_cfg = config(hidden, inter, False)
    new_stream = fl.linear_residual(act, w_down, stream, config=out_cfg, lora=down, next_lora=qkv)
    close(new_stream, fl.linear_residual(act, w_down, stream, config=out_cfg, lora=down), "down")
    qkv_cfg = config(64, hidden, False)
    got = fl.norm_linear(new_stream, w_qkv, eps, config=qkv_cfg, lora=qkv, h_in=True)
    close(got, fl.norm_linear(new_stream, w_qkv, eps, config=qkv_cfg, lora=qkv), "q|k|v")


def test_the_fused_layer_sums_a_shrink_only_into_rows_the_plugin_zeroes(tmp_path) -> None:  # noqa: ANN001
    """``FusedLayer``: a Triton GEMM given ``next_lora`` sums its shrink and the next
    projection reads it (``h_in``) only where the step's rows fit that projection's ``h_in``
    (the rows the adapter plugin zeroes a step); a longer step leaves both to compute as
    before, and its output is the same."""
    from pitstop.plugins.kernels import reference
    from pitstop.plugins.kernels.fused_layer import FusedLayer
    from pitstop.plugins.kernels.triton_ops.layer_choice import LayerChoice

    if DEVICE.type == "cuda":
        pytest.skip("the interpreter's Triton shapes (GPU: test_on_the_gpu_a_shrink_summed_...)")
    m, hidden, eps = 3, 64, 1e-6
    x, w, _ = inputs(m, hidden, hidden, torch.float32, 21)
    residual = torch.randn(m, hidden, generator=torch.Generator().manual_seed(22))
    o_lora = make_lora(hidden, [hidden], [0] * m, torch.float32, 23, n_slots=1)
    gu = _sharing(make_lora(hidden, [32, 32], [0] * m, torch.float32, 24, n_slots=1), o_lora, m)
    w_gu = torch.randn(64, hidden, generator=torch.Generator().manual_seed(25)) / 8

    def row_scaled(rows: torch.Tensor, eps_: float | None) -> torch.Tensor:
        return rows if eps_ is None else (rows * reference.rms_scale(rows, eps_)).to(rows.dtype)

    layer = FusedLayer(
        fl, LayerChoice(64, 0, False, tmp_path), row_scaled, None, reference.silu_and_mul
    )
    short = gu._replace(h_in=gu.h_in[: m - 1])  # fewer rows than the step
    for next_lora, reads in ((gu, True), (short, False)):
        next_lora.h_in.zero_()
        stream = layer.linear_residual(x, w, residual, None, o_lora, next_lora)
        assert (id(next_lora.h_in) in layer._summed) == reads
        act = layer.norm_gate_up(stream, w_gu, eps, None, next_lora)
        assert id(next_lora.h_in) not in layer._summed, "read or forgotten by the consumer"
        want = fl.norm_gate_up(stream, w_gu, eps, lora=next_lora)
        scale = want.abs().max()
        assert float((act - want).abs().max() / scale) <= TOL[torch.float32]
        assert bool(next_lora.h_in.abs().sum() > 0) == reads


def test_an_op_with_an_adapter_is_timed_with_its_rows_in_an_adapters_slot(tmp_path) -> None:  # noqa: ANN001
    """The warm-up that times the fused layer's ops has no adapter on its rows (slot -1, every
    LoRA load masked off), so the timing would weigh the GEMM alone: while an op with an
    adapter is timed, its rows are in slot 0 at the largest rank, every timed call (and the
    reference each Triton shape is checked against) sees them, and the rows' slots and slot
    0's rank are as they were after."""
    from pitstop.plugins.kernels import reference
    from pitstop.plugins.kernels.fused_layer import FusedLayer

    if DEVICE.type == "cuda":
        pytest.skip("times on the CPU with a fake timer")
    eps, m, k = 1e-6, 3, 64
    x, w, _ = inputs(m, 64, k, torch.float32, 4)
    lora = make_lora(k, [32, 16, 16], [-1] * m, torch.float32, 4, n_slots=1, rank_max=RANK_MAX)
    lora.ranks[0] = 2  # a loaded adapter of rank 2 (its A and B zero past it)
    lora = lora._replace(add=lambda rows, y: y, add_again=lambda rows, y: y)
    choice = _TimedHere.make(tmp_path)
    seen: list[tuple[list[int], int]] = []
    timer = choice.timer

    def watching(fn, n: int) -> float:  # noqa: ANN001
        seen.append((lora.slot_of_row[:m].tolist(), int(lora.ranks[0])))
        return timer(fn, n)

    choice.timer = watching

    def row_scaled(rows: torch.Tensor, eps_: float | None) -> torch.Tensor:
        return rows if eps_ is None else (rows * reference.rms_scale(rows, eps_)).to(rows.dtype)

    layer = FusedLayer(fl, choice, row_scaled, None, reference.silu_and_mul)
    layer.norm_linear(x, w, eps, None, lora=lora)
    assert seen and all(s == ([0] * m, RANK_MAX) for s in seen), seen
    assert lora.slot_of_row[:m].tolist() == [-1] * m and int(lora.ranks[0]) == 2


@pytest.mark.parametrize("m", [1, 5])
def test_every_gpu_lora_launch_shape_matches_float64(m: int) -> None:
    """The launch shapes the fused layer times with an adapter (:func:`fl.tile_candidates`:
    the table's tile, its balanced split, and the tiles 128 and 256 columns wide), run here
    as the GPU would run them (in the interpreter off a GPU): q|k|v 512|256|256 and gate-up
    2 x 512 over K 512, a ragged residual writer (down) of 300 columns over K 512, rows of
    two adapters and of none."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    slots = [(1, -1, 2, 1, 0)[i % 5] for i in range(m)]
    layer = ([512, 256, 256], 512, 512, 300)
    shapes = every_lora_shape_matches_float64(m, slots, dtype, layer, SLOTS, "two adapters")
    assert any(c.block_n == 256 for c in shapes), shapes


def test_every_wide_lora_tile_fits_sm90_shared_memory() -> None:
    """Each launch shape wider or taller than 64, or deeper than 4 stages, that the fused layer
    times with an adapter (qwen3-0.6b and llama3-8b, 1, 17, 64 and 65 rows), compiled ahead of time for sm_90 in a
    process of its own (no interpreter, no GPU), needs at most the 227 KiB of shared memory
    a program of an H100 or H200 may have: gate-up's tiles of 64 x 128 and 128 x 64 over a
    K step of 128 needed 232 and 240 KiB and failed to launch on the H100 (2026-12-06)."""
    pytest.importorskip("triton.backends.nvidia")
    script = Path(__file__).parents[2] / "helpers" / "sm90_shared.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {r["op"] for r in rows} >= {"qkv", "gate_up", "down"}, rows
    assert {r["config"][1] for r in rows} == {64, 128, 256}, rows
    assert {r["config"][0] for r in rows} == {16, 32, 64, 128}, rows
    assert max(r["config"][5] for r in rows) == fl.DEEP_STAGES, rows
    over = [r for r in rows if r["shared"] > SM90_SHARED_BYTES]
    assert not over, f"launch shapes over sm_90's {SM90_SHARED_BYTES} bytes: {over}"


def test_a_split_whose_partials_and_h_overflow_the_workspace_is_cut() -> None:
    """Split-K partials beside a LoRA's ``h`` that would overflow the workspace run with the
    largest split that fits (the table sizes a split without the LoRA): 32 tiles x 4 splits
    of 16 x 16 need 34,816 floats alone and 67,584 with a rank-8 LoRA's ``h``, over the
    interpreter's 65,536; the result still matches float64. Every shape the fused layer
    times for a LoRA of rank 8 to 128 fits the GPU's workspace, no split left empty."""
    m, n, k, eps = 32, 256, 128, 1e-6
    x, w, _ = inputs(m, n, k, torch.float32, 5)
    lora = make_lora(k, [n], [(i % 3) - 1 for i in range(m)], torch.float32, 5)
    cfg = fl.LinearConfig(16, 16, 32, 4, 1, 1)
    if DEVICE.type == "cpu":
        kind, pad = "cpu", fl.lora_rank_pad(RANK_MAX)
        assert fl._split_fits(32, 4, 16, 16, 1, kind) and not fl._split_fits(
            32, 4, 16, 16, 1, kind, pad
        )
        assert fl.fit_lora_split(cfg, m, n, k, False, pad, kind).split_k == 2  # 3: one empty
    with poisoned_outputs():
        out = fl.norm_linear(x, w, eps, config=cfg, lora=lora)
    want = rstd(x, eps) * (x.double() @ w.double().T + deltas(x, lora)[0])
    assert_close(out, want, torch.float32, "cut split")
    for n_, k_, gate_up in ((6144, 4096, False), (14336, 4096, True), (28672, 8192, True)):
        for rows in (1, 17, 32, 64, 200):
            for rank in (8, 16, 64, 128):
                for c in fl.tile_candidates(rows, n_, k_, torch.bfloat16, gate_up, 132, rank):
                    tiles = math.ceil(n_ / c.block_n) * math.ceil(rows / c.block_m)
                    pad, accs = fl.lora_rank_pad(rank), 2 if gate_up else 1
                    fits = fl._split_fits(tiles, c.split_k, c.block_m, c.block_n, accs, "cuda", pad)
                    assert c.split_k == 1 or fits, f"over the workspace: {c}"  # 1: none used
                    per = math.ceil(math.ceil(k_ / c.split_k) / c.block_k) * c.block_k
                    assert math.ceil(k_ / per) == c.split_k, f"an empty split: {c}"


shared_mixes = st.sampled_from(["one", "none-and-one", "one-row-of-three-slots"])


def shared_case(mix: str, m: int, seed: int) -> tuple[int, list[int], int]:
    """(rows, their slots, slots allocated) of a launch that may share its shrink: one row
    tile whose rows hold at most one adapter."""
    if mix == "one-row-of-three-slots":  # one row, several slots: the row's own
        return 1, [seed % SLOTS], SLOTS
    # one slot allocated: every row in it, or rows in it and rows without an adapter
    return m, [0 if s >= 0 else -1 for s in draw_slots(mix, m, seed)], 1


@FEW
@given(
    m=st.integers(1, 16),
    k=st.sampled_from([24, 64, 130, 320]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    split=st.sampled_from([1, 2, 3]),
    mix=shared_mixes,
    seed=st.integers(0, 2**16),
    op=st.sampled_from(["qkv", "gate_up", "residual"]),
)
def test_a_shared_shrink_matches_float64(m, k, dtype, split, mix, seed, op) -> None:
    """``shared_shrink``: the first programs each compute one chunk of K's shrink, the others
    sum the chunks (or compute a missing one themselves, as the interpreter's first program
    must, running before the rest): every op against float64, the counter back at zero."""
    m, slots, n_slots = shared_case(mix, m, seed)
    cfg = fl.LinearConfig(16, TILE_N, 32, split, 1, 1, shared_shrink=1)
    eps = 1e-6
    if op == "qkv":
        widths = [2 * TILE_N, TILE_N, TILE_N]
        x, w, _ = inputs(m, sum(widths), k, dtype, seed)
        lora = make_lora(k, widths, slots, dtype, seed, n_slots=n_slots)
        with poisoned_outputs():
            out = fl.norm_linear(x, w, eps, config=cfg, lora=lora)
        want = rstd(x, eps) * (x.double() @ w.double().T + torch.cat(deltas(x, lora), dim=1))
    elif op == "gate_up":
        f = 24
        x, w, _ = inputs(m, 2 * f, k, dtype, seed)
        lora = make_lora(k, [f, f], slots, dtype, seed, n_slots=n_slots)
        with poisoned_outputs():
            out = fl.norm_gate_up(x, w, eps, config=cfg, lora=lora)
        dg, du = deltas(x, lora)
        g = rstd(x, eps) * (x.double() @ w[:f].double().T + dg)
        u = rstd(x, eps) * (x.double() @ w[f:].double().T + du)
        want = g / (1.0 + torch.exp(-g)) * u
    else:
        n = 40
        x, w, _ = inputs(m, n, k, dtype, seed)
        residual = torch.randn(m, n, generator=torch.Generator().manual_seed(seed)).to(
            DEVICE, dtype
        )
        lora = make_lora(k, [n], slots, dtype, seed, n_slots=n_slots)
        with poisoned_outputs():
            out = fl.linear_residual(x, w, residual, config=cfg, lora=lora)
        want = residual.double() + x.double() @ w.double().T + deltas(x, lora)[0]
    assert_close(out, want, dtype, f"{op} shared {mix}")
    ws = fl.workspace(DEVICE)
    assert int(ws.shrink_counter.item()) == 0, "the shared shrink's counter back at zero"
    assert bool((ws.counters == 0).all()), "split-K counters back at zero"


@pytest.mark.parametrize("split", [1, 2])
def test_a_shared_shrink_has_the_same_bits_computed_or_read(split: int) -> None:
    """Every consumer computing every chunk itself (the counter preset so that no producer
    looks done) gives the very bits of a launch where consumers read the producers'
    chunks: a consumer that finds a chunk missing runs the producer's own code."""
    m, k, f = 1, 320, 48
    x, w, _ = inputs(m, 2 * f, k, torch.bfloat16, 5)
    lora = make_lora(k, [f, f], [1], torch.bfloat16, 5)
    cfg = fl.LinearConfig(16, TILE_N, 32, split, 1, 1, shared_shrink=1)
    ws = fl.workspace(DEVICE)
    read = fl.norm_gate_up(x, w, 1e-6, config=cfg, lora=lora)
    assert int(ws.shrink_counter.item()) == 0
    ws.shrink_counter.fill_(1 << 15)  # no launch's producer count: nobody is ready
    try:
        computed = fl.norm_gate_up(x, w, 1e-6, config=cfg, lora=lora)
    finally:
        ws.shrink_counter.zero_()
    assert torch.equal(read, computed)
    plain = fl.norm_gate_up(x, w, 1e-6, config=cfg._replace(shared_shrink=0), lora=lora)
    assert_close(plain.double(), read.double(), torch.bfloat16, "in-loop against shared")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("op", ["qkv", "gate_up", "down"])
def test_on_the_gpu_a_shared_shrink_reads_the_bits_it_would_compute(op: str) -> None:
    """llama3-8b's projections at one row of an adapter in slot 2 of 4, every shape with the
    shrink shared that the fused layer times (split K and not): against float64, and
    bit for bit the launch where every consumer computes every chunk itself (the counter
    preset so that no producer looks done), ten calls in a row each."""
    hidden, inter, sms = 4096, 14336, fl.num_sms(DEVICE)
    widths = {"qkv": [4096, 1024, 1024], "gate_up": [inter, inter], "down": [hidden]}[op]
    k = inter if op == "down" else hidden
    n = widths[0] if op == "gate_up" else sum(widths)
    x, w, _ = inputs(1, 2 * n if op == "gate_up" else n, k, torch.bfloat16, 7)
    lora = make_lora(k, widths, [2], torch.bfloat16, 7, n_slots=4, rank_max=16)
    residual = torch.randn(1, n, generator=torch.Generator().manual_seed(7)).to(DEVICE, x.dtype)
    eps = 1e-6

    def run(cfg: fl.LinearConfig) -> torch.Tensor:
        if op == "qkv":
            return fl.norm_linear(x, w, eps, config=cfg, lora=lora)
        if op == "gate_up":
            return fl.norm_gate_up(x, w, eps, config=cfg, lora=lora)
        return fl.linear_residual(x, w, residual, config=cfg, lora=lora)

    d = deltas(x, lora)
    if op == "gate_up":
        g = rstd(x, eps) * (x.double() @ w[:n].double().T + d[0])
        u = rstd(x, eps) * (x.double() @ w[n:].double().T + d[1])
        want = g / (1.0 + torch.exp(-g)) * u
    elif op == "qkv":
        want = rstd(x, eps) * (x.double() @ w.double().T + torch.cat(d, dim=1))
    else:
        want = residual.double() + x.double() @ w.double().T + d[0]
    shapes = fl.tile_candidates(1, n, k, torch.bfloat16, op == "gate_up", sms, lora_rank=16)
    shared = [c for c in shapes if c.shared_shrink]
    assert shared, shapes
    ws = fl.workspace(DEVICE)
    for cfg in shared:
        read = [run(cfg) for _ in range(10)]
        assert int(ws.shrink_counter.item()) == 0, cfg
        ws.shrink_counter.fill_(1 << 15)
        try:
            computed = run(cfg)
        finally:
            ws.shrink_counter.zero_()
        assert_close(read[0], want, torch.bfloat16, f"{op} {cfg}")
        for out in read:
            assert torch.equal(out, computed), f"{op} {cfg}: read and computed bits differ"
