"""Nano-batches: a large decode step as two halves on two CUDA streams (``fused.nano_batch_rows``).

A decode step of an 8B model at a few hundred sequences is bound as much by its GEMMs'
FLOPs as by its attention's bytes, and a single stream runs them one after the other:
while attention streams the KV cache the tensor cores idle, and while the GEMMs run the
memory system does. NanoFlow (OSDI 2025) splits such a batch into nano-batches whose
operations overlap on the device. :class:`NanoBatches` does the simple form: a decode step
of at least ``min_rows`` rows (sequences) runs as two halves, each on its own stream, layer
by layer in issue order (half A's layer ``i``, then half B's). The halves share no data
until the final join; one ordering edge a layer keeps them out of phase: half B's QKV
projection of layer ``i`` waits for half A's (:meth:`NanoBatches.hand_over`), so that B's
GEMM runs beside A's attention, and A's MLP beside B's attention, rather than both halves
running the same kind of kernel at once.

Each half gets its own :class:`~pitstop.ground.attention.AttentionMetadata`, the step's
sliced by sequence (views of the step's tensors, so a captured graph's replays read the
same buffers) and its own split-K workspace of the fused GEMMs (:func:`.triton_ops.fused_linear.lane`).
The KV cache is shared: the halves write disjoint slots. Inside a CUDA-graph capture the
two streams are the graph's fork and join. Off the GPU the halves run one after the other
(the same arithmetic: tests compare it with the whole step).

What it does not split: prefill and mixed steps, steps under ``min_rows``, and (refused at
build) the one-launch decode merge (its arrival counters are per decode row of one launch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from pitstop.ground.attention import AttentionMetadata

LANES = 2  # nano-batches a step


def split_decode(meta: AttentionMetadata, bounds: tuple[int, int]) -> AttentionMetadata:
    """The metadata of decode rows ``[lo, hi)`` of a decode-only step (views, no copies;
    ``max_context_len`` stays the step's, an upper bound, as a captured graph was sized by it)."""
    lo, hi = bounds
    return attrs.evolve(
        meta,
        positions=meta.positions[lo:hi],
        slot_mapping=meta.slot_mapping[lo:hi],
        block_tables=meta.block_tables[lo:hi],
        context_lens=meta.context_lens[lo:hi],
        cu_query_lens=meta.cu_query_lens[lo : hi + 1] - lo,
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=hi - lo,
        max_query_len=1,
        context_lens_list=meta.context_lens_list[lo:hi],
        query_lens_list=meta.query_lens_list[lo:hi] if meta.query_lens_list else [],
    )


class NanoBatches:
    """Runs a decode step of at least ``min_rows`` rows as two halves on two streams."""

    def __init__(self, min_rows: int, device: torch.device, lane: Callable[[int], Any]) -> None:
        """``lane(i)``: a context manager under which half ``i``'s kernels use their own
        workspaces (the fused GEMMs' split-K partials and counters)."""
        assert min_rows >= 2 * LANES, "nano-batches need at least two rows a half"
        self.min_rows, self.device, self.lane = min_rows, device, lane
        self._streams: list[torch.cuda.Stream] | None = None

    def split(self, meta: AttentionMetadata) -> list[tuple[slice, AttentionMetadata]] | None:
        """Each half's rows and metadata, or None where the step runs whole."""
        rows = meta.num_decodes
        if meta.num_prefills or rows < self.min_rows or meta.positions.shape[0] != rows:
            return None
        half = (rows + 1) // 2
        return [
            (slice(lo, hi), split_decode(meta, (lo, hi))) for lo, hi in ((0, half), (half, rows))
        ]

    @contextlib.contextmanager
    def on(self, index: int) -> Iterator[None]:
        """Half ``index``'s stream (CUDA) and workspace lane."""
        with self.lane(index):
            if self._streams is None:
                yield
            else:
                with torch.cuda.stream(self._streams[index]):
                    yield

    def fork(self) -> None:
        """Every half's stream waits for the work queued so far (CUDA; nothing elsewhere)."""
        if self.device.type != "cuda":
            return
        if self._streams is None:
            self._streams = [torch.cuda.Stream(self.device) for _ in range(LANES)]
        main = torch.cuda.current_stream(self.device)
        for stream in self._streams:
            stream.wait_stream(main)

    def hand_over(self, earlier: int, later: int) -> None:
        """Half ``later``'s stream waits for the work queued on half ``earlier``'s so far (CUDA;
        nothing elsewhere): the model calls it after half A's QKV projection of each layer, so
        that half B's QKV GEMM starts once A's is done and runs beside A's attention."""
        if self._streams is None:
            return
        self._streams[later].wait_stream(self._streams[earlier])

    def join(self) -> None:
        """The current stream waits for every half's."""
        if self._streams is None:
            return
        main = torch.cuda.current_stream(self.device)
        for stream in self._streams:
            main.wait_stream(stream)
