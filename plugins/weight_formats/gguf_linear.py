"""A linear layer whose weight stays in its GGUF blocks: ``y = x @ W.T``, dequantized on the fly.

:class:`GGUFLinear` holds one weight matrix of logical shape ``(out_features,
in_features)`` as the file stores it: a uint8 tensor of ``out_features`` rows of
``in_features // block_elems * block_bytes`` bytes (see
:mod:`~pitstop.plugins.weight_formats.gguf_blocks` for each type's block layout). Its resident
memory is therefore the file's tensor bytes (plus a float32 bias, if any), which is what
issue 33's "within 1.2x the file's tensor bytes" rule checks through
:meth:`GGUFLinear.resident_bytes` and :attr:`GGUFLinear.file_bytes`.

How :meth:`GGUFLinear.forward` multiplies:

* **CPU**: tile by tile over the output rows. Each tile of about :data:`TILE_ELEMS`
  weights (2 MiB of float32, about a core's L2 cache, so the matmul reads it back from
  there) is dequantized with the exact torch decoder and multiplied. Measured with one
  thread on the SmolLM2 file's tensors (``benchmarks/gguf_linear_cpu.py``; best of 7-9,
  milliseconds, ranges over runs on a 2-core machine shared with other work; tile sizes
  of 2^15 to 2^21 weights were tried, 2^18 and 2^19 were best):

  ==========================  =====  ======================  ======================
  matrix                      batch  whole, then matmul      tiled (2^19 per tile)
  ==========================  =====  ======================  ======================
  ffn_down 576x1536 Q4_1      1      1.29-1.36               1.33-1.35
  ffn_down 576x1536 Q4_1      16     1.53-1.61               1.59-1.69
  ffn_up 1536x576 Q4_1        1      1.30-1.32               1.29-1.34
  ffn_up 1536x576 Q4_1        16     1.54-1.59               1.61-1.74
  token_embd 49152x576 Q8_0   1      73-95                   22-30
  token_embd 49152x576 Q8_0   16     92-124                  30-42
  ==========================  =====  ======================  ======================

  The small matrices are a single tile at this size, so the two paths are the same work
  (equal within the noise); for the 49152-row one tiling is 3-4x faster (its whole
  float32 copy, 113 MB, never fits a cache and its fresh pages fault in on every call)
  and holds 2 MiB of float32 instead of 113 MB. Every matrix takes the tiled path.

  Each output column is still one dot product over the whole ``in_features``, and the
  tiles are cut so the BLAS computes each column as it would in one matmul of the whole matrix: a tile is a
  multiple of :data:`TILE_ALIGN` rows and the last tile takes the remainder (MKL's
  kernels treat a matrix's last few columns, and a matrix of only a few columns, with
  another summation order; cut anywhere else, a tile's first or last columns can differ
  in the last bit). With torch on one thread the result is then bit-equal to
  ``x @ dequantize(W).T`` in float32 (checked with MKL on an AVX-512 Xeon for batches
  1-33 and ragged row counts; another BLAS could break that, not the tolerance). On more
  threads MKL splits each matmul's columns among them, and where it splits changes a
  column's summation order: even the whole-matrix reference is not bit-equal between one
  and two threads (4099x576 at batch 1), and the tiled result agrees with it to float32
  rounding (about 1e-7 relative) rather than bit for bit. A matrix of one tile (every
  SmolLM2 weight but the embedding, at this tile size) is the very same matmul, so it is
  bit-equal on any thread count. The dequantized weights are always the same bits.

* **CUDA**: the Triton kernel of :mod:`~pitstop.plugins.weight_formats.gguf_gemv` for
  the types it reads directly and batches of up to its ``MAX_BATCH`` rows (it never
  materializes the weight); otherwise (another type, a larger batch, no Triton, another
  device) the whole matrix dequantized by the same torch decoder and one matmul.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pitstop.plugins.weight_formats.gguf_blocks import BlockLayout, dequantize, layout_of

TILE_ELEMS = 1 << 19  # weights dequantized at once on the CPU (2 MiB of float32)
TILE_ALIGN = 64  # tile rows are a multiple of this (see the module docstring)


def tile_bounds(rows: int, tile_rows: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each tile of ``rows`` rows: ``tile_rows`` each, the last one
    taking the remainder (so no tile but a lone first one is shorter than ``tile_rows``)."""
    edges = [i * tile_rows for i in range(max(1, rows // tile_rows))] + [rows]
    return list(zip(edges[:-1], edges[1:], strict=True))


class GGUFLinear(torch.nn.Module):
    """One weight matrix kept as its GGUF blocks; ``forward(x) = x @ W.T (+ bias)``.

    ``raw`` holds the matrix's bytes exactly as the file stores them (any shape, uint8,
    ``out_features * row_bytes`` bytes); ``qtype`` is its ggml type (a number, a name or
    a ``gguf.GGMLQuantizationType``); ``shape`` is ``(out_features, in_features)``.
    ``raw`` is kept (reshaped, not copied, when it is contiguous) as the ``raw`` buffer,
    so ``.to(device)`` moves the blocks and nothing else.
    """

    raw: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        raw: torch.Tensor,
        qtype: int | str | enum.Enum,
        shape: Sequence[int],
        bias: torch.Tensor | None = None,
        *,
        tile_elems: int = TILE_ELEMS,
    ) -> None:
        super().__init__()
        if len(shape) != 2:
            raise ValueError(f"a linear weight is 2-D (out_features, in_features), not {shape}")
        self.layout: BlockLayout = layout_of(qtype)
        self.out_features, self.in_features = int(shape[0]), int(shape[1])
        self.row_bytes = self.layout.row_bytes(self.in_features)
        if raw.dtype != torch.uint8 or raw.numel() != self.out_features * self.row_bytes:
            raise ValueError(
                f"a {self.layout.qtype.name} weight of shape {[*shape]} is "
                f"{self.out_features * self.row_bytes} uint8 bytes, "
                f"not {raw.numel()} {raw.dtype}"
            )
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} outputs")
        self.register_buffer("raw", raw.reshape(self.out_features, self.row_bytes))
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32))
        self.tile_rows = max(TILE_ALIGN, tile_elems // self.in_features // TILE_ALIGN * TILE_ALIGN)

    @classmethod
    def from_gguf_tensor(
        cls, tensor: Any, bias: torch.Tensor | None = None, device: torch.device | str = "cpu"
    ) -> GGUFLinear:
        """A layer from a ``gguf.GGUFReader`` tensor, its bytes copied out of the file's map.

        The tensor must be 2-D; its ``shape`` is in ggml order (``ne0`` first), reversed
        here to ``(out_features, in_features)``.
        """
        shape = tuple(int(s) for s in reversed(list(tensor.shape)))
        data = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)
        raw = torch.from_numpy(data.copy()).to(device)
        return cls(raw, tensor.tensor_type, shape, bias)

    @property
    def qtype_name(self) -> str:
        """The ggml type's name (``"Q4_1"``, ...)."""
        return self.layout.qtype.name

    @property
    def file_bytes(self) -> int:
        """The bytes this weight takes in the GGUF file (its blocks, nothing else)."""
        return self.layout.tensor_bytes((self.out_features, self.in_features))

    def resident_bytes(self) -> int:
        """Bytes this layer keeps allocated: its blocks, plus its bias if it has one."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``(out_features, in_features)`` as ``dtype`` (a fresh tensor)."""
        return dequantize(self.raw, self.layout.qtype, self._shape(self.out_features), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` of the weight, shaped ``(*ids.shape, in_features)``: an embedding
        lookup (a tied ``token_embd`` is both the embedding and the output layer) that
        dequantizes only the rows asked for."""
        picked = self.raw[ids.reshape(-1)]
        values = dequantize(picked, self.layout.qtype, self._shape(picked.shape[0]), dtype)
        return values.reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``x`` of shape ``(..., in_features)``, in ``x``'s dtype.

        The weight is dequantized in float32 and rounded to ``x.dtype`` before the matmul;
        in float32 on the CPU the result is bit-equal to ``x @ self.dequantize_weight().T``
        on one thread, equal to float32 rounding on more (see the module docstring).
        """
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input of {x.shape[-1]} features for {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x.device.type == "cpu":
            y = self._tiled(x2)
        else:
            y = self._on_device(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _shape(self, rows: int) -> tuple[int, int]:
        return (rows, self.in_features)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        y = x.new_empty((x.shape[0], self.out_features))
        qtype = self.layout.qtype
        for r0, r1 in tile_bounds(self.out_features, self.tile_rows):
            w = dequantize(self.raw[r0:r1], qtype, self._shape(r1 - r0), x.dtype)
            y[:, r0:r1] = x @ w.T
        return y

    def _on_device(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            try:
                from pitstop.plugins.weight_formats import gguf_gemv as gemv
            except ImportError:  # no Triton: dequantize + matmul below
                gemv = None
            if gemv and gemv.supports(self.layout.qtype) and x.shape[0] <= gemv.MAX_BATCH:
                return gemv.dequant_gemv(x, self.raw, self.layout.qtype, self.out_features)
        return x @ self.dequantize_weight(x.dtype).T

    def extra_repr(self) -> str:
        """``in_features``, ``out_features``, the type and whether there is a bias."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype_name}, bias={self.bias is not None}"
        )
