"""Stream-K for fused_linear's GEMMs of one row tile (``LinearConfig.stream_k``).

Every program takes the same run of K steps of the whole GEMM, walking tile by tile; a tile
cut between programs is summed by the part that arrives last, in part order. Against float64
arithmetic of the same formula (test_fused_linear.py's references) for the three ops, with
Hypothesis drawing the rows, the shapes, the dtype and the programs (so that tiles are cut
into one, two or more parts, and programs span several tiles); the arrival counters are back
at zero after every call. Triton's interpreter runs the kernel off a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from helpers.fused_linear_refs import (  # noqa: E402
    DEVICE,
    assert_close,
    counters_are_zero,
    inputs,
    ref_linear_residual,
    ref_norm_gate_up,
    ref_norm_linear,
)
from helpers.poison import poisoned_outputs  # noqa: E402

from pitstop.plugins.kernels.triton_ops import fused_linear as fl  # noqa: E402
from pitstop.plugins.kernels.triton_ops import fused_linear_stream_k as sk  # noqa: E402

SM90_SHARED_BYTES = 232_448  # the most shared memory one program may have on sm_90 (227 KiB)
FEW = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def streamed(programs: int) -> fl.LinearConfig:
    """The interpreter's small tiles (16 rows, 16 columns, K steps of 32), stream-K."""
    return fl.LinearConfig(16, 16, 32, 1, 1, 1, stream_k=programs)


