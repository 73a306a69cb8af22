"""CUDA graphs of whole steps: decode and verification as one mechanism, and their capture.

A step in which every sequence computes at most ``num_query`` tokens has a
fixed shape: ``batch`` sequences of ``num_query`` query rows each.
:class:`DecodeGraphs` captures the model's forward for such steps, one graph
per batch size, over static buffers; a step copies its (padded) inputs in
and replays the graph of the smallest captured batch that fits.

- ``num_query = 1``: pure decode steps. Attention is the decode kernel;
  the graph returns the hidden states and the runner picks the rows to
  sample.
- ``num_query = k + 1`` with ``logits``: speculative verification steps
  (:class:`pitstop.runner.verify_graphs.VerifyGraphs`). Sequence ``i`` owns query
  rows ``i * q .. i * q + q - 1``; a sequence with ``m < q`` real tokens puts
  them in its last ``m`` rows and padding tokens before them, at the
  positions just before its first real token: they store no K/V (slot -1),
  and the sequence's context ends at its last real token, so its real rows
  compute exactly what an eager step would and never have a never-written
  slot in their key range (a zero attention weight times a NaN of poisoned
  memory is still NaN). Attention runs as the varlen "prefill" kernel with a
  fixed grid; its lengths are read on the device. The graph computes the
  logits too.

Padding sequences of a bucket have slot -1 everywhere (no KV store). A
pending input token (sampled by the previous step, not yet on the host) is
gathered inside the graph from the runner's ``last_sampled`` buffer: ``src``
names its row there (-1: the host's id in ``input_ids``). The host staging
buffers are pinned and doubled, so that the next step's writes never race
this step's copies.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import attrs
import numpy as np
import torch

from pitstop.ground.attention import AttentionMetadata
from pitstop.ground.model_config import ModelConfig
from pitstop.ground.poison import poison_
from pitstop.ground.step import SeqInput
from pitstop.requests.sequence import PENDING_TOKEN
from pitstop.runner.batch import BlockTableRows


@attrs.frozen(eq=False)
class ForwardParts:
    """What a graph's forward reads, handed over by its runner (:meth:`ModelRunner.forward_parts
    <pitstop.runner.model_runner.ModelRunner.forward_parts>`): the model and its shape, its
    rotary tables, the KV cache (``page_size``-token pages), the device and dtype,
    ``max_model_len``, whether memory is poisoned, and the previous step's sampled ids on
    the device (``last_sampled``, a buffer the runner copies into) with ``pending_row``:
    seq id -> the row of ``last_sampled`` holding its pending token."""

    model: Any  # the model plugin's module
    model_config: ModelConfig
    rotary: Any  # RotaryCache
    kv_cache: torch.Tensor
    page_size: int
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    poison: bool
    last_sampled: torch.Tensor
    pending_row: Callable[[int], int]


def capture_graph(
    run: Callable[[], Any], pool: Any, device: torch.device
) -> tuple[torch.cuda.CUDAGraph, Any, Any]:
    """Warm ``run`` up, then capture it in a CUDA graph on memory pool ``pool`` (None: a new one).

    Returns the graph, what ``run`` returned during capture (its static
    output) and the pool, for the next graph to share.
    """
    run()  # warm-up: compiles kernels, settles the allocator
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out, graph.pool() if pool is None else pool


def capture_buckets(
    sizes: Seq[int], forward: Callable[[int], torch.Tensor], device: torch.device
) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """One graph of ``forward(size)`` per size, largest first, all on one memory pool.

    Returns size -> (graph, its static output).
    """
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    pool = None
    with torch.inference_mode():
        for size in sorted(sizes, reverse=True):
            graph, out, pool = capture_graph(lambda size=size: forward(size), pool, device)
            graphs[size] = (graph, out)
    torch.cuda.synchronize(device)
    return graphs


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 16 up to ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """CUDA graphs of steps of ``batch`` sequences with up to ``num_query`` tokens each.

    ``logits``: the graph computes the logits as well (verification steps);
    else it returns hidden states. With ``capture=False`` the same
    static-buffer forward runs eagerly (CPU tests of the padding and layout
    logic).
    """

    def __init__(
        self,
        parts: ForwardParts,
        max_batch: int,
        num_query: int = 1,
        *,
        logits: bool = False,
        capture: bool = True,
    ) -> None:
        self.parts = parts
        self.captured, self.logits = capture, logits
        dev = parts.device
        self.num_query = q = num_query
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = b = self.sizes[-1]
        self.max_model_len = parts.max_model_len
        self.max_pages = -(-parts.max_model_len // parts.page_size)
        # varlen: a padding sequence's table and the kernels' tile reads: a few more (zero) columns
        self.width = self.max_pages if q == 1 else self.max_pages + -(-q // parts.page_size) + 1
        # a padding sequence's context: nothing (decode kernel), or q keys of page 0 (varlen)
        self.pad_context = 0 if q == 1 else q
        t = b * q
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.src = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(b, self.width, dtype=torch.int32, device=dev)
        self.context_lens = torch.full((b,), self.pad_context, dtype=torch.int32, device=dev)
        self.cu_query_lens = torch.arange(b + 1, dtype=torch.int32, device=dev) * q
        pin = dev.type == "cuda"
        # host staging, pinned (asynchronous copies) and doubled; one int64 row block
        # [ids, src, positions, slots], then the int32 context lens and block tables
        self._host64 = [torch.zeros(4, t, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host32 = [
            torch.zeros(b * (1 + self.width), dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._flip = 0
        self.tables = BlockTableRows(self.max_pages, capacity=max(64, 2 * b), poison=parts.poison)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self.graphs = capture_buckets(self.sizes, self._forward, dev)

    def poison(self) -> None:
        """Poison every static input and staging buffer (``poison_memory``, after capture)."""
        for buffer in (
            self.input_ids, self.src, self.positions, self.slots, self.block_tables,
            self.context_lens, *self._host64, *self._host32,
        ):  # fmt: skip
            poison_(buffer)

    def _forward(self, size: int) -> torch.Tensor:
        """Hidden states (or logits) ``[size * num_query, ·]`` of the bucket, from the static buffers."""
        parts = self.parts
        t = size * self.num_query
        src = self.src[:t]
        pending = parts.last_sampled[src.clamp(min=0)]
        ids = torch.where(src >= 0, pending, self.input_ids[:t])
        hidden = parts.model(ids, parts.rotary, parts.kv_cache, self._meta(size))
        return parts.model.compute_logits(hidden) if self.logits else hidden

    def _meta(self, size: int) -> AttentionMetadata:
        q = self.num_query
        varlen = q > 1  # the prefill kernel over q query rows each; else the decode kernel
        lists = {}
        if not self.captured:  # the reference kernels read lengths on the host
            lists = {
                "context_lens_list": self.context_lens[:size].tolist(),
                "query_lens_list": [q] * size,
            }
        return AttentionMetadata(
            positions=self.positions[: size * q],
            slot_mapping=self.slots[: size * q],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            cu_query_lens=self.cu_query_lens[: size + 1],
            num_prefills=size if varlen else 0,
            num_prefill_tokens=size * q if varlen else 0,
            num_decodes=0 if varlen else size,
            max_query_len=q,
            max_context_len=self.max_model_len + (q if varlen else 0),
            page_size=self.parts.page_size,
            **lists,
        )

    def describe(self) -> str:
        """The captured sizes, compactly."""
        if self.num_query > 1:
            return f"batch {self.sizes} x {self.num_query} tokens"
        return f"{self.sizes[:5]}...{self.sizes[-1]}" if len(self.sizes) > 6 else str(self.sizes)

    def can_run(self, seqs: Seq[SeqInput]) -> bool:
        """Whether a step fits a captured batch: every sequence within ``num_query`` tokens, and
        with ``logits``, every sequence sampling all of them (decodes and verifications only)."""
        if not 0 < len(seqs) <= self.max_batch:
            return False
        q = self.num_query
        if self.logits:
            return all(s.sample and len(s.token_ids) == s.num_logits <= q for s in seqs)
        return all(len(s.token_ids) <= q for s in seqs)

    def forget(self, seq_ids: Seq[int]) -> None:
        """Drop the block-table rows of sequences that finished or whose tables were rebuilt."""
        if seq_ids:
            self.tables.forget(seq_ids)

    def run(self, seqs: Seq[SeqInput]) -> tuple[torch.Tensor, list[int]]:
        """Copy the step in, replay; returns the output rows and the rows to sample.

        Hidden states: the step's own rows (the logits GEMM then copies them).
        Logits: the bucket's whole output, which the runner gathers by the rows
        (a copy: the next replay overwrites the graph's output).
        """
        n, q = len(seqs), self.num_query
        size = next(b for b in self.sizes if b >= n)
        self._stage(seqs, size)
        if self.captured:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self._forward(size)
        if q == 1:  # one row each: the sampling sequences'
            rows = [i for i, s in enumerate(seqs) if s.sample]
        else:
            rows = [
                (i + 1) * q - s.num_logits + j
                for i, s in enumerate(seqs)
                if s.sample
                for j in range(s.num_logits)
            ]
        return (out if self.logits else out[: n * q]), rows

    def _stage(self, seqs: Seq[SeqInput], size: int) -> None:
        """Fill the host staging of bucket ``size`` and copy it into the static buffers.

        Each sequence's tokens fill the *end* of its ``num_query`` rows, its
        padding rows the start (positions just before its first token, no K/V
        stored), and its context length ends at its last real token: no real
        row then has a key it must not see in its range, so none multiplies a
        never-written V slot (NaN under ``poison_memory``) by a zero weight.
        """
        n, q = len(seqs), self.num_query
        self._flip ^= 1
        h64, h32 = self._host64[self._flip], self._host32[self._flip]
        b, t = self.max_batch, size * q
        h_ctx, h_tables = h32[:b], h32[b:].view(b, self.width)
        a64, a_ctx, a_tables = h64.numpy(), h_ctx.numpy(), h_tables.numpy()
        ids = a64[0, :t].reshape(size, q)
        lens = self._put_ids(ids, seqs)
        start = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        tables = self.tables.array[self.tables.rows(seqs)]  # [n, max_pages]
        pos, slots = self._positions(start, lens, tables)
        src = a64[1, :t].reshape(size, q)
        src[:] = -1
        pending = ids[:n] == PENDING_TOKEN
        if pending.any():
            seq_of, col = np.nonzero(pending)
            pending_row = self.parts.pending_row
            src[seq_of, col] = [pending_row(seqs[i].seq_id) for i in seq_of]
            ids[:n][pending] = 0
        a64[2, :t].reshape(size, q)[:n] = pos
        a64[2, n * q : t] = 0
        a64[3, :t].reshape(size, q)[:n] = slots
        a64[3, n * q : t] = -1
        a_ctx[:n] = start + lens
        a_ctx[n:size] = self.pad_context  # padding sequences: keys of page 0, nothing stored
        a_tables[:n, : self.max_pages] = tables
        a_tables[:n, self.max_pages :] = 0
        a_tables[n:size] = 0  # padding rows' tables point at page 0
        self._copy_in(h64, h_ctx, h_tables, size)
        if q > 1:  # drafts still on the device: into their placeholders
            for i, s in enumerate(seqs):
                if s.draft_ids is not None:
                    end = (i + 1) * q
                    self.input_ids[end - len(s.draft_ids) : end].copy_(s.draft_ids)

    def _positions(
        self, start: np.ndarray, lens: np.ndarray, tables: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Positions and KV slots ``[n, q]`` of the sequences' rows (slot -1: padding, no store).

        ``tables`` holds each sequence's block table. A sequence's padding rows
        sit at the positions just before its first token.
        """
        q, ps = self.num_query, self.parts.page_size
        if q == 1:  # decode: one real row each
            pos = start[:, None]
            page = tables[np.arange(len(start)), start // ps][:, None]
            return pos, page.astype(np.int64) * ps + pos % ps
        pad = q - lens  # leading padding rows of each sequence
        pos = (start - pad)[:, None] + np.arange(q)[None, :]  # [n, q]; padding before start
        real = np.arange(q)[None, :] >= pad[:, None]
        pos = np.clip(pos, 0, self.max_model_len - 1)
        page = np.take_along_axis(tables, np.minimum(pos // ps, self.max_pages - 1), axis=1)
        return pos, np.where(real, page.astype(np.int64) * ps + pos % ps, -1)

    def _put_ids(self, ids: np.ndarray, seqs: Seq[SeqInput]) -> np.ndarray:
        """Write the sequences' tokens into the ``[size, q]`` host ids; returns their counts.

        Drafts still on the device get placeholders (0), written on the device after the copy.
        """
        n, q = len(seqs), self.num_query
        ids[:] = 0  # padding rows read token 0 (and store nothing)
        if q == 1:  # decode: one token each, no padding
            ids[:n, 0] = [s.token_ids[0] for s in seqs]
            return np.ones(n, dtype=np.int64)
        lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
        for i, s in enumerate(seqs):
            ids[i, q - lens[i] :] = s.token_ids
            if s.draft_ids is not None:  # placeholders: written on the device
                ids[i, q - len(s.draft_ids) :] = 0
        return lens

    def _copy_in(
        self, h64: torch.Tensor, h_ctx: torch.Tensor, h_tables: torch.Tensor, size: int
    ) -> None:
        """The staged bucket into the static device buffers, without waiting."""
        t = size * self.num_query
        nb = self.parts.device.type == "cuda"
        self.input_ids[:t].copy_(h64[0, :t], non_blocking=nb)
        self.src[:t].copy_(h64[1, :t], non_blocking=nb)
        self.positions[:t].copy_(h64[2, :t], non_blocking=nb)
        self.slots[:t].copy_(h64[3, :t], non_blocking=nb)
        self.context_lens[:size].copy_(h_ctx[:size], non_blocking=nb)
        self.block_tables[:size].copy_(h_tables[:size], non_blocking=nb)
