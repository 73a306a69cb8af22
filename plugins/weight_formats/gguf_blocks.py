"""GGUF block layouts and their dequantization in torch, bit-exact to ``gguf.quants``.

A GGUF tensor of logical shape ``(..., n)`` (PyTorch order: the last dimension is the
one llama.cpp calls ``ne0``) is stored row by row; each row of ``n`` elements is cut into
blocks of ``block_elems`` consecutive elements, each block ``block_bytes`` bytes, so a row
takes ``n // block_elems * block_bytes`` bytes and no block spans two rows. All numbers
are little-endian; ``f16`` is IEEE half precision. The layouts (``QK_K = 256``):

``F32`` / ``F16`` / ``BF16``
    Not blocked (one element per "block" of 4, 2 and 2 bytes). BF16 is the top half of a
    float32.

``Q8_0`` (32 elements, 34 bytes)
    ``d: f16`` then ``qs: int8[32]``; ``x[i] = d * qs[i]``.

``Q4_0`` (32 elements, 18 bytes)
    ``d: f16`` then ``qs: u8[16]`` holding 4-bit values: element ``i < 16`` is the low
    nibble of ``qs[i]``, element ``16 + i`` its high nibble; ``x = d * (q - 8)``.

``Q4_1`` (32 elements, 20 bytes)
    ``d: f16``, ``m: f16``, then ``qs: u8[16]`` packed as in Q4_0; ``x = d * q + m``.

``Q5_0`` (32 elements, 22 bytes)
    ``d: f16``, ``qh: u32`` (bit ``i`` is the fifth bit of element ``i``), ``qs: u8[16]``
    (low four bits, packed as in Q4_0); ``x = d * (q - 16)``.

``Q5_1`` (32 elements, 24 bytes)
    ``d: f16``, ``m: f16``, ``qh: u32``, ``qs: u8[16]``; ``x = d * q + m``.

``Q2_K`` (256 elements, 84 bytes)
    ``scales: u8[16]`` (per 16-element sub-block: low nibble a scale, high nibble a min),
    ``qs: u8[64]`` (2-bit values: the 128 elements of each half are the four 2-bit fields
    of its 32 bytes, lowest bits first, 32 elements per field), ``d: f16``, ``dmin: f16``;
    ``x = (d * scale) * q - (dmin * min)``.

``Q3_K`` (256 elements, 110 bytes)
    ``hmask: u8[32]`` (bit ``j`` of byte ``i`` is the high bit of element ``32 j + i``),
    ``qs: u8[64]`` (low two bits, packed as Q2_K's), ``scales: u8[12]`` (sixteen 6-bit
    scales: low four bits from the nibbles of bytes 0-7, top two bits from the 2-bit
    fields of bytes 8-11, offset by 32), ``d: f16``; with ``h`` the high bit,
    ``x = (d * (scale - 32)) * (q_low - 4 * (1 - h))``.

``Q4_K`` (256 elements, 144 bytes)
    ``d: f16``, ``dmin: f16``, ``scales: u8[12]`` (eight 6-bit scales and eight 6-bit
    mins, one per 32-element sub-block: sub-blocks 0-3 take the low six bits of bytes
    0-3 (scales) and 4-7 (mins), sub-blocks 4-7 take a nibble of bytes 8-11 for their low
    four bits and the top two bits of bytes 0-3 / 4-7 for their high two), ``qs: u8[128]``
    (each 32 bytes hold two sub-blocks: low nibbles the first, high nibbles the second);
    ``x = (d * scale) * q - (dmin * min)``.

``Q5_K`` (256 elements, 176 bytes)
    ``d``, ``dmin``, ``scales`` as Q4_K, ``qh: u8[32]`` (bit ``j`` of byte ``i`` is the
    fifth bit of element ``32 j + i``), ``qs: u8[128]`` as Q4_K's.

``Q6_K`` (256 elements, 210 bytes)
    ``ql: u8[128]`` (low four bits: each 64 bytes cover 128 elements, low nibbles the
    first 64, high nibbles the next 64), ``qh: u8[64]`` (top two bits: each 32 bytes cover
    128 elements, the four 2-bit fields in turn, 32 elements each), ``scales: int8[16]``
    (one per 16 elements), ``d: f16``; ``x = (d * scale) * (q - 32)``.

Each formula is evaluated in float32 with exactly the operations, in exactly the order,
of ``gguf.quants`` (one rounding per product or sum, no fused multiply-add), which is what
makes the result bit-equal to the numpy reference. Every function here is made of
vectorized torch ops over all blocks at once, so it runs unchanged on CUDA tensors.

:func:`nonfinite_blocks` checks kept blocks for NaN or infinite scales without
dequantizing them (the engine's finite-weights check skips integer tensors).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

QK_K = 256  # elements of a K-quant super-block


class QuantType(enum.IntEnum):
    """The ggml tensor types this module knows, numbered as ``gguf.GGMLQuantizationType``."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


class UnsupportedQuantType(NotImplementedError):
    """A GGUF tensor type this module cannot keep or dequantize (the message lists those it can)."""


@dataclass(frozen=True)
class BlockField:
    """One field of a block: its name, byte offset and size, and what its bytes hold."""

    name: str
    offset: int
    size: int
    holds: str


Dequantizer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockLayout:
    """How one ggml type stores a block: element and byte counts, its fields, its decoder.

    ``decode`` takes a ``(n_blocks, block_bytes)`` uint8 tensor and returns the
    ``(n_blocks, block_elems)`` float32 values.
    """

    qtype: QuantType
    block_elems: int
    block_bytes: int
    fields: tuple[BlockField, ...]
    decode: Dequantizer

    @property
    def quantized(self) -> bool:
        """True for the block-quantized types (not F32, F16, BF16)."""
        return self.block_elems > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of ``n`` elements (``n`` must be a multiple of the block size)."""
        if n % self.block_elems:
            raise ValueError(
                f"{self.qtype.name} rows must hold a multiple of {self.block_elems} elements, "
                f"not {n}"
            )
        return n // self.block_elems * self.block_bytes

    def tensor_bytes(self, shape: Sequence[int]) -> int:
        """Bytes a tensor of logical ``shape`` (PyTorch order) takes in the file."""
        if not shape:
            raise ValueError("a GGUF tensor has at least one dimension")
        rows = 1
        for s in shape[:-1]:
            rows *= int(s)
        return rows * self.row_bytes(int(shape[-1]))


# ------------------------------------------------------------------ field readers


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 at ``offset`` of every block, as a ``(n_blocks, 1)`` float32 tensor."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


@functools.cache
def _shifts(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A uint8 tensor of shift counts, shaped ``(len, 1)`` to broadcast over a byte axis.

    Made once per device (cached): a decoder run inside a CUDA graph capture (a weight
    format's fallback matmul) must not copy from the host, and the eager warm-up before
    the capture has made it by then."""
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(-1, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes ``(..., k)`` -> 4-bit values ``(..., 2k)``: the low nibbles, then the high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes ``(..., k)`` -> ``(..., 8 // width, k)``: field ``j`` of each byte in row ``j``.

    Field ``j`` is bits ``width*j`` to ``width*(j+1) - 1`` (lowest bits first).
    """
    shifts = _shifts(tuple(range(0, 8, width)), qs.device)
    return (qs.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> (scales, mins), each ``(n_blocks, 8)`` uint8 of 6 bits."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 6) << 4)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 6) << 4)), dim=-1)
    return sc, mn


def _f32(x: torch.Tensor) -> torch.Tensor:
    """An integer tensor as a fresh float32 one (the decoders then work on it in place)."""
    return x.to(torch.float32)


# ------------------------------------------------------------------ decoders


def _decode_f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _decode_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _decode_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _f32(blocks[:, 2:].contiguous().view(torch.int8))
    return q.mul_(d)


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _f32(_nibbles(blocks[:, 2:]))
    return q.sub_(8.0).mul_(d)


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _f32(_nibbles(blocks[:, 4:]))
    return q.mul_(d).add_(m)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's ``qh`` (4 bytes, a little-endian u32) -> bit ``i`` for element ``i``."""
    # byte b, bit k is element 8b + k
    return _bits(qh, 1).transpose(-1, -2).reshape(qh.shape[0], 32)


def _decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:]) | (_fifth_bits(blocks[:, 2:6]) << 4)
    return _f32(q).sub_(16.0).mul_(d)


def _decode_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:]) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return _f32(q).mul_(d).add_(m)


def _decode_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, 0:16], blocks[:, 16:80]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * _f32(scales & 0x0F)).reshape(n, 16, 1)
    ml = (dmin * _f32(scales >> 4)).reshape(n, 16, 1)
    q = _f32(_bits(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16))
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _decode_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    low = _bits(scales[:, 0:8], 4).reshape(n, 16)  # nibble j of byte i -> scale 8j + i
    high = _bits(scales[:, 8:12], 2).reshape(n, 16)  # field j of byte i -> scale 4j + i
    sc = _f32(low | (high << 4)) - 32.0
    dl = (d * sc).reshape(n, 16, 1)
    ql = _f32(_bits(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16))
    h = _bits(hmask, 1).reshape(n, 16, 16)
    q = ql.sub_(_f32((h ^ 1) << 2))
    return q.mul_(dl).reshape(n, QK_K)


def _decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    dl = (d * _f32(sc)).reshape(n, 8, 1)
    ml = (dmin * _f32(mn)).reshape(n, 8, 1)
    q = _f32(_nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32))
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _decode_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    dl = (d * _f32(sc)).reshape(n, 8, 1)
    ml = (dmin * _f32(mn)).reshape(n, 8, 1)
    ql = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = _bits(blocks[:, 16:48], 1)  # (n, 8, 32): bit j of byte i -> element 32j + i
    q = _f32(ql | (qh << 4))
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = _bits(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
    sc = _f32(blocks[:, 192:208].contiguous().view(torch.int8))
    d = _f16(blocks, 208)
    dl = (d * sc).reshape(n, 16, 1)
    q = _f32(ql | (qh << 4)).sub_(32.0).reshape(n, 16, 16)
    return q.mul_(dl).reshape(n, QK_K)


# ------------------------------------------------------------------ the table


def _layout(
    qtype: QuantType, elems: int, decode: Dequantizer, *fields: tuple[str, int, str]
) -> BlockLayout:
    """A layout from its fields in order (name, size, what they hold); offsets are summed."""
    out, offset = [], 0
    for name, size, holds in fields:
        out.append(BlockField(name, offset, size, holds))
        offset += size
    return BlockLayout(qtype, elems, offset, tuple(out), decode)


_D = ("d", 2, "f16 scale")
_M = ("m", 2, "f16 minimum (added)")
_DMIN = ("dmin", 2, "f16 scale of the sub-block minimums")
_K_SCALES = ("scales", 12, "eight 6-bit scales and eight 6-bit mins, packed")

LAYOUTS: dict[QuantType, BlockLayout] = {
    layout.qtype: layout
    for layout in (
        _layout(QuantType.F32, 1, _decode_f32, ("value", 4, "float32")),
        _layout(QuantType.F16, 1, _decode_f16, ("value", 2, "float16")),
        _layout(QuantType.BF16, 1, _decode_bf16, ("value", 2, "bfloat16")),
        _layout(QuantType.Q8_0, 32, _decode_q8_0, _D, ("qs", 32, "int8 values")),
        _layout(QuantType.Q4_0, 32, _decode_q4_0, _D, ("qs", 16, "4-bit values, offset 8")),
        _layout(QuantType.Q4_1, 32, _decode_q4_1, _D, _M, ("qs", 16, "4-bit values")),
        _layout(
            QuantType.Q5_0,
            32,
            _decode_q5_0,
            _D,
            ("qh", 4, "fifth bits, u32"),
            ("qs", 16, "low 4 bits, offset 16"),
        ),
        _layout(
            QuantType.Q5_1,
            32,
            _decode_q5_1,
            _D,
            _M,
            ("qh", 4, "fifth bits, u32"),
            ("qs", 16, "low 4 bits"),
        ),
        _layout(
            QuantType.Q2_K,
            QK_K,
            _decode_q2_k,
            ("scales", 16, "4-bit scale | 4-bit min per 16 elements"),
            ("qs", 64, "2-bit values"),
            _D,
            _DMIN,
        ),
        _layout(
            QuantType.Q3_K,
            QK_K,
            _decode_q3_k,
            ("hmask", 32, "high bits (set: no offset of -4)"),
            ("qs", 64, "low 2 bits"),
            ("scales", 12, "sixteen 6-bit scales, offset 32, packed"),
            _D,
        ),
        _layout(
            QuantType.Q4_K, QK_K, _decode_q4_k, _D, _DMIN, _K_SCALES, ("qs", 128, "4-bit values")
        ),
        _layout(
            QuantType.Q5_K,
            QK_K,
            _decode_q5_k,
            _D,
            _DMIN,
            _K_SCALES,
            ("qh", 32, "fifth bits"),
            ("qs", 128, "low 4 bits"),
        ),
        _layout(
            QuantType.Q6_K,
            QK_K,
            _decode_q6_k,
            ("ql", 128, "low 4 bits"),
            ("qh", 64, "high 2 bits"),
            ("scales", 16, "int8 scale per 16 elements"),
            _D,
        ),
    )
}


def supported_types() -> list[str]:
    """Names of every type :func:`dequantize` handles, in ggml's numbering order."""
    return [t.name for t in sorted(LAYOUTS)]


def quant_type(qtype: int | str | enum.Enum) -> QuantType:
    """The :class:`QuantType` of a ggml type given as a number, a name or an enum member
    (``gguf.GGMLQuantizationType`` included); :class:`UnsupportedQuantType` otherwise."""
    try:
        if isinstance(qtype, str):
            found = QuantType[qtype.upper()]
        elif isinstance(qtype, QuantType):
            found = qtype
        elif isinstance(qtype, enum.Enum):
            found = QuantType(int(qtype.value))
        else:
            found = QuantType(int(qtype))
    except (KeyError, ValueError, TypeError):
        found = None
    if found is None or found not in LAYOUTS:
        name = getattr(qtype, "name", qtype)
        raise UnsupportedQuantType(
            f"GGUF tensor type {name} is not supported kept quantized; "
            f"supported: {', '.join(supported_types())}"
        )
    return found


def layout_of(qtype: int | str | enum.Enum) -> BlockLayout:
    """The :class:`BlockLayout` of a ggml type (see :func:`quant_type` for what it accepts)."""
    return LAYOUTS[quant_type(qtype)]


def dequantize_blocks(blocks: torch.Tensor, qtype: int | str | enum.Enum) -> torch.Tensor:
    """Decode ``(n_blocks, block_bytes)`` uint8 blocks to ``(n_blocks, block_elems)`` float32."""
    layout = layout_of(qtype)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != layout.block_bytes:
        raise ValueError(
            f"{layout.qtype.name} blocks must be a (n, {layout.block_bytes}) uint8 tensor, "
            f"not {tuple(blocks.shape)} {blocks.dtype}"
        )
    return layout.decode(blocks)


def dequantize(
    raw: torch.Tensor,
    qtype: int | str | enum.Enum,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The values of a GGUF tensor from its raw bytes, as a ``shape`` tensor of ``dtype``.

    ``raw`` is a uint8 tensor (any shape, on any device) holding the tensor's bytes as the
    file stores them; ``shape`` is the logical shape in PyTorch order (the last dimension
    is the blocked one; ``gguf``'s ``ReaderTensor.shape`` is the reverse). The float32
    result is bit-equal to ``gguf.quants.dequantize``; another ``dtype`` is that result
    rounded once.
    """
    layout = layout_of(qtype)
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw GGUF bytes must be a uint8 tensor, not {raw.dtype}")
    shape = tuple(int(s) for s in shape)
    want = layout.tensor_bytes(shape)
    if raw.numel() != want:
        raise ValueError(
            f"a {layout.qtype.name} tensor of shape {list(shape)} takes {want} bytes, "
            f"not {raw.numel()}"
        )
    values = layout.decode(raw.reshape(-1, layout.block_bytes))
    return values.reshape(shape).to(dtype)


def nonfinite_blocks(raw: torch.Tensor, qtype: int | str | enum.Enum) -> int:
    """How many blocks of ``raw`` (a tensor's bytes) hold a NaN or infinite float field.

    A block's values are finite exactly when its float fields are (every other field is
    a small integer, and the largest finite f16 times the largest quant stays far inside
    float32), so this checks a quantized weight without dequantizing it: the f16 scales
    and mins of the block types, the values themselves for F32, F16 and BF16. The
    engine's finite-weights check skips integer tensors, so kept blocks need this one.
    """
    layout = layout_of(qtype)
    if raw.dtype != torch.uint8 or raw.numel() % layout.block_bytes:
        raise ValueError(
            f"{layout.qtype.name} bytes must be a uint8 tensor of whole "
            f"{layout.block_bytes}-byte blocks, not {raw.numel()} {raw.dtype}"
        )
    blocks = raw.reshape(-1, layout.block_bytes)
    if not layout.quantized:
        return int((~torch.isfinite(layout.decode(blocks))).sum())
    bad = torch.zeros(blocks.shape[0], dtype=torch.bool, device=blocks.device)
    for field in layout.fields:
        if field.holds.startswith("f16"):
            bad |= ~torch.isfinite(_f16(blocks, field.offset)).reshape(-1)
    return int(bad.sum())
