"""The CPU-checkable parts of cuDNN's long prefills (``fused.cudnn_prefill``): the merge of
two attention results by their log-sum-exp rows (a Triton kernel: the interpreter here),
and which steps qualify. The cuDNN calls themselves run on the H200:
``tests/plugins/kernels/test_fused_gpu.py -k cudnn``."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pitstop.plugins.kernels.cudnn_prefill import CHUNK_FACTOR, all_long, merge_by_lse  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Unmasked attention of ``q [H, n, D]`` over ``k``/``v`` ``[H, m, D]`` in float64, and its
    natural-log log-sum-exp rows ``[H, n]``."""
    s = torch.einsum("hnd,hmd->hnm", q.double(), k.double()) * scale
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


@settings(max_examples=12, deadline=None)
@given(
    heads=st.integers(1, 4),
    n=st.integers(1, 9),
    split=st.integers(1, 20),
    rest=st.integers(1, 20),
    d=st.sampled_from([16, 24, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_merge_by_lse_equals_attention_over_all_keys(
    heads: int, n: int, split: int, rest: int, d: int, dtype: torch.dtype, seed: int
) -> None:
    """Attention over keys ``[0, split)`` and over ``[split, split + rest)``, merged, equals
    attention over all of them; written into a strided ``[n, H, D]`` view (the engine's
    ``out[start:end]`` of a flat batch)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, d, generator=gen) * 2
    k = torch.randn(heads, split + rest, d, generator=gen) * 2
    v = torch.randn(heads, split + rest, d, generator=gen)
    scale = d**-0.5
    o_a, lse_a = _attention_with_lse(q, k[:, :split], v[:, :split], scale)
    o_b, lse_b = _attention_with_lse(q, k[:, split:], v[:, split:], scale)
    expected, _ = _attention_with_lse(q, k, v, scale)
    flat = torch.full((n + 3, heads, d), float("nan"), dtype=dtype, device=DEVICE)
    out = flat[1 : n + 1]
    merge_by_lse(
        o_a.to(dtype).to(DEVICE),
        lse_a.float().to(DEVICE),
        o_b.to(dtype).to(DEVICE),
        lse_b.float().to(DEVICE),
        out,
    )
    got = out.double().cpu().transpose(0, 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - expected).abs().max().item() <= tol * expected.abs().max().item() + 1e-6
    assert flat[0].isnan().all() and flat[n + 1 :].isnan().all()  # nothing outside the view


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "expected"),
    [
        ([2048], [2048], True),  # a fresh prompt at the threshold
        ([2047], [2047], False),
        ([4096, 3000], [4096, 3000], True),
        ([4096, 100], [4096, 100], False),  # one short prompt keeps the step on Triton
        ([2048], [4096], False),  # a chunk over cached tokens: a context of CHUNK_FACTOR x
        ([2048], [CHUNK_FACTOR * 2048], True),
        ([1024], [CHUNK_FACTOR * 2048], False),  # ... and the chunk itself at the threshold
        ([2048, 4096], [30000, 4096], True),
        ([], [], False),
    ],
)
def test_which_steps_take_cudnn(query_lens, context_lens, expected) -> None:
    """Every prefill must be long: from the threshold, and a chunk over cached tokens in a
    context of four times it."""
    assert all_long(query_lens, context_lens, 2048) is expected
