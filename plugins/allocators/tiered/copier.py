"""Copies of whole KV pages between the device cache and the host pool, each one a handle.

The runner's KV cache is ``[layers, 2, pages, page_size, kv_heads, head_size]``;
the host pool holds the same pages page-major, ``[slots, layers, 2, page_size,
kv_heads, head_size]``, so one page is one contiguous block on the host and a
run of slots is one transfer. Every layer's K and V move together; an fp8
cache moves as its bytes.

On CUDA the copies run on a side stream: each first waits for the work the
compute stream has queued so far (the pages' KV is written by steps already
launched), then gathers or scatters through a small device staging buffer and
records an event. A :class:`PageCopy` is done when its event is, and knows how
long it took. On a CPU the copy happens at once; the handle is done when it is
returned, and the bookkeeping is the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

STAGING_PAGES = 16  # pages per transfer through the device staging buffer (bounds its memory)


class CudaSignal:
    """The end of a copy on a CUDA side stream: two timing events around it."""

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start, self.end = start, end

    def query(self) -> bool:
        """Whether the copy has finished."""
        return self.end.query()

    def synchronize(self) -> None:
        """Block the host until the copy has finished."""
        self.end.synchronize()

    def seconds(self) -> float:
        """The copy's device time (once finished)."""
        return self.start.elapsed_time(self.end) / 1e3

    def fence(self) -> None:
        """Make the current (compute) stream wait for the copy, without blocking the host."""
        torch.cuda.current_stream(self.end.device).wait_event(self.end)


class PageCopy:
    """One copy: device pages <-> host slots, and the signal that says it ended.

    ``signal`` None: a synchronous copy, done when made, that took ``seconds``.
    """

    __slots__ = ("_done_at", "direction", "exposed", "host_slots", "nbytes", "pages", "signal")

    def __init__(
        self,
        direction: str,
        pages: list[int],
        host_slots: list[int],
        nbytes: int,
        signal: Any = None,
        seconds: float = 0.0,
    ) -> None:
        self.direction = direction  # "to_host" (a save) or "to_device" (a load)
        self.pages = pages
        self.host_slots = host_slots
        self.nbytes = nbytes
        self.signal = signal
        self._done_at: float | None = None if signal is not None else seconds
        # whether anything waited for it: every synchronous copy, an async one when waited on
        self.exposed = signal is None

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        if self._done_at is None and self.signal.query():
            self._done_at = self.signal.seconds()
        return self._done_at is not None

    def wait(self) -> float:
        """Block until the copy has finished; return the seconds this call waited."""
        if self.done():
            return 0.0
        begin = time.perf_counter()
        self.signal.synchronize()
        waited = time.perf_counter() - begin
        self.done()
        return waited

    def fence(self) -> None:
        """Order the work queued next on the compute stream after this copy (no host wait)."""
        if not self.done():
            self.signal.fence()

    @property
    def seconds(self) -> float:
        """How long the copy itself took (0 until it is done)."""
        return self._done_at or 0.0


class PageCopier:
    """Moves pages of one KV cache to and from one host pool.

    ``host_slots`` pages of host memory are allocated here (pinned on CUDA);
    :attr:`page_bytes` is one page's K and V over every layer.
    """

    def __init__(self, kv_cache: torch.Tensor, host_slots: int) -> None:
        self.kv = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
        layers, two, _, page_size, heads, head_size = self.kv.shape
        self.page_shape = (layers, two, page_size, heads, head_size)
        self.device = kv_cache.device
        self.page_bytes = self.kv[:, :, 0].numel() * self.kv.element_size()
        on_cuda = self.device.type == "cuda"
        self.host = torch.empty(
            (host_slots, *self.page_shape), dtype=self.kv.dtype, pin_memory=on_cuda
        )
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None

    @property
    def num_slots(self) -> int:
        """Pages the host pool holds."""
        return self.host.shape[0]

    def to_host(self, pages: Seq[int], slots: Seq[int]) -> PageCopy:
        """Copy device ``pages`` into host ``slots`` (same length, in order)."""
        return self._copy("to_host", list(pages), list(slots))

    def to_device(self, slots: Seq[int], pages: Seq[int]) -> PageCopy:
        """Copy host ``slots`` into device ``pages`` (same length, in order)."""
        return self._copy("to_device", list(pages), list(slots))

    def _copy(self, direction: str, pages: list[int], slots: list[int]) -> PageCopy:
        assert len(pages) == len(slots)
        nbytes = len(pages) * self.page_bytes
        if self.stream is None:
            begin = time.perf_counter()
            self._run(direction, pages, slots)
            return PageCopy(direction, pages, slots, nbytes, seconds=time.perf_counter() - begin)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the KV steps wrote
        with torch.cuda.stream(self.stream):
            start.record()
            self._run(direction, pages, slots)
            end.record()
        return PageCopy(direction, pages, slots, nbytes, CudaSignal(start, end))

    def _run(self, direction: str, pages: list[int], slots: list[int]) -> None:
        non_blocking = self.stream is not None
        for at in range(0, len(pages), STAGING_PAGES):
            chunk, chunk_slots = pages[at : at + STAGING_PAGES], slots[at : at + STAGING_PAGES]
            index = torch.tensor(chunk, dtype=torch.int64).to(self.device, non_blocking=True)
            if direction == "to_host":
                staged = self.kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
                for i, j, n in _runs(chunk_slots):
                    self.host[j : j + n].copy_(staged[i : i + n], non_blocking=non_blocking)
            else:
                staged = torch.empty(
                    (len(chunk), *self.page_shape), dtype=self.kv.dtype, device=self.device
                )
                for i, j, n in _runs(chunk_slots):
                    staged[i : i + n].copy_(self.host[j : j + n], non_blocking=non_blocking)
                self.kv.index_copy_(2, index, staged.permute(1, 2, 0, 3, 4, 5))


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(first index, first slot, length)`` of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot and runs[-1][0] + runs[-1][2] == i:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs
