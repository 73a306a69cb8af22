"""The fused layer's cuBLAS way (issue 44): GEMMs whose input norm's row scale is applied by
the op after them (``rope_and_store``, the Triton SiLU·mul) and whose residual add is
cuBLAS's own (``addmm_`` into the stream), so that a step the Triton GEMMs do not take
runs seven launches a layer instead of eleven; and the choice between the two ways per op
and shape (:class:`LayerChoice`: timed once per shape on a GPU, cached on disk).

The Triton ops run in Triton's interpreter on the CPU. Bit for bit against the reference
where every float32 sum of squares is exact (values that are multiples of 1/8, widths that
are powers of two: the kernels sum in another order than torch, their one difference);
within the dtype's bound otherwise.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers.poison import poisoned_outputs  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pitstop.config import EngineConfig  # noqa: E402
from pitstop.plugin_system.plugin_manager import get_plugin_manager  # noqa: E402
from pitstop.plugin_system.protocols import KernelSetBase, RotaryCache  # noqa: E402
from pitstop.plugins.kernels import reference  # noqa: E402
from pitstop.plugins.kernels.fused import FusedKernels  # noqa: E402
from pitstop.plugins.kernels.triton_ops import layer_choice  # noqa: E402
from pitstop.plugins.kernels.triton_ops.fused_linear import LinearConfig  # noqa: E402
from pitstop.plugins.kernels.triton_ops.layer_choice import (  # noqa: E402
    CALLS_PER_GRAPH,
    CUBLAS,
    CUBLAS_MARGIN_MAX_ROWS,
    CUBLAS_MARGIN_US,
    LayerChoice,
)
from pitstop.testing.kernels import paged_metadata  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6
FEW = settings(max_examples=10, deadline=None, derandomize=True)


def _values(shape: tuple[int, ...], exact: bool, gen: torch.Generator) -> torch.Tensor:
    """Random values; ``exact``: multiples of 1/8 below 2 in magnitude (exact squares and sums)."""
    if exact:
        return torch.randint(-15, 16, shape, generator=gen) / 8
    return torch.randn(shape, generator=gen) * 3


def _check(got: torch.Tensor, expected: torch.Tensor, exact: bool, what: str) -> None:
    """Bit for bit where the sums are exact in the interpreter, else within the dtype's bound."""
    if exact and INTERPRETED:
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), f"{what}: bits"
        return
    err = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err <= TOL[got.dtype], f"{what}: relative error {err:.3g}"


def _fused(dtype: torch.dtype, **options: object) -> FusedKernels:
    config = EngineConfig(max_model_len=512, options={"fused.layer": True, **options})
    return get_plugin_manager().create("kernels", "fused", config, DEVICE, dtype)


