"""The rollout package's small parts: the device-memory choice and its refusals, storages
released and restored in place, dtype names of the transfer group."""

from __future__ import annotations

import pytest
import torch

from pitstop.config import EngineConfig
from pitstop.entrypoints.rollout.device_memory import (
    StorageMemory,
    choose_device_memory,
    sleep_mode_memory,
)
from pitstop.entrypoints.rollout.errors import WeightUpdateError
from pitstop.entrypoints.rollout.transfer import WeightTransferGroup, parse_dtype
from pitstop.errors import ConfigError


def test_cpu_memory_is_storages_resized() -> None:
    memory = choose_device_memory(torch.device("cpu"))
    assert isinstance(memory, StorageMemory) and not memory.keeps_addresses
    assert sleep_mode_memory(EngineConfig(model="dummy:qwen3-0.6b"), False) is None


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"tensor_parallel_size": 2}, "one rank only"),
        ({"weights": "fp8"}, "dense weights only"),
    ],
)
def test_sleep_mode_refuses_what_it_cannot_free_whole(settings: dict, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        sleep_mode_memory(EngineConfig(model="dummy:qwen3-0.6b", **settings), True)


def test_storages_come_back_in_the_same_tensors() -> None:
    memory = StorageMemory(torch.device("cpu"))
    weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    view = weight.data[8:16]  # a view shares the storage: released once
    memory.release("weights", [weight, view])
    assert weight.untyped_storage().nbytes() == 0
    memory.restore("weights", [weight])
    assert weight.untyped_storage().nbytes() == 64 * 32 * 4
    weight.data.fill_(2.0)
    assert view.sum().item() == 2.0 * 8 * 32  # the view reads the restored storage


def test_dtype_names() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float32") is torch.float32
    assert parse_dtype(torch.float16) is torch.float16
    with pytest.raises(WeightUpdateError, match="not a torch dtype"):
        parse_dtype("float33")


def test_a_group_refuses_a_rank_outside_it() -> None:
    with pytest.raises(WeightUpdateError, match="rank_offset must be below world_size"):
        WeightTransferGroup("127.0.0.1", 1, 2, 2, "g")
    with pytest.raises(WeightUpdateError, match="backend 'mpi' unknown"):
        WeightTransferGroup("127.0.0.1", 1, 1, 2, "g", backend="mpi")


def test_torch_memory_savers_pools_outlive_interpreter_teardown() -> None:
    """Issue 49: the exit hook keeps every pool of the library alive for good, so that
    teardown never destroys one outside a region (the library ends the process with
    status 1) nor inside one (torch aborts: a pool in use): dropping every other
    reference leaves the pools alive."""
    import weakref
    from types import SimpleNamespace

    from pitstop.entrypoints.rollout.device_memory import _keep_pools_through_teardown

    class Pool:
        pass

    pools = {("weights", False): Pool(), ("kv_cache", False): Pool()}
    alive = [weakref.ref(p) for p in pools.values()]
    _keep_pools_through_teardown(SimpleNamespace(_impl=SimpleNamespace(_mem_pools=pools)))
    pools.clear()
    assert all(ref() is not None for ref in alive)
    _keep_pools_through_teardown(SimpleNamespace())  # a saver never used: nothing to keep
