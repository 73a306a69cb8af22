"""Weights offered in their file's quantized blocks: what a GGUF file stores, before dequantizing.

The default path dequantizes every GGUF tensor to float32 (and caches the result:
:mod:`pitstop.plugins.model_sources.gguf.cache`). A weight format that can hold a GGUF
file's blocks as they are (``weights=gguf``,
:class:`~pitstop.plugin_system.weight_format.KeepsBlocks`) is offered them instead: the
loader yields each 2-D block-quantized tensor as a :class:`QuantizedWeight` (its raw bytes,
row by row, its ggml type and logical shape, its rows already in the order the model
wants), every other tensor dense, and

- the engine keeps a :class:`QuantizedWeight` where the format takes it (``takes_blocks``)
  and dequantizes it where not (:func:`pitstop.loading.checkpoint.weight_stream`), so the
  finite-weights check and the model see a plain float32 tensor, as on the default path;
- the model merges the parts of a merged projection (q/k/v, gate/up) with
  :class:`RowMerger`: rows of one type are concatenated (exact: a row's blocks are
  its own), parts stored in different types stay separate row groups of one
  :class:`QuantizedWeight` (a format multiplies each and concatenates the outputs);
- a row permutation (llama.cpp's q/k rotary order, undone per head) is a gather of
  whole rows, exact on quantized rows too (:meth:`QuantizedWeight.take_rows`).

Only the ``gguf`` package knows how to dequantize here (``gguf.quants``, imported
lazily); the formats bring their own decoders.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from pitstop.plugins.model_sources.gguf.file import require_gguf


@attrs.frozen(eq=False)
class BlockRows:
    """A run of rows of one ggml type: ``raw`` ``[rows, row_bytes]`` uint8, as the file stores them."""

    raw: torch.Tensor
    qtype: str  # the ggml type's name: "Q4_1", "Q8_0", "Q6_K", ...

    @property
    def rows(self) -> int:
        """How many rows of the weight this run holds."""
        return int(self.raw.shape[0])

    def dequantize(self, in_features: int) -> torch.Tensor:
        """The run's values ``[rows, in_features]`` as float32 (``gguf.quants``, bit-exact)."""
        gguf = require_gguf()
        qtype = gguf.GGMLQuantizationType[self.qtype]
        values = gguf.quants.dequantize(self.raw.numpy(), qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(
            self.rows, in_features
        )


@attrs.frozen(eq=False)
class QuantizedWeight:
    """A linear weight ``[out_features, in_features]`` kept in its GGUF blocks.

    ``parts`` are runs of consecutive rows, each of one ggml type: one run for a
    weight the file stores as one tensor or a merge of parts of one type, several
    where a merged projection's parts were stored in different types (a Q4_K_M file
    keeps ``attn_v`` in Q6_K beside a Q4_K ``attn_q``).
    """

    parts: tuple[BlockRows, ...]
    in_features: int

    @classmethod
    def of(cls, raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> QuantizedWeight:
        """One run: ``raw`` (the tensor's bytes, any shape) of ``qtype``, logical ``shape``."""
        rows = int(shape[0])
        return cls((BlockRows(raw.reshape(rows, -1), qtype),), int(shape[1]))

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return (sum(p.rows for p in self.parts), self.in_features)

    @property
    def qtypes(self) -> tuple[str, ...]:
        """The ggml type of each run, in row order."""
        return tuple(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (what the file stores for these rows)."""
        return sum(p.raw.numel() for p in self.parts)

    def take_rows(self, order: np.ndarray) -> QuantizedWeight:
        """Row ``i`` of the result is row ``order[i]`` of this one (one run only)."""
        if len(self.parts) != 1:
            raise ValueError("only a weight of one run of rows is reordered")
        part = self.parts[0]
        index = torch.as_tensor(np.asarray(order, dtype=np.int64))
        return QuantizedWeight(
            (BlockRows(part.raw[index].contiguous(), part.qtype),), self.in_features
        )

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32, bit-equal to the default (dequantize-to-cache) path."""
        return torch.cat([p.dequantize(self.in_features) for p in self.parts])


def merge_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts stacked by rows (in the given order) into one weight: adjacent runs of one
    type are concatenated into one run, runs of different types stay separate."""
    if len({w.in_features for w in weights}) != 1:
        raise ValueError(f"parts of {[w.in_features for w in weights]} features are no one weight")
    runs: list[list[BlockRows]] = []
    for part in (p for w in weights for p in w.parts):
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    merged = tuple(
        run[0] if len(run) == 1 else BlockRows(torch.cat([p.raw for p in run]), run[0].qtype)
        for run in runs
    )
    return QuantizedWeight(merged, weights[0].in_features)


@attrs.define
class RowMerger:
    """Collects the parts of each merged weight (by row offset) until all have arrived.

    ``parts`` maps a model weight (``"layers.0.self_attn.qkv_proj"``) to how many
    checkpoint tensors fill it; :meth:`add` returns the merged :class:`QuantizedWeight`
    once the last one arrives, ``None`` before.
    """

    parts: dict[str, int]
    pending: dict[str, list[tuple[int, QuantizedWeight]]] = attrs.field(factory=dict)

    def add(
        self, target: str, offset: int | None, weight: QuantizedWeight
    ) -> QuantizedWeight | None:
        """Keep one part (``offset``: its first row in the merged weight; None: the whole)."""
        got = self.pending.setdefault(target, [])
        got.append((offset or 0, weight))
        if len(got) < self.parts.get(target, 1):
            return None
        del self.pending[target]
        return merge_rows([w for _, w in sorted(got, key=lambda item: item[0])])

    def take_unfinished(self) -> list[tuple[str, int, QuantizedWeight]]:
        """``(weight, row offset, part)`` of every part whose weight never completed
        (its other parts came dense: the format declined their type), and forgets them:
        the model dequantizes these beside the dense ones."""
        left = [(t, off, w) for t, got in sorted(self.pending.items()) for off, w in got]
        self.pending.clear()
        return left