@FEW
@given(
    tokens=st.integers(1, 9),
    hidden=st.sampled_from([32, 64, 2048]),
    qk_norm=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    exact=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rope_and_store_applies_the_row_scale_first(
    tokens: int, hidden: int, qk_norm: bool, dtype: torch.dtype, exact: bool, seed: int
) -> None:
    """``rope_and_store(row_scale=(x, eps))`` of the raw projection equals the reference's
    rotary over the row-scaled projection: q, k and both caches (the hidden width 2048 takes
    the kernel's row loop over two blocks of 1024)."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d, page = 4, 2, 64, 8
    meta = paged_metadata([1] * tokens, [5 + 3 * i for i in range(tokens)], page, 40, seed, DEVICE)
    x = _values((tokens, hidden), exact, gen).to(DEVICE, dtype)
    qkv = _values((tokens, (hq + 2 * hkv) * d), exact, gen).to(DEVICE, dtype)
    q, k, v = (p.reshape(tokens, -1, d) for p in qkv.split([hq * d, hkv * d, hkv * d], -1))
    angles = torch.outer(torch.arange(64).float(), torch.rand(d // 2, generator=gen))
    rotary = RotaryCache(angles.cos().to(DEVICE), angles.sin().to(DEVICE))
    norm = {}
    if qk_norm:
        weights = tuple((1 + 0.2 * torch.randn(d, generator=gen)).to(DEVICE, dtype) for _ in "qk")
        norm = dict(qk_norm=weights, qk_norm_eps=EPS)
    caches = [torch.randn(40, page, hkv, d, generator=gen).to(DEVICE, dtype) for _ in "kv"]
    ref_caches = [c.clone() for c in caches]
    q_ref, k_ref = reference.rope_and_store(
        q, k, v, rotary, *ref_caches, meta, row_scale=(x, EPS), **norm
    )
    with poisoned_outputs():
        q_got, k_got = _fused(dtype).rope_and_store(
            q, k, v, rotary, *caches, meta, row_scale=(x, EPS), **norm
        )
    _check(q_got, q_ref, exact, "q")
    _check(k_got, k_ref, exact, "k")
    _check(caches[0], ref_caches[0], exact, "k cache")
    _check(caches[1], ref_caches[1], exact, "v cache")


def test_reference_row_scale_is_the_norm_before_the_projection() -> None:
    """The reference's deferred row scale is the RMSNorm (gain folded into the weight) applied
    before the projection, up to the rounding of the projection: in float64, equal."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=gen, dtype=torch.float64)
    w = torch.randn(48, 32, generator=gen, dtype=torch.float64)
    (scaled,) = reference.apply_row_scale((x @ w.T,), x, EPS)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(scaled, normed @ w.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("hidden", [64, 2048])
def test_silu_and_mul_applies_the_row_scale_first(
    dtype: torch.dtype, exact: bool, hidden: int
) -> None:
    """The Triton SiLU·mul with ``row_scale`` equals the reference SiLU·mul of the row-scaled
    gate-up output (and with ``row_scale`` absent, the plain one, unchanged)."""
    from pitstop.plugins.kernels.triton_ops import silu

    gen = torch.Generator().manual_seed(hidden)
    x = _values((7, hidden), exact, gen).to(DEVICE, dtype)
    gate_up = _values((7, 2 * 96), exact, gen).to(DEVICE, dtype)
    with poisoned_outputs():
        got = silu.silu_and_mul(gate_up, (x, EPS))
    (scaled,) = reference.apply_row_scale((gate_up,), x, EPS)
    expected = reference.silu_and_mul(scaled)
    # within the bound only: the kernel's exp differs from torch's in the last bit (the row
    # scale's bits are checked through rope_and_store above)
    err = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err <= TOL[dtype], f"relative error {err:.3g}"
    plain = silu.silu_and_mul(gate_up)
    err = (plain.float() - reference.silu_and_mul(gate_up).float()).abs().max()
    assert err <= TOL[dtype] * reference.silu_and_mul(gate_up).float().abs().max()


def test_long_steps_defer_the_row_scale_and_add_in_place() -> None:
    """Above ``layer_rows`` the QKV projection is cuBLAS on the raw rows with ``(x, eps)``
    handed on, the gate-up is cuBLAS then the row-scaled SiLU·mul, and the residual add is
    ``addmm_`` into the residual itself; at or below it nothing is deferred. A bias (applied
    after the scale) keeps the scale before the GEMM."""
    ks = _fused(torch.float32, **{"fused.layer_rows": 4, "fused.layer_tune": False})
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 32, generator=gen).to(DEVICE)
    bias = torch.randn(48, generator=gen).to(DEVICE)
    for rows in (3, 4, 5, 9):
        x = torch.randn(rows, 32, generator=gen).to(DEVICE)
        y, row_scale = ks.norm_linear_deferred(x, w, EPS)
        if rows <= 4:
            assert row_scale is None
            _check(y, reference.norm_linear(x, w, EPS), False, "short step")
        else:
            assert row_scale is not None and row_scale[0] is x and row_scale[1] == EPS
            _check(y, x @ w.T, False, "raw projection")
            (scaled,) = reference.apply_row_scale((y,), *row_scale)
            _check(scaled, reference.norm_linear(x, w, EPS), False, "deferred scale")
        y, row_scale = ks.norm_linear_deferred(x, w, EPS, bias)
        assert row_scale is None
        _check(y, reference.norm_linear(x, w, EPS, bias), False, "with a bias")
        _check(ks.norm_gate_up(x, w, EPS), reference.norm_gate_up(x, w, EPS), False, "gate-up")
        down = torch.randn(32, 24, generator=gen).to(DEVICE)
        act = torch.randn(rows, 24, generator=gen).to(DEVICE)
        residual = torch.randn(rows, 32, generator=gen).to(DEVICE)
        expected = reference.linear_residual(act, down, residual)
        out = ks.linear_residual(act, down, residual)
        _check(out, expected, False, "residual add")
        assert (out.data_ptr() == residual.data_ptr()) == (rows > 4)
    assert ks.describe()["norm_linear"] == (
        "triton up to 4 rows, else cuBLAS (row scale in rope_and_store / silu_and_mul, "
        "residual added in place)"
    )


def test_a_set_without_the_capability_never_defers() -> None:
    """A kernel set that does not define ``norm_linear_deferred`` gets the default: its own
    ``norm_linear`` and no row scale, so its ``rope_and_store`` never sees ``row_scale``."""

    class Plain:
        def norm_linear(self, x, weight, eps, bias=None):  # noqa: ANN001, ANN202
            return reference.norm_linear(x, weight, eps, bias)

    x, w = torch.randn(3, 8), torch.randn(6, 8)
    y, row_scale = KernelSetBase.of(Plain(), "norm_linear_deferred")(x, w, EPS)
    assert row_scale is None
    torch.testing.assert_close(y, reference.norm_linear(x, w, EPS))


# ---------------------------------------------------------------- the choice, timed

A = LinearConfig(16, 16, 32, 1, 1, 1)
B = LinearConfig(32, 16, 32, 1, 1, 1)


class TimedOnCpu(LayerChoice):
    """A :class:`LayerChoice` that 'times' on the CPU with a given timer (no GPU here)."""

    capturing_now = False

    def can_time(self, x: torch.Tensor) -> bool:
        return True

    def device_name(self, x: torch.Tensor) -> str:
        return "Fake GPU"

    def capturing(self) -> bool:
        return self.capturing_now


class Ways:
    """The two ways of an op, recording what ran; a timer reporting each way's given time."""

    def __init__(self, times: dict[str, float], outputs: dict[str, torch.Tensor] | None = None):
        self.times, self.outputs, self.ran = times, outputs or {}, []
        self.weights: list[torch.Tensor] = []  # the weight each call was given
        self.expected = torch.ones(3, 4)

    def triton(self, config: LinearConfig, weight: torch.Tensor) -> torch.Tensor:
        name = f"triton{tuple(config)}"
        self.ran.append(name)
        self.weights.append(weight)
        out = self.outputs.get(name, self.expected)
        if isinstance(out, Exception):
            raise out
        return out

    def cublas(self, weight: torch.Tensor) -> None:
        self.ran.append("cublas")
        self.weights.append(weight)

    def timer(self, fn, n: int) -> float:
        """Runs ``fn`` as the real timer does: once, then ``n`` times (the graph's calls)."""
        assert n == CALLS_PER_GRAPH
        for _ in range(1 + n):
            fn()
        return self.times[self.ran[-1]]

    def choose(self, choice: LayerChoice, rows: int, op: str = "norm_linear", w=None):  # noqa: ANN001
        x, w = torch.zeros(rows, 32), (torch.zeros(48, 32) if w is None else w)
        return choice.launch_shape(
            op, x, w, [A, B], self.triton, self.cublas, lambda: self.expected
        )


def test_the_choice_is_timed_once_per_shape_and_kept_on_disk(tmp_path: Path) -> None:
    """First sight of a shape: cuBLAS and every Triton launch shape timed on the call's inputs,
    the fastest kept (in memory and in the JSON file); the same bucket again, or another
    process reading the file: no timing. Above ``tune_rows``: cuBLAS, untimed; timing off:
    the table's shape up to ``static_rows``."""
    ways = Ways({"cublas": 2.0, f"triton{tuple(A)}": 3.0, f"triton{tuple(B)}": 1.0})
    choice = TimedOnCpu(4, 64, True, tmp_path, timer=ways.timer)
    assert ways.choose(choice, 5) == B
    timed = list(ways.ran)
    assert ways.choose(choice, 7) == B and ways.ran == timed, "rows 5 and 7: the bucket 8"
    key = LayerChoice.key("norm_linear", torch.zeros(5, 32), torch.zeros(48, 32), "Fake GPU")
    assert key.startswith("norm_linear|M8-N48-K32|float32|Fake GPU|triton ")
    assert json.loads((tmp_path / LayerChoice.FILE).read_text()) == {key: list(B)}
    fresh = TimedOnCpu(4, 64, True, tmp_path, timer=ways.timer)
    assert ways.choose(fresh, 8) == B and ways.ran == timed, "read from the file"
    assert ways.choose(choice, 65) is None and ways.ran == timed, "above tune_rows"
    slow = Ways({"cublas": 1.0, f"triton{tuple(A)}": 3.0, f"triton{tuple(B)}": 2.0})
    assert slow.choose(TimedOnCpu(4, 64, True, tmp_path, timer=slow.timer), 3, "x") is None
    assert (
        json.loads((tmp_path / LayerChoice.FILE).read_text())[
            LayerChoice.key("x", torch.zeros(3, 32), torch.zeros(48, 32), "Fake GPU")
        ]
        == CUBLAS
    )
    off = Ways({})
    untimed = TimedOnCpu(4, 64, False, tmp_path / "off", timer=off.timer)
    assert off.choose(untimed, 4) == A and off.choose(untimed, 5) is None and off.ran == []


def test_a_wrong_or_failing_triton_shape_is_dropped_and_a_capture_is_never_timed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Triton launch shape whose output disagrees with the reference, or that raises (too
    much shared memory, say), is dropped even when it would be fastest; inside a CUDA-graph
    capture an untimed shape takes the ``static_rows`` rule, logged once, nothing stored."""
    outputs = {
        f"triton{tuple(A)}": torch.full((3, 4), 1.5),
        f"triton{tuple(B)}": RuntimeError("smem"),
    }
    ways = Ways({"cublas": 5.0, f"triton{tuple(A)}": 1.0, f"triton{tuple(B)}": 1.0}, outputs)
    with caplog.at_level(logging.WARNING):
        assert ways.choose(TimedOnCpu(4, 64, True, tmp_path, timer=ways.timer), 2) is None
    assert any("off by 0.5: dropped" in r.message for r in caplog.records)
    capture = TimedOnCpu(4, 64, True, tmp_path / "other", timer=ways.timer)
    capture.capturing_now = True
    ran = list(ways.ran)
    with caplog.at_level(logging.WARNING):
        assert ways.choose(capture, 3) == A and ways.choose(capture, 30) is None
    assert ways.ran == ran
    assert sum("inside a CUDA graph capture" in r.message for r in caplog.records) == 1
    assert not (tmp_path / "other" / LayerChoice.FILE).exists()


def test_each_timed_call_reads_its_own_copy_of_a_small_weight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a step every layer's weight comes from HBM; a timed graph of calls on one weight
    that fits in L2 would read it from there after its first call. So the calls of a timed
    graph take ``CALLS_PER_GRAPH`` distinct copies in turn (equal to the weight), the check
    against the reference the weight itself; a weight over ``ROTATE_MAX_BYTES`` is timed on
    itself, and where no copy fits the device the timing goes on with the weight alone."""
    ways = Ways({"cublas": 2.0, f"triton{tuple(A)}": 3.0, f"triton{tuple(B)}": 1.0})
    w = torch.randn(48, 32)
    assert ways.choose(TimedOnCpu(4, 64, True, tmp_path / "a", timer=ways.timer), 5, w=w) == B
    timed = ways.weights[-CALLS_PER_GRAPH:]  # the last candidate's graph
    assert len({t.data_ptr() for t in timed}) == CALLS_PER_GRAPH
    assert all(torch.equal(t, w) for t in timed)
    checks = [t for name, t in zip(ways.ran, ways.weights, strict=True) if name != "cublas"]
    assert checks[0] is w, "the check against the reference runs on the weight itself"

    monkeypatch.setattr(layer_choice, "ROTATE_MAX_BYTES", w.numel() * w.element_size() - 1)
    big = Ways(dict(ways.times))
    assert big.choose(TimedOnCpu(4, 64, True, tmp_path / "b", timer=big.timer), 5, w=w) == B
    assert all(t is w for t in big.weights), "a weight too large for L2 is timed on itself"

    monkeypatch.setattr(layer_choice, "ROTATE_MAX_BYTES", 2**40)

    def no_room(self: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(torch.Tensor, "clone", no_room)
    full = Ways(dict(ways.times))
    assert full.choose(TimedOnCpu(4, 64, True, tmp_path / "c", timer=full.timer), 5, w=w) == B
    assert all(t is w for t in full.weights), "no room for copies: the weight itself"


@pytest.mark.parametrize("triton_wins", [True, False])
def test_the_layer_runs_the_chosen_way_and_times_on_scratch(
    tmp_path: Path, triton_wins: bool
) -> None:
    """The fused layer's ops follow the choice: the Triton GEMM's fresh output, or cuBLAS with
    the row scale deferred and the residual added in place; timing the cuBLAS way of the
    residual writers adds into a copy, never into the real residual."""
    ks = _fused(torch.float32)
    seen: list[str] = []

    def timer(fn, n: int) -> float:  # cuBLAS first, then the one (interpreter) launch shape
        fn()
        seen.append("triton" if len(seen) % 2 else "cublas")
        return 2.0 if seen[-1] == "triton" else (3.0 if triton_wins else 1.0)

    ks._layer.choice = TimedOnCpu(64, 64, True, tmp_path, timer=timer)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 32, generator=gen), torch.randn(48, 32, generator=gen)
    y, row_scale = ks.norm_linear_deferred(x, w, EPS)
    assert (row_scale is None) == triton_wins
    _check(y if triton_wins else reference.apply_row_scale((y,), x, EPS)[0],
           reference.norm_linear(x, w, EPS), False, "QKV")  # fmt: skip
    down, act = torch.randn(32, 24, generator=gen), torch.randn(6, 24, generator=gen)
    residual = torch.randn(6, 32, generator=gen)
    before = residual.clone()
    out = ks.linear_residual(act, down, residual)
    _check(out, reference.linear_residual(act, down, before), False, "residual add")
    if triton_wins:
        assert torch.equal(residual, before), "the timing and the Triton way leave it alone"
    else:
        assert out.data_ptr() == residual.data_ptr(), "cuBLAS adds in place"
        _check(residual, reference.linear_residual(act, down, before), False, "added once")
    _check(ks.norm_gate_up(x, w, EPS), reference.norm_gate_up(x, w, EPS), False, "gate-up")
    assert seen == ["cublas", "triton"] * 3, "each op timed once, both ways"


def test_cublas_is_kept_only_where_it_is_clearly_ahead(tmp_path: Path) -> None:
    """Inside a layer a cuBLAS launch breaks the programmatic-dependent-launch chain, so
    the timed choice keeps the fastest Triton shape unless cuBLAS beats it by more than
    ``CUBLAS_MARGIN_US`` a call (timer values are milliseconds), up to
    ``CUBLAS_MARGIN_MAX_ROWS`` rows."""
    margin_ms = CUBLAS_MARGIN_US * 1e-3
    near = Ways({"cublas": 2.0, f"triton{tuple(A)}": 2.0 + margin_ms / 2, f"triton{tuple(B)}": 3.0})
    assert near.choose(TimedOnCpu(4, 64, True, tmp_path / "near", timer=near.timer), 2) == A
    far = Ways({"cublas": 2.0, f"triton{tuple(A)}": 2.0 + 2 * margin_ms, f"triton{tuple(B)}": 3.0})
    assert far.choose(TimedOnCpu(4, 64, True, tmp_path / "far", timer=far.timer), 2) is None
    # above CUBLAS_MARGIN_MAX_ROWS rows (by bucket: 33 rows are timed as 64) a step is not
    # bound by launch latency, and cuBLAS is kept wherever it is ahead at all
    many = CUBLAS_MARGIN_MAX_ROWS + 1
    assert near.choose(TimedOnCpu(4, 256, True, tmp_path / "many", timer=near.timer), many) is None
    at_edge = TimedOnCpu(4, 256, True, tmp_path / "edge", timer=near.timer)
    assert near.choose(at_edge, CUBLAS_MARGIN_MAX_ROWS) == A
    behind = Ways(
        {"cublas": 2.0 + margin_ms / 2, f"triton{tuple(A)}": 2.0, f"triton{tuple(B)}": 3.0}
    )
    assert (
        behind.choose(TimedOnCpu(4, 256, True, tmp_path / "behind", timer=behind.timer), many) == A
    )
    broken = {f"triton{tuple(c)}": RuntimeError("smem") for c in (A, B)}
    none = Ways({"cublas": 9.0}, broken)
    assert none.choose(TimedOnCpu(4, 64, True, tmp_path / "none", timer=none.timer), 2) is None
