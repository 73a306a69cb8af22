"""The fp8 weight format's Triton kernels against its float32 reference (issue 33).

``fp8_gemm.quantize_rows`` must give the reference's e4m3 bytes and scales bit for
bit; ``fp8_gemm.skinny_linear`` (weight-only) its float32 reference up to the order of
the sums (every product of an e4m3 value and a bf16 or float32 one is exact in float32). Without CUDA the kernels
run in Triton's interpreter: ``TRITON_INTERPRET=1`` is set before the kernel module
is first imported. One test compiles both kernels for the H200 (sm_90) in a
subprocess, no GPU needed; the GPU tests run them on the device inside an engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import pytest  # noqa: E402

pytest.importorskip("triton")

from pitstop.plugins.weight_formats import fp8 as f8  # noqa: E402
from pitstop.plugins.weight_formats import fp8_gemm  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (rows, out_features, in_features, bias): one row (CUDA cores), several rows (tensor
# cores), ragged N and K that no tile divides, up to SKINNY_MAX_ROWS rows
CASES = [
    (1, 40, 96, False),
    (1, 33, 200, True),
    (3, 33, 200, True),
    (5, 48, 128, True),
    (16, 64, 256, False),
]


def _inputs(rows: int, out_features: int, in_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # magnitudes over five decades, so that some values of x fall below e4m3's normals
    span = torch.logspace(-3, 2, in_features)
    x = torch.randn(rows, in_features, generator=gen) * span
    w = torch.randn(out_features, in_features, generator=gen)
    qweight, scale = f8.quantize_rows(w)
    weight = f8.Fp8Weight(qweight.contiguous(), scale.reshape(1, -1).contiguous(), False)
    bias = torch.randn(out_features, generator=gen)
    return x.to(DTYPE), weight, bias.to(DTYPE)


@pytest.mark.parametrize(("rows", "out_features", "in_features", "with_bias"), CASES)
@pytest.mark.parametrize("tiles", [(16, 64), (8, 128)])
def test_skinny_linear_is_the_weight_only_product(
    rows: int, out_features: int, in_features: int, with_bias: bool, tiles: tuple[int, int]
) -> None:
    if rows > 1 and tiles[0] < 16:
        pytest.skip("several rows take a tensor-core tile: BLOCK_N of 16 or more")
    x, weight, bias = _inputs(rows, out_features, in_features, seed=rows + in_features)
    bias = bias if with_bias else None
    want = f8.weight_only_reference(x, weight.qweight, weight.scale, DTYPE)
    if bias is not None:
        want = want + bias
    got = fp8_gemm.skinny_linear(
        x.to(DEVICE),
        weight.qweight.to(DEVICE),
        weight.scale.to(DEVICE),
        None if bias is None else bias.to(DEVICE),
        out_dtype=DTYPE,
        tiles=fp8_gemm.SkinnyTiles(block_n=tiles[0], block_k=tiles[1]),  # several N and K tiles
    ).cpu()
    assert got.dtype == DTYPE and got.shape == (rows, out_features)
    # float32 sums in another order; in bf16 on the GPU one rounding step of the output apart
    ulp = 2.0**-7 if DTYPE == torch.bfloat16 else 1e-6
    bound = ulp * want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= bound
    # weight-only is closer to the dense product than the per-token fp8 product is
    dense = F.linear(x.float(), weight.qweight.float() * weight.scale.reshape(-1, 1))
    xq, x_scale = f8.quantize_rows(x)
    w8a8 = f8.reference_gemm(xq, x_scale, weight, torch.float32)
    assert (want.float() - (dense + (0 if bias is None else bias.float()))).abs().max() <= (
        (w8a8 - dense).abs().max() + bound
    )


def test_skinny_linear_keeps_a_zero_row_zero_and_refuses_wide_steps() -> None:
    x, weight, _ = _inputs(2, 16, 64, seed=3)
    x[0] = 0.0  # the reference's amax floor (1e-12) keeps it zero, never NaN
    dev_w = weight.qweight.to(DEVICE)
    got = fp8_gemm.skinny_linear(
        x.to(DEVICE), dev_w, weight.scale.to(DEVICE), None, out_dtype=DTYPE
    ).cpu()
    assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.isfinite(got).all()
    wide = torch.zeros(fp8_gemm.SKINNY_MAX_ROWS + 1, 64, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="up to 16 rows"):
        fp8_gemm.skinny_linear(wide, dev_w, weight.scale.to(DEVICE), None, out_dtype=DTYPE)


@pytest.mark.parametrize(("rows", "cols"), [(1, 96), (4, 200), (3, 4096 + 8)])
def test_quantize_rows_is_the_reference_bit_for_bit(rows: int, cols: int) -> None:
    x, _, _ = _inputs(rows, 8, cols, seed=cols)
    x[-1] = 0.0  # an all-zero row: the amax floor, as the reference's
    want_q, want_scale = f8.quantize_rows(x)
    got_q, got_scale = fp8_gemm.quantize_rows(x.to(DEVICE))
    assert got_q.dtype == torch.float8_e4m3fn and got_scale.shape == (rows, 1)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_scale.cpu(), want_scale)


def test_skinny_rows_setting_is_bounded() -> None:
    from pitstop.errors import ConfigError

    assert f8.Fp8Settings(skinny_rows=0).skinny_rows == 0
    with pytest.raises(ConfigError, match="at most 16"):
        f8.Fp8Settings(skinny_rows=17)
    # the settings' bound is the kernel's tile of rows (fp8.py repeats it to import no Triton)
    assert f8.SKINNY_MAX_ROWS == fp8_gemm.SKINNY_MAX_ROWS


def test_skinny_tiles_setting_is_parsed_and_checked() -> None:
    from pitstop.errors import ConfigError

    assert f8.parse_skinny_tiles("auto") == (None, None)
    assert f8.parse_skinny_tiles("8,1024,4,3") == ((8, 1024, 4, 3), None)
    assert f8.parse_skinny_tiles("auto;32,256,8,3") == (None, (32, 256, 8, 3))
    for bad, why in [
        ("8,1024,4", "four positive integers"),
        ("12,1024,4,3", "powers of two"),
        ("8,512,4,3;8,512,4,3", "at least 16"),
        ("a;b;c", "more than two"),
    ]:
        with pytest.raises(ConfigError, match=why):
            f8.Fp8Settings(skinny_tiles=bad)


# Compiles both kernels for the H200 (sm_90) without a GPU: the interpreter runs any Python,
# so only a real compile catches what Triton's compiler refuses (fp8 dot shapes, constexprs).
_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pitstop.plugins.weight_formats import fp8_gemm as g

    names = ["x_ptr", "w_ptr", "w_scale_ptr", "bias_ptr", "y_ptr", "M", "N", "K",
             "stride_x", "stride_w", "stride_y"]
    kinds = ["*bf16", "*fp8e4nv", "*fp32", "*bf16", "*bf16"] + ["i32"] * 6
    for block_m, block_n, block_k in ((1, 8, 1024), (1, 16, 512), (16, 16, 256), (16, 32, 128)):
        consts = dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        signature = dict(zip(names, kinds)) | {name: "constexpr" for name in consts}
        at = {(i,): consts[n] for i, n in enumerate(signature) if n in consts}
        src = ASTSource(fn=g._skinny_kernel, signature=signature, constexprs=at)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_stages": 3})
        assert kernel.asm["cubin"], (block_m, block_n, block_k)
    signature = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "K": "i32",
                 "stride_x": "i32", "stride_q": "i32", "BLOCK_K": "constexpr"}
    src = ASTSource(fn=g._quantize_rows_kernel, signature=signature, constexprs={(6,): 2048})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
    print("compiled")
    """
)


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
