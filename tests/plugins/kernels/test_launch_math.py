"""The host-side launch helpers equal Triton's own (``triton.cdiv``, ``triton.next_power_of_2``)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton, as the kernel tests

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pitstop.plugins.kernels.triton_ops.launch_math import (  # noqa: E402
    cdiv,
    k_per_split,
    next_power_of_2,
)

triton = pytest.importorskip("triton")


@given(a=st.integers(0, 1 << 40), b=st.integers(1, 1 << 20))
def test_cdiv_is_tritons(a: int, b: int) -> None:
    assert cdiv(a, b) == triton.cdiv(a, b)


@given(n=st.integers(0, 1 << 40))
def test_next_power_of_2_is_tritons(n: int) -> None:
    assert next_power_of_2(n) == triton.next_power_of_2(n)


@given(
    k=st.integers(1, 1 << 16),
    split=st.integers(1, 64),
    block_k=st.sampled_from([16, 32, 64, 128, 256]),
)
def test_k_per_split_covers_k_in_whole_steps(k: int, split: int, block_k: int) -> None:
    """Each split takes whole K steps, and ``split`` of them cover K."""
    per = k_per_split(k, split, block_k)
    assert per % block_k == 0 and per * split >= k and per >= block_k
