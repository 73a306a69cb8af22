"""Speculative verification steps on the device: CUDA graphs of ``(batch, k + 1)`` buckets.

A step in which every scheduled sequence decodes (one token) or verifies
drafts (its last token and up to ``k`` drafts) has the shape of a decode step
with ``k + 1`` query tokens per sequence. :class:`VerifyGraphs` captures the
model's forward and its logits for such steps, one graph per batch size:
sequence ``i`` owns query rows ``i * (k + 1) .. i * (k + 1) + k``; a sequence
with ``m < k + 1`` real tokens puts them in its last ``m`` rows and padding
tokens before them, at the positions just before its first real token: they
store no K/V (slot -1), and the sequence's context ends at its last real
token, so its real rows compute exactly what an eager step would and never
have a never-written slot in their key range (a zero attention weight times
a NaN of poisoned memory is still NaN). Padding sequences of a bucket have
slot -1 everywhere.
Attention runs as the varlen "prefill" kernel with a fixed grid (``batch``
sequences, ``k + 1`` query tokens each); its lengths are read on the device.

The engine hands :func:`capture_verify_graphs` to the runner's graph capture
when speculation is on; the runner replays them and verifies on the device
(:class:`pitstop.runner.LaunchedVerification` brings the results back in one
copy).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np
import torch

from pitstop.attention import AttentionMetadata
from pitstop.poison import poison_
from pitstop.runner import BlockTableRows, SeqInput, capture_buckets, graph_batch_sizes
from pitstop.sequence import PENDING_TOKEN
from pitstop.spec_adaptation import speculation_max_batch

if TYPE_CHECKING:
    from pitstop.runner import ModelRunner

log = logging.getLogger(__name__)


class VerifyGraphs:
    """CUDA graphs of verification steps: ``batch`` sequences of ``num_query`` tokens each.

    With ``capture=False`` the same static-buffer forward runs eagerly (CPU
    tests of the padding and layout logic).
    """

    def __init__(
        self, runner: ModelRunner, max_batch: int, num_query: int, *, capture: bool = True
    ) -> None:
        cfg = runner.config
        assert cfg.max_model_len is not None and runner.kv_cache is not None
        self.runner = runner
        self.captured = capture
        dev = runner.device
        self.num_query = q = num_query
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = b = self.sizes[-1]
        self.max_model_len = cfg.max_model_len
        self.max_pages = -(-cfg.max_model_len // runner.page_size)
        # a padding sequence's table and the kernels' tile reads: a few more (zero) columns
        self.width = self.max_pages + -(-q // runner.page_size) + 1
        t = b * q
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.src = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(b, self.width, dtype=torch.int32, device=dev)
        self.context_lens = torch.full((b,), q, dtype=torch.int32, device=dev)
        self.cu_query_lens = torch.arange(b + 1, dtype=torch.int32, device=dev) * q
        pin = dev.type == "cuda"
        # host staging, pinned and doubled: [ids, src, positions, slots], then lens and tables
        self._host64 = [torch.zeros(4, t, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host32 = [
            torch.zeros(b * (1 + self.width), dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._flip = 0
        self.tables = BlockTableRows(self.max_pages, capacity=max(64, 2 * b), poison=runner.poison)
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
        """Logits ``[size * num_query, V]`` of the bucket, from the static buffers."""
        runner = self.runner
        t = size * self.num_query
        src = self.src[:t]
        pending = runner.last_sampled[src.clamp(min=0)]
        ids = torch.where(src >= 0, pending, self.input_ids[:t])
        hidden = runner.model(ids, runner.rotary, runner.kv_cache, self._meta(size))
        return runner.model.compute_logits(hidden)

    def _meta(self, size: int) -> AttentionMetadata:
        q = self.num_query
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
            num_prefills=size,
            num_prefill_tokens=size * q,
            num_decodes=0,
            max_query_len=q,
            max_context_len=self.max_model_len + q,
            page_size=self.runner.page_size,
            **lists,
        )

    def describe(self) -> str:
        """The captured buckets, compactly."""
        return f"batch {self.sizes} x {self.num_query} tokens"

    def can_run(self, seqs: Seq[SeqInput]) -> bool:
        """Whether every sequence decodes or verifies (no prompt work) within a bucket."""
        return 0 < len(seqs) <= self.max_batch and all(
            s.sample and len(s.token_ids) == s.num_logits <= self.num_query for s in seqs
        )

    def forget(self, seq_ids: Seq[int]) -> None:
        """Drop the block-table rows of sequences that finished or whose tables were rebuilt."""
        if seq_ids:
            self.tables.forget(seq_ids)

    def run(self, seqs: Seq[SeqInput]) -> tuple[torch.Tensor, list[int]]:
        """Copy the step in, replay; returns the bucket's logits and each sequence's logits rows.

        Each sequence's tokens fill the *end* of its ``num_query`` rows, its
        padding rows the start (positions just before its first token, no K/V
        stored), and its context length ends at its last real token: no real
        row then has a key it must not see in its range, so none multiplies a
        never-written V slot (NaN under ``poison_memory``) by a zero weight.
        """
        n, q, ps = len(seqs), self.num_query, self.runner.page_size
        size = next(b for b in self.sizes if b >= n)
        self._flip ^= 1
        h64, h32 = self._host64[self._flip], self._host32[self._flip]
        b, t = self.max_batch, size * q
        h_ctx, h_tables = h32[:b], h32[b:].view(b, self.width)
        a64, a_ctx, a_tables = h64.numpy(), h_ctx.numpy(), h_tables.numpy()
        ids = a64[0, :t].reshape(size, q)
        ids[:] = 0
        lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
        pad = q - lens  # leading padding rows of each sequence
        for i, s in enumerate(seqs):
            ids[i, pad[i] :] = s.token_ids
        start = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        pos = (start - pad)[:, None] + np.arange(q)[None, :]  # [n, q]; padding before start
        real = np.arange(q)[None, :] >= pad[:, None]
        pos = np.clip(pos, 0, self.max_model_len - 1)
        rows_of = self.tables.rows(seqs)
        tables = self.tables.array
        page = tables[rows_of[:, None], np.minimum(pos // ps, self.max_pages - 1)]
        slots = np.where(real, page.astype(np.int64) * ps + pos % ps, -1)
        src = a64[1, :t].reshape(size, q)
        src[:] = -1
        for i, s in enumerate(seqs):
            if s.draft_ids is not None:  # placeholders: written on the device below
                ids[i, q - len(s.draft_ids) :] = 0
        pending = ids[:n] == PENDING_TOKEN
        if pending.any():
            for i, j in zip(*np.nonzero(pending), strict=True):
                src[i, j] = self.runner._pending_row(seqs[i].seq_id)
            ids[:n][pending] = 0
        a64[2, :t].reshape(size, q)[:n] = pos
        a64[2, n * q : t] = 0
        a64[3, :t].reshape(size, q)[:n] = slots
        a64[3, n * q : t] = -1
        a_ctx[:n] = start + lens
        a_ctx[n:size] = q  # padding sequences: keys of page 0, nothing stored
        a_tables[:n, : self.max_pages] = tables[rows_of]
        a_tables[:n, self.max_pages :] = 0
        a_tables[n:size] = 0
        nb = self.runner.device.type == "cuda"
        self.input_ids[:t].copy_(h64[0, :t], non_blocking=nb)
        self.src[:t].copy_(h64[1, :t], non_blocking=nb)
        self.positions[:t].copy_(h64[2, :t], non_blocking=nb)
        self.slots[:t].copy_(h64[3, :t], non_blocking=nb)
        self.context_lens[:size].copy_(h_ctx[:size], non_blocking=nb)
        self.block_tables[:size].copy_(h_tables[:size], non_blocking=nb)
        for i, s in enumerate(seqs):
            if s.draft_ids is not None:
                end = (i + 1) * q
                self.input_ids[end - len(s.draft_ids) : end].copy_(s.draft_ids)
        if self.captured:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self._forward(size)
        rows = [
            (i + 1) * q - s.num_logits + j for i, s in enumerate(seqs) for j in range(s.num_logits)
        ]
        return out, rows


def capture_verify_graphs(runner: ModelRunner) -> None:
    """Capture verification steps of (batch, k + 1) tokens for ``runner`` (inside its graph capture)."""
    cfg = runner.config
    try:
        runner.verify_graphs = VerifyGraphs(
            runner, speculation_max_batch(cfg), cfg.num_speculative_tokens + 1
        )
    except Exception as exc:  # noqa: BLE001 - eager verification still works
        torch.cuda.synchronize(runner.device)
        log.warning("verification CUDA graphs off (capture failed: %s); it runs eagerly", exc)
        return
    log.info("captured CUDA graphs for verification steps: %s", runner.verify_graphs.describe())
