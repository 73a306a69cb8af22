"""GGUF blocks dequantized in torch, bit for bit as ``gguf.quants.dequantize`` (issue 33).

Every type of :mod:`pitstop.plugins.weight_formats.gguf_blocks` is checked on random valid
blocks (random bytes with finite f16 scales: every field value the format allows) and,
where gguf can quantize the type, on blocks gguf made from real numbers; then every
tensor of the shipped SmolLM2 GGUF (Q4_1, Q8_0 and F32) is compared with the numpy
reference. "Equal" means the same float32 bits (-0 is not 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.gguf_blocks import (
    QUANTIZABLE,
    one_thread,
    quantized,
    random_blocks,
    reference,
    same_bits,
    smollm2_tensors,
)

from pitstop.plugins.weight_formats import gguf_blocks
from pitstop.plugins.weight_formats.gguf_blocks import (
    LAYOUTS,
    QuantType,
    UnsupportedQuantType,
    dequantize,
    dequantize_blocks,
    layout_of,
    nonfinite_blocks,
    supported_types,
)

gguf = pytest.importorskip("gguf")

ALL = supported_types()
REQUIRED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F32")  # issue 33 + the shipped file's
BLOCKED = [name for name in ALL if layout_of(name).quantized]


def test_the_required_types_are_supported() -> None:
    assert set(REQUIRED) <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_layout_agrees_with_gguf(name: str) -> None:
    layout = layout_of(name)
    qtype = gguf.GGMLQuantizationType[name]
    assert int(qtype) == int(layout.qtype)
    assert gguf.GGML_QUANT_SIZES[qtype] == (layout.block_elems, layout.block_bytes)
    offset = 0
    for field in layout.fields:  # the fields tile the block, in order
        assert field.offset == offset and field.size > 0, field
        offset += field.size
    assert offset == layout.block_bytes


@pytest.mark.parametrize("name", ALL)
def test_random_blocks_dequantize_exactly(name: str) -> None:
    cols = 2 * layout_of(name).block_elems if name in BLOCKED else 64
    for seed in range(3):
        raw = random_blocks(name, rows=48, cols=cols, seed=seed)
        want = reference(raw, name)
        got = dequantize(torch.from_numpy(raw), name, want.shape)
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
        assert same_bits(got.numpy(), want), name


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_gguf_quantized_blocks_dequantize_exactly(name: str) -> None:
    raw = quantized(name, rows=37, cols=320, seed=1)
    want = reference(raw, name)
    assert want.shape == (37, 320)
    got = dequantize(torch.from_numpy(raw), gguf.GGMLQuantizationType[name], (37, 320))
    assert same_bits(got.numpy(), want), name


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_three_dimensional_tensors_and_other_dtypes(name: str) -> None:
    layout = layout_of(name)
    raw = random_blocks(name, rows=6, cols=layout.block_elems, seed=4)
    want = reference(raw, name).reshape(2, 3, layout.block_elems)
    flat = torch.from_numpy(raw).reshape(-1)  # any shape of raw bytes is accepted
    got = dequantize(flat, int(layout.qtype), (2, 3, layout.block_elems))
    assert same_bits(got.numpy(), want)
    as_bf16 = dequantize(flat, name, (2, 3, layout.block_elems), torch.bfloat16)
    assert torch.equal(as_bf16, torch.from_numpy(want).to(torch.bfloat16))


def test_dequantize_blocks_decodes_block_rows() -> None:
    raw = random_blocks("Q4_K", rows=3, cols=256, seed=5)
    got = dequantize_blocks(torch.from_numpy(raw), QuantType.Q4_K)
    assert same_bits(got.numpy(), reference(raw, "Q4_K"))
    with pytest.raises(ValueError, match=r"\(n, 144\) uint8"):
        dequantize_blocks(torch.from_numpy(raw).reshape(-1), "Q4_K")


def _check_file_tensor(t: object) -> None:
    shape = tuple(int(s) for s in reversed(list(t.shape)))  # ggml order -> torch order
    raw = torch.from_numpy(np.array(t.data).view(np.uint8))
    want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    got = dequantize(raw, t.tensor_type, shape)
    assert same_bits(got.numpy(), want.reshape(shape)), t.name
    assert layout_of(t.tensor_type).tensor_bytes(shape) == int(t.n_bytes), t.name
    assert nonfinite_blocks(raw, t.tensor_type) == 0, t.name


def test_smollm2_holds_q4_1_q8_0_and_f32() -> None:
    kinds: dict[str, int] = {}
    for t in smollm2_tensors().values():
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    # every 2-D weight but the (tied) embedding is Q4_1; the norms are F32
    assert kinds == {"Q8_0": 1, "Q4_1": 210, "F32": 61}
    assert smollm2_tensors()["token_embd.weight"].tensor_type.name == "Q8_0"


def test_smollm2_every_tensor_dequantizes_exactly() -> None:
    # all 272 (97 MB of blocks): about 1.5 s on one thread
    with one_thread():
        for t in smollm2_tensors().values():
            _check_file_tensor(t)


@pytest.mark.parametrize(
    "qtype",
    [
        "Q8_K",
        "IQ2_XXS",
        gguf.GGMLQuantizationType.IQ4_NL,
        99,
        "Q7_7",
        int(gguf.GGMLQuantizationType.TQ1_0),
    ],
)
def test_unsupported_type_is_a_clear_error(qtype: object) -> None:
    with pytest.raises(UnsupportedQuantType) as err:
        dequantize(torch.zeros(64, dtype=torch.uint8), qtype, (1, 256))  # type: ignore[arg-type]
    message = str(err.value)
    assert "not supported" in message and "Q4_K" in message and "Q8_0" in message
    name = getattr(qtype, "name", str(qtype))
    assert name in message
    assert isinstance(err.value, NotImplementedError)  # as gguf's own refusal


def test_wrong_bytes_or_shape_is_an_error() -> None:
    raw = torch.zeros(34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="takes 68 bytes, not 34"):
        dequantize(raw, "Q8_0", (2, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(raw, "Q8_0", (1, 33))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(raw.to(torch.int8), "Q8_0", (1, 32))


def test_layouts_table_is_keyed_by_type() -> None:
    assert all(layout.qtype == key for key, layout in LAYOUTS.items())
    assert gguf_blocks.QK_K == gguf.QK_K


@pytest.mark.parametrize("name", ALL)
def test_nonfinite_blocks_finds_a_broken_scale(name: str) -> None:
    layout = layout_of(name)
    cols = layout.block_elems * 4
    raw = random_blocks(name, rows=8, cols=cols, seed=8)
    assert nonfinite_blocks(torch.from_numpy(raw), name) == 0
    assert np.isfinite(reference(raw, name)).all()
    broken = raw.reshape(-1, layout.block_bytes).copy()
    # a NaN in the first float field of blocks 3 and 17 (for BF16: a float32 NaN's top half)
    f32_nan = np.array([np.nan], np.float32).view(np.uint8)
    f16_nan = np.array([np.nan], np.float16).view(np.uint8)
    field = next(f for f in layout.fields if f.holds.startswith(("f16", "float", "bfloat")))
    value = {"F32": f32_nan, "BF16": f32_nan[2:]}.get(name, f16_nan)
    for block in (3, 17):
        broken[block, field.offset : field.offset + field.size] = value
    assert nonfinite_blocks(torch.from_numpy(broken.reshape(-1)), name) == 2
    assert not np.isfinite(reference(broken.reshape(raw.shape), name)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ALL)
def test_cuda_dequantize_is_exact(name: str) -> None:
    cols = layout_of(name).block_elems * 4 if name in BLOCKED else 64
    raw = random_blocks(name, rows=64, cols=cols, seed=7)
    got = dequantize(torch.from_numpy(raw).cuda(), name, (64, cols))
    assert got.is_cuda
    assert same_bits(got.cpu().numpy(), reference(raw, name)), name
