"""Batch building: one step's sequences as flat device tensors and attention metadata.

:func:`build_metadata` flattens a step for an eager (or piecewise) forward;
:class:`BlockTableRows` keeps the live sequences' block tables in one host
array for the CUDA graphs' static buffers; :func:`select_rows` picks the
hidden rows to turn into logits. A pending input token (sampled by the
previous launched step, not on the host yet) is gathered on the device from
the runner's ``last_sampled`` buffer; ``pending_row(seq_id)`` names its row.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import attrs
import numpy as np
import torch

from pitstop.ground.attention import AttentionMetadata
from pitstop.ground.poison import poison_array
from pitstop.ground.step import SeqInput
from pitstop.ground.transfer import to_device
from pitstop.requests.sequence import PENDING_TOKEN

PendingRow = Callable[[int], int]


@attrs.frozen
class _HostBatch:
    """A step flattened on the host: every list or array the metadata is made from."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    tables: np.ndarray
    cu: list[int]
    ctx_lens: list[int]
    q_lens: list[int]
    sample_rows: list[int]
    num_prefills: int
    num_prefill_tokens: int


def _flatten(seqs: Seq[SeqInput], ps: int) -> _HostBatch:
    """Positions, slots, lengths and sample rows of ``seqs``, with numpy: no loop over tokens."""
    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    cu = [0]
    ctx_lens: list[int] = []
    q_lens: list[int] = []
    sample_rows: list[int] = []
    width = max((len(s.block_table) for s in seqs), default=0)
    tables = np.full((len(seqs), width), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        input_ids.extend(s.token_ids)
        pos = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)
        table = np.asarray(s.block_table, dtype=np.int64)
        tables[i, : len(table)] = table
        positions.append(pos)
        slots.append(table[pos // ps] * ps + pos % ps)
        cu.append(cu[-1] + n)
        ctx_lens.append(s.start_pos + n)
        q_lens.append(n)
        if s.sample:
            sample_rows.extend(range(cu[-1] - s.num_logits, cu[-1]))
    # The attention kernels run the first num_prefills sequences as prefills and the rest as
    # decodes, one row each: every sequence up to the last one of several tokens is a prefill
    # (a one-token prompt among them runs there as any other), so that an unsorted batch (the
    # engine sorts prefills first; a direct caller may not) leaves no row unwritten.
    num_prefills = max((i + 1 for i, n in enumerate(q_lens) if n > 1), default=0)
    num_prefill_tokens = cu[num_prefills]
    empty = np.zeros(0, dtype=np.int64)
    return _HostBatch(
        np.asarray(input_ids, dtype=np.int64),
        np.concatenate(positions) if positions else empty,
        np.concatenate(slots) if slots else empty,
        tables,
        cu,
        ctx_lens,
        q_lens,
        sample_rows,
        num_prefills,
        num_prefill_tokens,
    )


def build_metadata(
    seqs: Seq[SeqInput],
    page_size: int,
    device: torch.device,
    last_sampled: torch.Tensor,
    pending_row: PendingRow,
) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
    """Flatten a step into input ids, attention metadata and the rows to sample.

    Drafts still on the device and pending tokens are placeholders (0) on
    the host, written into the input ids on the device.
    """

    def tensor(data, dtype):
        return to_device(data, dtype, device)

    host = _flatten(seqs, page_size)
    cu, ids = host.cu, host.input_ids
    on_device = [
        (cu[i + 1] - len(s.draft_ids), s.draft_ids)
        for i, s in enumerate(seqs)
        if s.draft_ids is not None
    ]
    for begin, drafts in on_device:
        ids[begin : begin + len(drafts)] = 0  # placeholders: written on the device below
    pending = np.flatnonzero(ids == PENDING_TOKEN)
    src = None
    if len(pending):
        seq_of_token = np.repeat(np.arange(len(seqs)), host.q_lens)[pending]
        src = np.asarray([pending_row(seqs[i].seq_id) for i in seq_of_token])
        ids[pending] = 0
    meta = AttentionMetadata(
        positions=tensor(host.positions, torch.int64),
        slot_mapping=tensor(host.slots, torch.int64),
        block_tables=tensor(host.tables, torch.int32),
        context_lens=tensor(host.ctx_lens, torch.int32),
        cu_query_lens=tensor(cu, torch.int32),
        num_prefills=host.num_prefills,
        num_prefill_tokens=host.num_prefill_tokens,
        num_decodes=len(seqs) - host.num_prefills,
        max_query_len=max(host.q_lens, default=0),
        max_context_len=max(host.ctx_lens, default=0),
        page_size=page_size,
        context_lens_list=host.ctx_lens,
        query_lens_list=host.q_lens,
    )
    input_tensor = tensor(ids, torch.int64)
    if src is not None:  # the previous step's samples, gathered on the device
        index = tensor(pending, torch.int64)
        input_tensor.index_copy_(0, index, last_sampled[tensor(src, torch.int64)])
    for begin, drafts in on_device:
        input_tensor[begin : begin + len(drafts)].copy_(drafts)
    return input_tensor, meta, host.sample_rows


def select_rows(hidden: torch.Tensor, rows: list[int], device: torch.device) -> torch.Tensor:
    """The hidden rows to turn into logits, without waiting for the GPU.

    A pure decode step samples every row in order: no gather at all. Otherwise
    the indices go over asynchronously, so the logits GEMM and the sampler queue
    up behind the forward pass instead of after a host-device synchronization.
    """
    if len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1:
        return hidden
    return hidden.index_select(0, to_device(rows, torch.int64, device))


class BlockTableRows:
    """Block tables of the live sequences, kept in one numpy array and updated incrementally.

    Each sequence owns a row while it lives; a step writes only the pages a
    table gained since the last step (tables only grow between ``allocate``
    and ``free``/``truncate``; a new list object, a shorter table or an
    explicit :meth:`forget` rewrites the row), then gathers the step's rows
    in one vectorized copy.
    """

    def __init__(self, max_pages: int, capacity: int = 64, *, poison: bool = False) -> None:
        self.max_pages = max_pages
        self.poison = poison  # released rows and new capacity hold INT_SENTINEL, not zeros
        self.array = np.zeros((capacity, max_pages), dtype=np.int32)
        if poison:
            poison_array(self.array)
        self._row: dict[int, int] = {}  # seq_id -> row
        self._known: dict[int, tuple[list[int], int]] = {}  # seq_id -> (table object, length)
        self._free = list(range(capacity - 1, -1, -1))

    def forget(self, seq_ids: Seq[int]) -> None:
        """Release the rows of sequences that finished, were preempted or truncated."""
        for seq_id in seq_ids:
            row = self._row.pop(seq_id, None)
            if row is not None:
                self._free.append(row)
                del self._known[seq_id]
                if self.poison:
                    poison_array(self.array[row])

    def rows(self, seqs: Seq[SeqInput]) -> np.ndarray:
        """The rows of ``seqs`` (in order), every table brought up to date."""
        out = np.empty(len(seqs), dtype=np.int64)
        for i, s in enumerate(seqs):
            table = s.block_table
            row = self._row.get(s.seq_id)
            if row is None:
                if not self._free:
                    self._grow()
                row = self._row[s.seq_id] = self._free.pop()
                begin = 0
            else:
                obj, length = self._known[s.seq_id]
                begin = length if obj is table and len(table) >= length else 0
            if begin < len(table):
                self.array[row, begin : len(table)] = table[begin:]
            self._known[s.seq_id] = (table, len(table))
            out[i] = row
        return out

    def _grow(self) -> None:
        old = self.array.shape[0]
        grown = np.zeros_like(self.array)
        if self.poison:
            poison_array(grown)
        self.array = np.concatenate([self.array, grown])
        self._free.extend(range(2 * old - 1, old - 1, -1))
