"""GGUFLinear: a weight kept as its GGUF blocks, multiplied by dequantizing on the fly (issue 33).

On the CPU ``forward`` must be bit-equal to the reference ``x @ dequantize(W).T`` in
float32, whatever the tiling (small ``tile_elems`` force many tiles and a ragged last
one); the layer must hold no more than its blocks, and for the shipped SmolLM2 file all
quantized tensors together must stay within 1.2x their bytes in the file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.gguf_blocks import one_thread, quantized, random_blocks, smollm2_tensors

from pitstop.plugins.weight_formats.gguf_blocks import UnsupportedQuantType, dequantize, layout_of
from pitstop.plugins.weight_formats.gguf_linear import (
    TILE_ALIGN,
    GGUFLinear,
    tile_bounds,
)

MEMORY_RULE = 1.2  # issue 33: resident weights within 1.2x the file's tensor bytes
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _layer(name: str, out: int, cols: int, seed: int = 0, **kwargs: object) -> GGUFLinear:
    gguf_made = name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
    raw = (quantized if gguf_made else random_blocks)(name, out, cols, seed)
    return GGUFLinear(torch.from_numpy(raw), name, (out, cols), **kwargs)  # type: ignore[arg-type]


def test_tile_bounds_cover_the_rows_with_a_long_last_tile() -> None:
    assert tile_bounds(10, 64) == [(0, 10)]
    assert tile_bounds(64, 64) == [(0, 64)]
    assert tile_bounds(200, 64) == [(0, 64), (64, 128), (128, 200)]
    assert tile_bounds(577, 192) == [(0, 192), (192, 384), (384, 577)]


@pytest.mark.parametrize("name", TYPES)
def test_forward_is_the_dequantize_then_matmul_reference(name: str) -> None:
    cols = 2 * layout_of(name).block_elems
    layer = _layer(name, 200, cols, tile_elems=1)  # tiles of 64 rows, the last 72
    assert layer.tile_rows == TILE_ALIGN
    weight = layer.dequantize_weight()
    with one_thread():
        for batch in (1, 3, 16):
            x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
            got = layer(x)
            assert got.shape == (batch, 200)
            assert torch.equal(got, x @ weight.T), (name, batch)


@pytest.mark.parametrize("out", [1, 63, 65, 577])
def test_ragged_row_counts_stay_exact(out: int) -> None:
    layer = _layer("Q4_1", out, 96, seed=out, tile_elems=64 * 96)
    weight = layer.dequantize_weight()
    with one_thread():
        for batch in (1, 2, 7):
            x = torch.randn(batch, 96, generator=torch.Generator().manual_seed(out + batch))
            assert torch.equal(layer(x), x @ weight.T), (out, batch)


def test_on_more_threads_the_bound_is_float32_rounding() -> None:
    # MKL splits a matmul's columns among its threads, and where it splits changes a
    # column's summation order: even the whole-matrix matmul is not bit-equal between one
    # and two threads. The dequantized weights are the same bits; the sums agree to rounding.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        layer = _layer("Q8_0", 4099, 576, seed=9, tile_elems=192 * 576)
        weight = layer.dequantize_weight()
        for batch in (1, 16):
            x = torch.randn(batch, 576, generator=torch.Generator().manual_seed(batch))
            want = x @ weight.T
            assert (layer(x) - want).abs().max() <= 1e-6 * want.abs().max(), batch
    finally:
        torch.set_num_threads(threads)


def test_leading_dimensions_bias_and_dtype() -> None:
    bias = torch.randn(80)
    layer = _layer("Q8_0", 80, 64, seed=3, bias=bias)
    weight = layer.dequantize_weight()
    x = torch.randn(2, 5, 64)
    got = layer(x)
    assert got.shape == (2, 5, 80)
    assert torch.equal(got, (x.reshape(10, 64) @ weight.T + bias).reshape(2, 5, 80))
    low = layer(x.to(torch.bfloat16))  # weights rounded to bf16, a bf16 matmul
    assert low.dtype == torch.bfloat16
    assert (low.float() - got).abs().max() <= 2e-2 * got.abs().max()


def test_rows_is_an_embedding_lookup() -> None:
    layer = _layer("Q6_K", 40, 256, seed=2)
    ids = torch.tensor([[0, 39, 7], [7, 7, 1]])
    got = layer.rows(ids)
    assert got.shape == (2, 3, 256)
    assert torch.equal(got, layer.dequantize_weight()[ids])


def test_resident_bytes_are_the_blocks() -> None:
    layer = _layer("Q4_K", 16, 512)
    assert layer.file_bytes == 16 * 2 * 144
    assert layer.resident_bytes() == layer.file_bytes
    with_bias = _layer("Q4_K", 16, 512, bias=torch.zeros(16))
    assert with_bias.resident_bytes() == layer.file_bytes + 16 * 4
    assert "qtype=Q4_K" in repr(layer)


def test_bad_weights_and_inputs_are_errors() -> None:
    raw = torch.zeros(2 * 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="is 68 uint8 bytes, not 34"):
        GGUFLinear(raw[:34], "Q8_0", (2, 32))
    with pytest.raises(ValueError, match="2-D"):
        GGUFLinear(raw, "Q8_0", (2, 32, 1))
    with pytest.raises(UnsupportedQuantType, match="IQ2_XXS.*supported: F32"):
        GGUFLinear(raw, "IQ2_XXS", (2, 32))
    layer = GGUFLinear(raw, "Q8_0", (2, 32))
    with pytest.raises(ValueError, match="input of 16 features for 32"):
        layer(torch.zeros(1, 16))


def test_smollm2_weights_stay_within_the_memory_rule() -> None:
    resident = in_file = 0
    layers = 0
    for t in smollm2_tensors().values():
        if len(t.shape) != 2:  # the norms (F32 vectors) are no linear layer
            continue
        layer = GGUFLinear.from_gguf_tensor(t)
        assert layer.file_bytes == int(t.n_bytes), t.name
        resident += layer.resident_bytes()
        in_file += int(t.n_bytes)
        layers += 1
    assert layers == 211  # 210 Q4_1 weights and the Q8_0 embedding
    assert resident <= MEMORY_RULE * in_file
    assert resident == in_file  # in fact nothing but the blocks


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.5.attn_k.weight"])
def test_smollm2_forward_is_exact(name: str) -> None:
    layer = GGUFLinear.from_gguf_tensor(smollm2_tensors()[name])
    t = smollm2_tensors()[name]
    shape = (layer.out_features, layer.in_features)
    want_w = dequantize(torch.from_numpy(np.array(t.data)), t.tensor_type, shape)
    with one_thread():
        for batch in (1, 16):
            x = torch.randn(batch, layer.in_features)
            assert torch.equal(layer(x), x @ want_w.T), (name, batch)


def test_smollm2_tied_embedding_forward_and_lookup() -> None:
    layer = GGUFLinear.from_gguf_tensor(smollm2_tensors()["token_embd.weight"])
    assert (layer.qtype_name, layer.out_features, layer.in_features) == ("Q8_0", 49152, 576)
    with one_thread():
        weight = layer.dequantize_weight()
        x = torch.randn(2, 576)
        assert torch.equal(layer(x), x @ weight.T)
        ids = torch.tensor([0, 1, 49151, 1234])
        assert torch.equal(layer.rows(ids), weight[ids])
