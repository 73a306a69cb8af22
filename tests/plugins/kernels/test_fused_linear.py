"""fused_linear's GEMMs (norm_linear, norm_gate_up, linear_residual) against float64 arithmetic.

On a machine without CUDA the kernels run on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1`` set before Triton's first import, as in
tests/plugins/kernels/test_fused_kernels.py); with CUDA the same tests run compiled, small
shapes (tests/plugins/kernels/test_fused_linear_gpu.py has the real ones).

The reference is the same formula in float64 over the very inputs the kernel
reads (bf16/fp16/fp32), so the only error allowed is the kernel's float32
accumulation and its one rounding to the output dtype. Outputs are poisoned
(NaN) so that an unwritten element fails; the split-K arrival counters must be
back at zero after every call.
"""

from __future__ import annotations

import math
import os

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
from pitstop.plugins.kernels.triton_ops import pdl  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FEW = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# small tiles so that the shapes below cross tile borders in M, N and K
SPLITS = [None, 1, 2, 3, 4]  # None: the config rule's choice


def config(split: int | None) -> fl.LinearConfig | None:
    """Small tiles with ``split`` K splits (``None``: the default rule)."""
    return None if split is None else fl.LinearConfig(16, 16, 32, split, 1, 1)


shapes = dict(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    k=st.one_of(st.integers(1, 130), st.sampled_from([32, 64, 96, 128])),
    dtype=st.sampled_from(DTYPES),
    split=st.sampled_from(SPLITS),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)


@FEW
@given(eps=st.sampled_from([1e-6, 1e-5, None]), **shapes)
def test_norm_linear_matches_float64(m, n, k, dtype, split, with_bias, seed, eps) -> None:
    """``rstd(x) * x @ W.T (+ bias)`` over any M, N, K, split or not; inputs left alone."""
    x, w, b = inputs(m, n, k, dtype, seed)
    bias = b if with_bias else None
    x0 = x.clone()
    with poisoned_outputs():
        out = fl.norm_linear(x, w, eps, bias, config=config(split))
    assert_close(out, ref_norm_linear(x, w, eps, bias), dtype, "norm_linear")
    assert torch.equal(x, x0)
    assert counters_are_zero()


@FEW
@given(eps=st.sampled_from([1e-6, None]), **shapes)
def test_norm_gate_up_matches_float64(m, n, k, dtype, split, with_bias, seed, eps) -> None:
    """``silu(g) * u`` over the merged ``[gate | up]`` rows, gate row n with up row F + n."""
    x, w, b = inputs(m, 2 * n, k, dtype, seed)
    bias = b if with_bias else None
    with poisoned_outputs():
        out = fl.norm_gate_up(x, w, eps, bias, config=config(split))
    assert_close(out, ref_norm_gate_up(x, w, eps, bias), dtype, "norm_gate_up")
    assert counters_are_zero()


@FEW
@given(**shapes)
def test_linear_residual_matches_float64(m, n, k, dtype, split, with_bias, seed) -> None:
    """``residual + x @ W.T (+ bias)``, a new tensor; the residual is left alone."""
    x, w, b = inputs(m, n, k, dtype, seed, scale=1.0)
    gen = torch.Generator().manual_seed(seed + 1)
    residual = (4 * torch.randn(m, n, generator=gen)).to(DEVICE, dtype)
    r0 = residual.clone()
    bias = b if with_bias else None
    with poisoned_outputs():
        out = fl.linear_residual(x, w, residual, bias, config=config(split))
    assert out.data_ptr() != residual.data_ptr()
    assert_close(out, ref_linear_residual(x, w, residual, bias), dtype, "linear_residual")
    assert torch.equal(residual, r0)
    assert counters_are_zero()


@pytest.mark.parametrize("split", [1, 4])
def test_strided_rows_and_many_tiles(split: int) -> None:
    """x as a column slice of a wider tensor (row stride != K), several M and N tiles."""
    wide, w, b = inputs(37, 50, 160, torch.bfloat16, 7)
    x = wide[:, 16:112]
    w = w[:, :96].contiguous()
    with poisoned_outputs():
        out = fl.norm_linear(x, w, 1e-6, b, config=config(split))
    assert_close(out, ref_norm_linear(x, w, 1e-6, b), torch.bfloat16, "strided")
    assert counters_are_zero()