@FEW
@given(
    m=st.integers(1, 16),
    n=st.integers(1, 72),
    k=st.one_of(st.integers(1, 300), st.sampled_from([32, 64, 256])),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    programs=st.integers(1, 12),
    op=st.sampled_from(["norm_linear", "norm_gate_up", "linear_residual"]),
    eps=st.sampled_from([1e-6, None]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stream_k_matches_float64(m, n, k, dtype, programs, op, eps, with_bias, seed) -> None:
    """Each op under stream-K equals float64 within one rounding, whatever the cut."""
    cfg = streamed(programs)
    if op == "norm_gate_up":
        x, w, b = inputs(m, 2 * n, k, dtype, seed)
        bias = b if with_bias else None
        with poisoned_outputs():
            out = fl.norm_gate_up(x, w, eps, bias, config=cfg)
        want = ref_norm_gate_up(x, w, eps, bias)
    elif op == "norm_linear":
        x, w, b = inputs(m, n, k, dtype, seed)
        bias = b if with_bias else None
        with poisoned_outputs():
            out = fl.norm_linear(x, w, eps, bias, config=cfg)
        want = ref_norm_linear(x, w, eps, bias)
    else:
        x, w, b = inputs(m, n, k, dtype, seed)
        bias = b if with_bias else None
        residual = torch.randn(m, n, generator=torch.Generator().manual_seed(seed)).to(
            DEVICE, dtype
        )
        with poisoned_outputs():
            out = fl.linear_residual(x, w, residual, bias, config=cfg)
        want = ref_linear_residual(x, w, residual, bias)
    assert_close(out, want, dtype, f"{op} stream-K over {programs} programs")
    assert counters_are_zero(), "a tile's arrival counter left non-zero"


@pytest.mark.parametrize(
    ("n", "k", "programs"), [(6144, 4096, 132), (4096, 4096, 132), (4096, 14336, 264), (20, 10, 7)]
)
def test_plan_gives_every_program_the_same_steps(n: int, k: int, programs: int) -> None:
    """The plan's runs cover every (tile, K step) once, no program takes more than ``per``
    steps nor none, and no tile is cut into more than ``parts`` parts."""
    bn, bk = (64, 128) if n > 100 else (16, 32)
    p = sk.plan(n, k, bn, bk, programs)
    total = p.tiles * p.steps
    runs = [(q * p.per, min((q + 1) * p.per, total)) for q in range(p.programs)]
    assert runs[0][0] == 0 and runs[-1][1] == total
    assert all(a < b <= a + p.per for a, b in runs)
    assert all(runs[q][1] == runs[q + 1][0] for q in range(len(runs) - 1))
    assert p.programs <= programs
    for tile in range(p.tiles):
        cut = {
            q for q, (a, b) in enumerate(runs) if a < (tile + 1) * p.steps and b > tile * p.steps
        }
        assert 1 <= len(cut) <= p.parts


def test_llama3_8b_qkv_at_one_row_spreads_evenly() -> None:
    """llama3-8b's q|k|v at one row over 132 programs: at most 24 K steps a program where the
    split-2 grid of 64-column tiles gave the busiest SM 32 (two half-tiles), 1.03 times the
    mean instead of 1.38."""
    p = sk.plan(6144, 4096, 64, 128, 132)
    assert p.per == 24 and p.programs == 128
    mean = p.tiles * p.steps / 132
    assert p.per / mean < 1.04


def test_more_rows_than_a_row_tile_take_the_split_kernel() -> None:
    """``stream_k`` applies to one row tile: 17 rows of 16-row tiles run the usual kernel."""
    x, w, b = inputs(17, 40, 64, torch.float32, 3)
    out = fl.norm_linear(x, w, 1e-6, b, config=streamed(5))
    assert_close(out, ref_norm_linear(x, w, 1e-6, b), torch.float32, "17 rows")
    assert counters_are_zero()


def test_tile_candidates_add_stream_k_up_to_16_rows_without_an_adapter() -> None:
    """Up to 16 rows of bf16 without an adapter the table's tile comes under stream-K over one
    and two programs an SM, and (one weight tile a stage) one an SM with the deep stages;
    never with a LoRA inside, above 16 rows, or in float32."""
    qkv = fl.tile_candidates(1, 6144, 4096, torch.bfloat16, False, 132)
    streams = [c for c in qkv if c.stream_k]
    table = qkv[0]
    assert streams == [
        table._replace(split_k=1, stream_k=132),
        table._replace(split_k=1, stream_k=264),
        table._replace(split_k=1, stream_k=132, num_stages=fl.DEEP_STAGES),
    ]
    gate_up = fl.tile_candidates(16, 14336, 4096, torch.bfloat16, True, 132)
    assert [c.stream_k for c in gate_up if c.stream_k] == [132, 264]
    for none in (
        fl.tile_candidates(1, 6144, 4096, torch.bfloat16, False, 132, lora_rank=16),
        fl.tile_candidates(17, 6144, 4096, torch.bfloat16, False, 132),
        fl.tile_candidates(1, 6144, 4096, torch.float32, False, 132),
    ):
        assert not any(c.stream_k for c in none)


def test_every_stream_k_shape_compiles_for_sm90_within_its_shared_memory() -> None:
    """Each stream-K shape the fused layer times (qwen3-0.6b and llama3-8b, 1 and 16 rows),
    compiled ahead of time for sm_90 in a process of its own (no interpreter, no GPU), needs
    at most the 227 KiB of shared memory a program of an H100 or H200 may have."""
    pytest.importorskip("triton.backends.nvidia")
    script = Path(__file__).parents[2] / "helpers" / "sm90_shared.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(script), "stream-k"], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {r["op"] for r in rows} == {"qkv", "gate_up", "down"}, rows
    assert all(0 < r["shared"] <= SM90_SHARED_BYTES for r in rows), rows


LLAMA3_8B = {  # projection: (N, K, op)
    "qkv": (6144, 4096, "norm_linear"),
    "o": (4096, 4096, "linear_residual"),
    "gate_up": (14336, 4096, "norm_gate_up"),
    "down": (4096, 14336, "linear_residual"),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_on_the_gpu_llama3_8b_projections_under_stream_k(m: int, name: str) -> None:
    """llama3-8b's four projections (q|k|v 6,144 and o 4,096 over K 4,096, gate-up 2 x 14,336,
    down 4,096 over K 14,336), bf16, every stream-K shape the fused layer times: against
    float64, the same bits on ten calls in a row (parts summed in part order), and the same
    bits replayed from a CUDA graph; the counters back at zero."""
    n, k, op = LLAMA3_8B[name]
    gate_up = op == "norm_gate_up"
    x, w, _ = inputs(m, 2 * n if gate_up else n, k, torch.bfloat16, m)
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(DEVICE, x.dtype)
    if op == "norm_linear":
        want = ref_norm_linear(x, w, 1e-6, None)
    elif gate_up:
        want = ref_norm_gate_up(x, w, 1e-6, None)
    else:
        want = ref_linear_residual(x, w, residual, None)
    sms = fl.num_sms(DEVICE)
    shapes = [c for c in fl.tile_candidates(m, n, k, torch.bfloat16, gate_up, sms) if c.stream_k]
    assert shapes, name
    for cfg in shapes:

        def run(cfg: fl.LinearConfig = cfg) -> torch.Tensor:
            if op == "norm_linear":
                return fl.norm_linear(x, w, 1e-6, config=cfg)
            if gate_up:
                return fl.norm_gate_up(x, w, 1e-6, config=cfg)
            return fl.linear_residual(x, w, residual, config=cfg)

        outs = [run() for _ in range(10)]
        assert_close(outs[0], want, torch.bfloat16, f"{name} {cfg}")
        assert all(torch.equal(o, outs[0]) for o in outs), f"{name} {cfg}: bits vary"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # warm on the capture's stream
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, outs[0]), f"{name} {cfg}: the graph's bits differ"
        assert counters_are_zero(), f"{name} {cfg}"
