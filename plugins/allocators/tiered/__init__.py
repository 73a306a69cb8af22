"""``tiered``: the ``prefix`` allocator plus a host tier for the pages it evicts (issue 50).

Full prefix pages the device cache evicts are copied (asynchronously on
CUDA: a side stream and events) into a host pool (pinned on CUDA) with its
own LRU, keyed by the prefix allocator's chained hash; a new request whose
prefix misses on the device but hits on the host gets device pages and the
host pages copied back before its prefill reads them. How, in
:mod:`.allocator`; the copies in :mod:`.copier`; the host index in
:mod:`.host_pool`; the counters in :mod:`.counters`.

Settings (:class:`TieredSettings`; ``--tiered.*``, ``[plugins.tiered]``):

``tiered.kv_offloading_size`` (alias ``kv_offloading_size``, vLLM's name, ``--kv-offloading-size``)
    GiB of host memory for the host pool (default 4).
``tiered.max_host_pages``
    at most this many host pages (unset: as many as ``kv_offloading_size`` holds).
``tiered.offload_ahead``
    how many of the device LRU pool's oldest pages are copied to the host at
    each step ahead of their eviction (default 1024).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

import pitstop
from pitstop.errors import ConfigError
from pitstop.plugin_system.settings import setting
from pitstop.plugins.allocators.tiered.allocator import TieredAllocator

if TYPE_CHECKING:
    from pitstop.config import EngineConfig

__all__ = ["TieredAllocator", "TieredSettings", "create_tiered"]


@attrs.frozen
class TieredSettings:
    """The settings of the ``tiered`` allocator."""

    kv_offloading_size: float = setting(
        4.0,
        type=float,
        minimum=0,
        alias="kv_offloading_size",
        help="GiB of host memory (pinned on CUDA) for KV pages evicted from the device cache",
    )
    max_host_pages: int | None = setting(
        None,
        type=int,
        minimum=0,
        optional=True,
        help="at most this many host pages (unset: what kv_offloading_size holds)",
    )
    offload_ahead: int = setting(
        1024,
        type=int,
        minimum=0,
        help="oldest cached device pages copied to the host at each step, ahead of eviction",
    )


def create_tiered(
    config: EngineConfig, num_pages: int, *, settings: TieredSettings
) -> TieredAllocator:
    """Prefix caching on the device plus a host pool of the pages it evicts."""
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            "allocator='tiered' copies the KV cache of one device; with "
            f"tensor_parallel_size={config.tensor_parallel_size} use allocator='prefix'"
        )
    return TieredAllocator(
        config.page_size,
        num_pages,
        host_bytes=int(settings.kv_offloading_size * 2**30),
        max_host_pages=settings.max_host_pages,
        offload_ahead=settings.offload_ahead,
    )


@pitstop.hookimpl
def register_allocators(register) -> None:
    """Register ``tiered``."""
    register("tiered", create_tiered, settings=TieredSettings)