def test_split_sum_is_deterministic_and_empty_splits_are_harmless() -> None:
    """Split partials are summed in split order: two calls give the same bits; with more
    splits than K steps (K=40: 2 steps of 32, 8 splits) the empty splits add zeros."""
    x, w, b = inputs(5, 2 * 24, 40, torch.float32, 3)
    cfg = fl.LinearConfig(16, 16, 32, 8, 1, 1)
    first = fl.norm_gate_up(x, w, 1e-6, b, config=cfg)
    second = fl.norm_gate_up(x, w, 1e-6, b, config=cfg)
    assert torch.equal(first, second)
    assert_close(first, ref_norm_gate_up(x, w, 1e-6, b), torch.float32, "empty splits")
    assert counters_are_zero()


def test_zero_rows_and_bad_shapes() -> None:
    """M = 0 gives an empty output without a launch; mismatched shapes are refused."""
    x, w, b = inputs(1, 8, 16, torch.float32, 0)
    assert fl.norm_linear(x[:0], w, 1e-6).shape == (0, 8)
    assert fl.norm_gate_up(x[:0], w, None).shape == (0, 4)
    with pytest.raises(AssertionError):
        fl.norm_linear(x, w[:, :8], 1e-6)
    with pytest.raises(AssertionError):
        fl.norm_linear(x, w.to(torch.bfloat16), 1e-6)
    with pytest.raises(AssertionError):
        fl.linear_residual(x, w, torch.zeros(1, 7, device=DEVICE))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_silu_of_large_gates_stays_finite() -> None:
    """Gates of ±large magnitude: silu(-big) is -0 times u (exp overflows to inf), never NaN."""
    x = torch.ones(2, 32, device=DEVICE)
    w = torch.cat([torch.full((4, 32), -50.0), torch.full((4, 32), 50.0)]).to(DEVICE)
    w[0] = 50.0
    out = fl.norm_gate_up(x, w, None, config=config(2))
    expected = ref_norm_gate_up(x, w, None, None)
    assert torch.isfinite(out).all()
    assert_close(out, expected, torch.float32, "large gates")


# ---------------------------------------------------------------- the config rule


@pytest.mark.parametrize(
    ("m", "n", "k", "gate_up"),
    [
        (1, 4096, 1024, False),  # qwen3-0.6b QKV
        (1, 1024, 2048, False),  # o_proj
        (1, 3072, 1024, True),  # gate-up
        (1, 1024, 3072, False),  # down
        (16, 6144, 4096, False),  # llama3-8b QKV
        (64, 14336, 4096, True),
        (256, 4096, 14336, False),
        (200, 1024, 3072, False),
    ],
)
def test_h200_configs_fill_the_gpu_and_fit_the_workspace(
    m: int, n: int, k: int, gate_up: bool
) -> None:
    """On 132 SMs: splits are powers of two, only where the tiles are too few, each keeps
    at least MIN_K_PER_SPLIT columns, and the workspace holds the launch."""
    cfg = fl.choose_config(m, n, k, torch.bfloat16, gate_up, True, 132)
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    assert cfg.split_k & (cfg.split_k - 1) == 0 and 1 <= cfg.split_k <= fl.MAX_SPLIT
    assert cfg.block_m >= min(16, m) and cfg.block_m <= 128
    if cfg.split_k > 1:
        assert k // cfg.split_k >= fl.MIN_K_PER_SPLIT
        assert tiles * cfg.split_k * (2 if gate_up else 1) <= fl.PROGRAMS_PER_SM * 132
        assert m <= 16 or tiles * cfg.split_k <= fl.PROGRAMS_PER_SM_WIDE * 132
        accs = 2 if gate_up else 1
        floats = tiles * cfg.split_k * (accs * cfg.block_n * cfg.block_m + cfg.block_m)
        assert floats <= fl.WORKSPACE_FLOATS["cuda"]
    if m == 1 and not gate_up:
        assert cfg.split_k > 1  # 16..64 tiles of 64 columns: too few for 132 SMs
    if (m, n, k) == (64, 14336, 4096):
        assert cfg.split_k == 1  # 224 tiles (each two weight tiles): the GPU is full
    assert cfg.num_warps == 4 and (cfg.num_stages <= 4 or not gate_up)


