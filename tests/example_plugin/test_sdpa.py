"""The ``sdpa`` kernel set's own tests: every op against the reference, by pitstop.testing.kernels."""

from __future__ import annotations

import torch
from pitstop_example.sdpa import make_sdpa, pack

from pitstop import EngineConfig
from pitstop.testing.kernels import check_kernel_set, paged_batch


def test_sdpa_matches_the_reference_kernels() -> None:
    # float32 and bfloat16 activations; bf16/fp16 caches and fp8 ones read with kv_scale
    check_kernel_set(lambda device, dtype: make_sdpa(EngineConfig(), device, dtype), fp8=True)


def test_one_sequence_per_call_matches_too() -> None:
    config = EngineConfig(options={"sdpa.max_batch": 1})
    check_kernel_set(lambda device, dtype: make_sdpa(config, device, dtype), max_examples=10)


def test_the_masks_are_built_once_per_step() -> None:
    kernels = make_sdpa(EngineConfig(), torch.device("cpu"), torch.float32)
    batch = paged_batch([5, 1, 1], [9, 4, 17], 4, 4, 2, 16, torch.float32)
    for _layer in range(3):
        kernels.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25)
        groups = kernels._groups
        assert [tuple(g.rows.shape) for g in groups] == [(1, 5), (2, 1)]  # prompts, decodes
    assert kernels._groups is groups
    assert kernels.describe()["rms_norm"] == "reference (PyTorch)"


def test_padding_at_most_doubles_a_calls_work() -> None:
    # a long prompt, two short ones, 40 decodes of mixed contexts
    qlens = [2048, 30, 25] + [1] * 40
    ctxs = [2048, 30, 100] + [10 + 7 * i for i in range(40)]
    calls = pack(qlens, ctxs, max_batch=64)
    assert [len(call) for call in calls] == [2, 1, 40]  # no decode padded to a prompt's length
    assert sorted(i for call in calls for i in call) == list(range(len(qlens)))
    for call in calls:
        q_max = max(qlens[i] for i in call)
        l_max = max(ctxs[i] for i in call)
        assert len(call) * q_max * l_max <= 2 * sum(qlens[i] * ctxs[i] for i in call)
    assert all(len(call) <= 8 for call in pack(qlens, ctxs, max_batch=8))
