"""How device memory is released and restored: the one place that chooses.

Two ways, behind :class:`DeviceMemory`:

- :class:`MemorySaverMemory` (CUDA, when ``torch_memory_saver`` imports: SGLang's
  library): the weights and the KV cache are allocated inside tagged regions;
  ``pause(tag)`` gives their physical memory back and ``resume(tag)`` maps new memory
  at the *same virtual addresses*, so captured CUDA graphs stay valid (no re-capture).
- :class:`StorageMemory` (CPU, and CUDA without the library): each tensor's storage is
  resized to 0 bytes and back, keeping the same tensor objects (every reference the
  runner holds stays good). On CUDA the addresses change, so the caller drops the CUDA
  graphs before and captures them again after (:attr:`DeviceMemory.keeps_addresses`).
  On CPU glibc is asked to give the freed pages back (``malloc_trim``), so RSS falls.

Neither keeps values: a caller that wants them back (``sleep(level=1)``'s weights)
copies them to the host first (:mod:`pitstop.entrypoints.rollout.sleep`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import attrs
import torch

from pitstop.config import EngineConfig
from pitstop.errors import ConfigError

log = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


class DeviceMemory(Protocol):
    """Tagged device memory that can be given back and taken again."""

    name: str
    keeps_addresses: bool  # True: restored tensors keep their addresses (CUDA graphs stay valid)

    def region(self, tag: str) -> AbstractContextManager[object]:
        """The context the tensors of ``tag`` are allocated in."""
        ...

    def release(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Give back the device memory of ``tag``'s tensors (values lost)."""
        ...

    def restore(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Take the memory of ``tag``'s tensors again (values undefined until written)."""
        ...


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages under ``tensors`` (views and tied tensors share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _trim_host_heap() -> None:
    """Ask glibc to return freed heap pages to the OS (RSS falls); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class StorageMemory:
    """Storages resized to 0 bytes and back: same tensor objects, new addresses."""

    name = "storage"
    keeps_addresses = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sizes: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}

    def region(self, tag: str) -> AbstractContextManager[object]:
        """Plain allocations (nothing to tag)."""
        return nullcontext()

    def release(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Resize every storage of ``tag`` to 0 bytes; return the memory to the device/OS."""
        held = [(s, s.nbytes()) for s in unique_storages(tensors)]
        for storage, _ in held:
            storage.resize_(0)
        self._sizes[tag] = held
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _trim_host_heap()

    def restore(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Resize every storage of ``tag`` back to its size (uninitialised)."""
        del tensors  # the storages were remembered at release
        for storage, nbytes in self._sizes.pop(tag, []):
            storage.resize_(nbytes)


class MemorySaverMemory:
    """``torch_memory_saver``'s tagged regions: paused and resumed at the same addresses."""

    name = "torch_memory_saver"
    keeps_addresses = True

    def __init__(self, saver: object) -> None:
        self.saver = saver
        _keep_pools_alive_at_exit(saver)

    def region(self, tag: str) -> AbstractContextManager[object]:
        """Allocations inside are ``tag``'s (without the library's own CPU backup)."""
        return self.saver.region(tag=tag)  # type: ignore[attr-defined]

    def release(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Unmap ``tag``'s physical memory; the virtual addresses stay reserved."""
        del tensors
        torch.cuda.synchronize()
        self.saver.pause(tag)  # type: ignore[attr-defined]

    def restore(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """Map new physical memory at ``tag``'s addresses."""
        del tensors
        self.saver.resume(tag)  # type: ignore[attr-defined]


_exit_hook_registered = False


def _keep_pools_alive_at_exit(saver: object) -> None:
    """Keep ``saver``'s memory pools alive through interpreter teardown (once per process).

    ``torch_memory_saver``'s allocator accepts a free only inside one of its regions (a
    thread-local flag) and otherwise ends the process with status 1. Its pools (torch
    ``MemPool`` objects, the library's) would be destroyed during teardown, after Python's
    ``atexit`` hooks, when no region is open: a script that used sleep mode exited with
    status 1 after finishing its work (H200, 0.0.10, 2026-12-05). Destroying them inside
    a region from an ``atexit`` hook is no way out either: a region is a ``use_mem_pool``
    context, and torch refuses (aborts) to destroy a pool while one is in use (H200,
    2026-12-05). So the hook takes one more reference to every pool, and the pools are
    never destroyed: the process is ending, and the driver takes the device memory back
    with the CUDA context, as it does for any process that exits.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    atexit.register(_keep_pools_through_teardown, saver)


def _keep_pools_through_teardown(saver: object) -> None:
    """The ``atexit`` hook of :func:`_keep_pools_alive_at_exit`: one extra reference
    (never dropped) to each of ``saver``'s pools; nothing if it has none or differs."""
    pools = getattr(getattr(saver, "_impl", None), "_mem_pools", None)
    if not isinstance(pools, dict):  # never used, or a release whose internals differ
        return
    for pool in list(pools.values()):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))


def sleep_mode_memory(config: EngineConfig, enabled: bool) -> DeviceMemory | None:
    """The :class:`DeviceMemory` an engine of ``config`` is built with when sleep mode is
    ``enabled`` (None when not); refuses, before any weight loads, what sleep cannot free
    whole: several ranks, or a weight format that replaces the parameters."""
    if not enabled:
        return None
    if config.tensor_parallel_size > 1:
        raise ConfigError("enable_sleep_mode runs on one rank only; use tensor_parallel_size=1")
    default = attrs.fields(type(config)).weights.default
    if config.weights != default:
        raise ConfigError(
            f"enable_sleep_mode keeps dense weights only (weights={config.weights!r} replaces "
            f"the parameters at load); use weights={default!r}"
        )
    from pitstop.runner.memory_plan import resolve_device

    return choose_device_memory(resolve_device(config.device))


def choose_device_memory(device: torch.device) -> DeviceMemory:
    """:class:`MemorySaverMemory` on CUDA when ``torch_memory_saver`` imports, else
    :class:`StorageMemory`; one log line says which (and what it means for CUDA graphs)."""
    if device.type == "cuda":
        try:
            from torch_memory_saver import torch_memory_saver as saver
        except ImportError:
            saver = None
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            saver = None  # torch_memory_saver refuses expandable segments
        if saver is not None:
            if "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
                try:
                    saver.hook_mode = "torch"  # its pluggable allocator; no LD_PRELOAD needed
                except (AssertionError, AttributeError):
                    pass  # set once per process, by the first engine built with sleep mode
            log.info(
                "sleep mode: torch_memory_saver (weights and KV cache keep their addresses; "
                "CUDA graphs stay valid across sleep)"
            )
            return MemorySaverMemory(saver)
        log.info(
            "sleep mode: storages freed and re-allocated (torch_memory_saver not installed, "
            "or PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True); "
            "CUDA graphs are captured again after each wake_up"
        )
    return StorageMemory(device)