def test_pdl_is_off_here_and_in_the_interpreter() -> None:
    """PDL never turns on for a CPU tensor or under the interpreter, even when asked for."""
    cpu = torch.device("cpu")
    assert not pdl.enabled(cpu) and not pdl.enabled(cpu, True)
    assert pdl.launch_kwargs(False) == {} and pdl.launch_kwargs(True) == {"launch_pdl": True}
    if DEVICE.type == "cpu":
        assert pdl.interpreted()


def test_tile_candidates_add_the_wide_tiles_from_65_to_256_rows() -> None:
    """What the fused layer times on a GPU: the table's launch shape first, then for 65..256
    rows of bf16/fp16 the three wide tiles, each with its K split by the table's rule; fp32
    and short steps only the table's."""
    table = fl.choose_config(128, 4096, 1024, torch.bfloat16, False, True, 132)
    wide = fl.tile_candidates(128, 4096, 1024, torch.bfloat16, False, 132)
    assert wide[0] == table and len(wide) == 1 + len(fl.WIDE_TILES)
    for cfg, tile in zip(wide[1:], fl.WIDE_TILES, strict=True):
        assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == tile
        assert cfg == fl.with_split(tile, 128, 4096, 1024, False, True, 132)
    table64 = fl.choose_config(64, 4096, 1024, torch.bfloat16, False, True, 132)
    assert fl.tile_candidates(64, 4096, 1024, torch.bfloat16, False, 132) == list(
        dict.fromkeys([table64, fl.balanced_split(table64, 64, 4096, 1024, False, 132)])
    )
    assert len(fl.tile_candidates(256, 4096, 1024, torch.float32, False, 132)) == 1
    down = fl.tile_candidates(256, 1024, 3072, torch.bfloat16, False, 132)
    assert all(c.split_k >= 1 and c.num_warps == 4 for c in down)


def test_tile_candidates_add_wider_tiles_for_a_lora_inside() -> None:
    """With a LoRA delta inside (16-bit), the table's tile 128 columns wide joins the timed
    shapes up to 64 rows, and one 256 columns wide up to 16 rows: A's rank rows then cost
    a half and a quarter as much beside the weight's. Each comes with the table's K split
    and the balanced one (fewer column tiles: the table's rule can leave SMs idle)."""
    plain = [
        c for c in fl.tile_candidates(1, 6144, 4096, torch.bfloat16, False, 132) if not c.stream_k
    ]
    every = fl.tile_candidates(1, 6144, 4096, torch.bfloat16, False, 132, lora_rank=16)
    with_lora = [c for c in every if not c.shared_shrink]
    assert every[len(with_lora) :] == [c._replace(shared_shrink=1) for c in with_lora], (
        "up to 16 rows each shape again with the shrink shared"
    )
    assert with_lora[: len(plain)] == plain and len(with_lora) == len(plain) + 4
    extra = with_lora[len(plain) :]
    assert [c.block_n for c in extra] == [128, 128, 256, 256]
    assert [c.split_k for c in extra] == [4, 8, 8, 11], "the table's split, then the balanced"
    assert extra[1] == fl.balanced_split(extra[0], 1, 6144, 4096, False, 132)
    assert all(c.block_m == plain[0].block_m for c in with_lora)
    gate_up = fl.tile_candidates(16, 14336, 4096, torch.bfloat16, True, 132, lora_rank=16)
    gate_up = [c for c in gate_up if not c.shared_shrink]
    wide = [c for c in gate_up if c.block_n == 128]
    assert all(c.num_stages == 2 for c in wide) and [c.split_k for c in wide] == [1, 8]
    assert gate_up[-1].block_n == 256 and gate_up[-1].block_k == 64, "two 256-row tiles a stage"
    gate_up_64 = fl.tile_candidates(64, 3072, 1024, torch.bfloat16, True, 132, lora_rank=16)
    assert gate_up_64[-1].block_n == 128 and gate_up_64[-1].block_k == 64, "K step 128: 232 KiB"
    at_64 = fl.tile_candidates(64, 4096, 1024, torch.bfloat16, False, 132, lora_rank=16)
    assert max(c.block_n for c in at_64) == 128, "no 256-column accumulators of 64 rows"
    assert not any(c.shared_shrink for c in at_64), "shared only up to 16 rows"
    assert fl.tile_candidates(128, 4096, 1024, torch.bfloat16, False, 132, lora_rank=16) == (
        fl.tile_candidates(128, 4096, 1024, torch.bfloat16, False, 132)
    )
    fp32 = fl.tile_candidates(1, 6144, 4096, torch.float32, False, 132, lora_rank=16)
    assert all(c.block_n == 64 for c in fp32), "no wide tile for fp32"


