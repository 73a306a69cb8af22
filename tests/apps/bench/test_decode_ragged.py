"""``benchmarks/decode_ragged.py`` (issue 44) on CPU: its ragged batches are what they say.

Timing needs CUDA graphs; here the batches' metadata is checked through the decode kernel
in Triton's interpreter against the reference (any split count), and the three layouts read
the same bytes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from helpers.scripts import benchmark_script  # noqa: E402

pytest.importorskip("triton")


def test_ragged_batches_read_the_same_bytes_and_decode_right() -> None:
    dr = benchmark_script("decode_ragged")
    batches = dr.layouts(batch=5, low=3, high=40, seed=1)
    ragged = batches["ragged"]
    assert sorted(ragged, reverse=True) == batches["ragged-sorted"] != ragged
    assert len(set(ragged)) > 1 and min(ragged) >= 3 and max(ragged) <= 40
    assert abs(sum(batches["uniform"]) - sum(ragged)) <= len(ragged) // 2 + 1
    from pitstop.plugins.kernels import reference
    from pitstop.plugins.kernels.triton_ops.paged_attention import PagedAttention

    torch.manual_seed(0)
    q, k, v, meta, kv_scale = dr.inputs(ragged, "cpu")
    assert kv_scale is None
    q, k, v = q.float(), k.float(), v.float()
    truth = reference.paged_attention(q, k, v, meta, dr.HEAD_SIZE**-0.5)
    for splits in (1, 2):
        attn = PagedAttention(torch.device("cpu"), torch.float32, 64)
        attn.num_splits = lambda n, h, s=splits: s
        out = attn(q, k, v, meta, dr.HEAD_SIZE**-0.5)
        assert torch.allclose(out, truth, atol=1e-4, rtol=1e-4), f"{splits} splits"


def test_an_e4m3_batch_holds_its_values_quantized_and_reads_a_byte_an_element() -> None:
    dr = benchmark_script("decode_ragged")
    contexts = [5, 20, 33]
    q, k, v, meta, kv_scale = dr.inputs(contexts, "cpu", "e4m3")
    assert k.dtype == v.dtype == torch.float8_e4m3fn
    assert kv_scale.tolist() == pytest.approx([0.05, 0.02])
    assert dr.step_bytes(contexts, "e4m3") < dr.step_bytes(contexts, "bf16")
    per_token = 2 * dr.KV_HEADS * dr.HEAD_SIZE  # K and V elements a token
    q_out = 2 * len(contexts) * dr.HEADS * dr.HEAD_SIZE * 2
    assert dr.step_bytes(contexts, "e4m3") == sum(contexts) * per_token + q_out
