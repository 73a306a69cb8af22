"""The Triton dequant-GEMV kernel against GGUFLinear's exact CPU forward (issue 33).

Without CUDA the kernel runs on CPU tensors through Triton's interpreter:
``TRITON_INTERPRET=1`` must be set before the kernel's module is first imported (its
``@triton.jit`` reads it), hence the first lines. Shapes are small (the interpreter runs
each program in numpy); ragged row counts and block counts that are no multiple of the
kernel's group exercise its masks. The kernel sums in another order than the BLAS, so
the bound is float32 rounding, not bit equality. The interpreter runs any Python, so one
test also compiles the kernel for the H200 (sm_90, ptxas included) in a subprocess, no
GPU needed: what Triton's compiler would refuse fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import pytest  # noqa: E402
from helpers.gguf_blocks import quantized, random_blocks, smollm2_tensors  # noqa: E402

pytest.importorskip("triton")

from pitstop.plugins.weight_formats import gguf_gemv as gemv  # noqa: E402
from pitstop.plugins.weight_formats.gguf_linear import GGUFLinear  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TYPES = ["Q8_0", "Q4_0", "Q4_1"]
SHAPES = [(40, 96, 1), (64, 512, 3), (33, 288, 2)]  # (out, in, batch): 3, 16 and 9 blocks a row
K_TYPES = ["Q4_K", "Q6_K"]
K_SHAPES = [(40, 256, 1), (33, 768, 2)]  # one and three super-blocks a row


def _check(layer: GGUFLinear, batch: int, seed: int) -> None:
    x = torch.randn(batch, layer.in_features, generator=torch.Generator().manual_seed(seed))
    want = layer(x)  # the CPU path: bit-equal to dequantize-then-matmul
    raw = layer.raw.to(DEVICE)
    got = gemv.dequant_gemv(x.to(DEVICE), raw, layer.qtype_name, layer.out_features).cpu()
    assert got.dtype == torch.float32 and got.shape == (batch, layer.out_features)
    assert torch.isfinite(got).all()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale, layer.qtype_name


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(("out", "cols", "batch"), SHAPES)
def test_kernel_matches_the_cpu_forward(name: str, out: int, cols: int, batch: int) -> None:
    layer = GGUFLinear(torch.from_numpy(quantized(name, out, cols, seed=out)), name, (out, cols))
    _check(layer, batch, seed=cols)


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize(("out", "cols", "batch"), K_SHAPES)
def test_k_quant_kernel_matches_the_cpu_forward(name: str, out: int, cols: int, batch: int) -> None:
    # random valid super-blocks (gguf cannot quantize K-quants): every scale, min and
    # quant bit pattern, f16 scales over their whole finite range
    raw = random_blocks(name, out, cols, seed=out + cols)
    _check(GGUFLinear(torch.from_numpy(raw), name, (out, cols)), batch, seed=out)


def test_kernel_on_the_smollm2_weights() -> None:
    # a Q4_1 projection of the shipped file, and 64 rows of its Q8_0 embedding (small enough
    # for the interpreter)
    tensors = smollm2_tensors()
    _check(GGUFLinear.from_gguf_tensor(tensors["blk.0.attn_k.weight"]), batch=2, seed=1)
    embed = GGUFLinear.from_gguf_tensor(tensors["token_embd.weight"])
    rows = GGUFLinear(embed.raw[:64].clone(), "Q8_0", (64, embed.in_features))
    _check(rows, batch=1, seed=2)


def test_supports_and_refuses() -> None:
    assert all(gemv.supports(name) for name in TYPES + K_TYPES)
    assert not gemv.supports("Q5_K") and not gemv.supports("IQ2_XXS")
    raw = torch.zeros(176, dtype=torch.uint8)
    with pytest.raises(
        NotImplementedError, match="reads Q8_0, Q4_0, Q4_1, Q4_K, Q6_K blocks, not Q5_K"
    ):
        gemv.dequant_gemv(torch.zeros(1, 256), raw, "Q5_K", 1)
    with pytest.raises(ValueError, match="raw must be 68 uint8 bytes"):
        gemv.dequant_gemv(torch.zeros(1, 32), torch.zeros(34, dtype=torch.uint8), "Q8_0", 2)


# Compiles the kernel for the H200 (sm_90) without a GPU: the interpreter runs any Python,
# so only a real compile catches what Triton's compiler refuses (types, shapes, constexprs).
_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pitstop.plugins.weight_formats import gguf_gemv as g

    args = ["x_ptr", "w_ptr", "y_ptr", "N", "n_blocks", "row_bytes", "stride_x", "stride_y"]
    kinds = ["*fp32", "*u8", "*fp32"] + ["i32"] * 5
    for kind, qs_at, block_bytes in ((0, 2, 34), (1, 2, 18), (2, 4, 20)):
        consts = dict(KIND=kind, QS_AT=qs_at, BLOCK_BYTES=block_bytes, BLOCK_N=g.BLOCK_N,
                      GROUP=g.GROUP)
        signature = dict(zip(args, kinds)) | {name: "constexpr" for name in consts}
        at = {(i,): consts[n] for i, n in enumerate(signature) if n in consts}
        src = ASTSource(fn=g._dequant_gemv_kernel, signature=signature, constexprs=at)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], kind
    for kind in (0, 1):
        signature = dict(zip(args, kinds)) | {"KIND": "constexpr", "BLOCK_N": "constexpr"}
        at = {(8,): kind, (9,): g.BLOCK_N}
        src = ASTSource(fn=g._kquant_gemv_kernel, signature=signature, constexprs=at)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], kind
    print("compiled")
    """
)


def test_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_uses_the_kernel_and_falls_back() -> None:
    raw = torch.from_numpy(quantized("Q4_1", 300, 1024))
    on_cpu = GGUFLinear(raw, "Q4_1", (300, 1024))
    on_gpu = GGUFLinear(raw.clone(), "Q4_1", (300, 1024)).to("cuda")
    assert on_gpu.raw.is_cuda and on_gpu.resident_bytes() == on_cpu.file_bytes
    x = torch.randn(4, 1024)
    want = on_cpu(x)
    got = on_gpu(x.cuda()).cpu()  # the Triton kernel
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    big = torch.randn(gemv.MAX_BATCH + 1, 1024)  # dequantize + matmul instead
    want = on_cpu(big)
    got = on_gpu(big.cuda()).cpu()
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