def test_balanced_split_spreads_few_rows_over_the_sms() -> None:
    """Up to 64 rows the table's tile also comes with the K split that gives the busiest SM
    the fewest K columns: llama3-8b's QKV at one row (96 column tiles on 132 SMs) takes 4
    splits (three quarter-tiles on the busiest SM) where the doubling rule's 2 leave it a
    whole tile's columns; every split keeps at least MIN_K_PER_SPLIT columns and none is empty."""
    table = fl.choose_config(1, 6144, 4096, torch.bfloat16, False, True, 132)
    assert table.split_k == 2
    balanced = fl.balanced_split(table, 1, 6144, 4096, False, 132)
    assert balanced.split_k == 4 and balanced._replace(split_k=2) == table
    assert fl.tile_candidates(1, 6144, 4096, torch.bfloat16, False, 132)[:2] == [table, balanced]
    for n, k in ((4096, 14336), (3072, 1024), (1024, 3072), (28672, 4096)):
        cfg = fl.balanced_split(table, 1, n, k, False, 132)
        per_split = math.ceil(math.ceil(k / cfg.split_k) / cfg.block_k) * cfg.block_k
        assert cfg.split_k == 1 or per_split >= fl.MIN_K_PER_SPLIT
        assert math.ceil(k / per_split) == cfg.split_k, "no empty split"


def test_tile_candidates_add_the_table_tile_unsplit_up_to_16_rows() -> None:
    """A step of up to 16 rows also times the table's tile over the whole of K (no split-K
    partials or last arriver's pass), with deeper stages where a stage holds one weight tile,
    where the unsplit grid has at least a third as many programs as the SMs."""
    every = fl.tile_candidates(1, 6144, 4096, torch.bfloat16, False, 132)  # llama3-8b: 96 tiles
    qkv = [c for c in every if not c.stream_k]  # stream-K: test_fused_linear_stream_k.py
    table = qkv[0]
    assert table.split_k > 1
    assert qkv[-2:] == [table._replace(split_k=1), table._replace(split_k=1, num_stages=6)]
    gate_up = fl.tile_candidates(16, 3072, 1024, torch.bfloat16, True, 132)
    unsplit = [c for c in gate_up if c.split_k == 1 and not c.stream_k]
    assert unsplit == [gate_up[0]._replace(split_k=1)]
    assert all(c.num_stages <= 4 for c in gate_up), "two weight tiles a stage"
    o_small = fl.tile_candidates(1, 1024, 2048, torch.bfloat16, False, 132)  # 16 tiles
    assert all(c.split_k > 1 for c in o_small if not c.stream_k)
    at_17 = fl.tile_candidates(17, 6144, 4096, torch.bfloat16, False, 132)
    assert all(c.num_stages < 6 for c in at_17), "not above 16 rows"
    assert len(fl.tile_candidates(1, 6144, 4096, torch.float32, False, 132)) == 2
