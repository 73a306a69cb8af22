"""Host values onto the device (pitstop.ground.transfer): dtypes and pinning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pitstop.ground.transfer import host_tensor, to_device

CPU = torch.device("cpu")


def test_a_list_takes_the_dtype_an_array_or_a_tensor_keeps_its_own() -> None:
    assert host_tensor([1, 2], torch.int32, CPU).dtype == torch.int32
    assert host_tensor(np.arange(3, dtype=np.int64)[::2], torch.int32, CPU).dtype == torch.int64
    t = torch.ones(2, dtype=torch.bool)
    assert host_tensor(t, torch.int64, CPU) is t
    assert to_device([3, 4], torch.int64, CPU).tolist() == [3, 4]


def test_the_host_copy_is_pinned_only_for_a_gpu() -> None:
    assert not host_tensor([1], torch.int32, CPU).is_pinned()
    if not torch.cuda.is_available():
        pytest.skip("pinning needs CUDA")
    cuda = torch.device("cuda")
    assert host_tensor([1], torch.int32, cuda).is_pinned()
    assert to_device(np.arange(4), None, cuda).device.type == "cuda"
