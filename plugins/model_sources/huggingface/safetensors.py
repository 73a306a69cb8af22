"""The safetensors reader: a checked header, and tensors read straight from the file.

Every field of a header (dtype, shape, byte range) is checked against the file's size
before anything is allocated, so a corrupt, truncated or hostile file is a
:class:`ModelLoadError`. The Hugging Face source reads its checkpoints through here, and
the ``gguf`` source its cache of converted files (a safetensors file).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from pitstop.errors import ModelLoadError

# dtypes pitstop reads; anything else (int8, fp8, ...) belongs to a quantized checkpoint
SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
_MAX_HEADER = 100 * 2**20  # the safetensors format's own limit


@attrs.frozen
class SafetensorsEntry:
    """One tensor of a safetensors file: where its bytes lie (absolute offsets) and what they are."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _corrupt(file: Path, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"cannot read weights file {file}: {why}; the file is corrupt or truncated"
    )


def _read_header_json(file: Path) -> tuple[dict[str, Any], int, int]:
    """A safetensors file's JSON header, where its data starts, and the file's size."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(file, f"it has {size} bytes, fewer than a header")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_HEADER):
                raise _corrupt(file, f"its header claims {n:,} bytes of {size:,}")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise _corrupt(file, str(exc)) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise _corrupt(file, f"its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _corrupt(file, "its header is not a JSON object")
    return header, 8 + n, size


def _header_entry(file: Path, name: str, info: Any, data_start: int, size: int) -> SafetensorsEntry:
    """One header entry as a :class:`SafetensorsEntry`, its dtype, shape and offsets checked."""
    try:
        dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (TypeError, KeyError, ValueError) as exc:
        raise _corrupt(file, f"tensor {name!r} has a malformed entry {info!r}") from exc
    if dtype_name not in SAFETENSORS_DTYPES:
        raise ModelLoadError(
            f"{file}: tensor {name!r} has dtype {dtype_name}; pitstop reads "
            f"{', '.join(SAFETENSORS_DTYPES)} checkpoints (a quantized checkpoint needs "
            "its own loader: use a GGUF file instead)"
        )
    ints = [*shape, begin, end] if isinstance(shape, list) else None
    if ints is None or not all(isinstance(x, int) and not isinstance(x, bool) for x in ints):
        raise _corrupt(file, f"tensor {name!r} has a malformed shape or offsets {info!r}")
    dtype = SAFETENSORS_DTYPES[dtype_name]
    numel = math.prod(shape)
    if min(ints, default=0) < 0 or begin > end or data_start + end > size:
        raise _corrupt(file, f"tensor {name!r} claims bytes {begin}..{end}, beyond the file's end")
    if end - begin != numel * dtype.itemsize:
        raise _corrupt(
            file,
            f"tensor {name!r} of shape {tuple(shape)} ({dtype_name}) needs "
            f"{numel * dtype.itemsize:,} bytes but claims {end - begin:,}",
        )
    return SafetensorsEntry(file, name, dtype, tuple(shape), data_start + begin, data_start + end)


def read_safetensors_header(file: Path) -> list[SafetensorsEntry]:
    """The tensors of one safetensors file, every field checked against the file's size:
    a corrupt, truncated or hostile header is a ModelLoadError before any allocation."""
    header, data_start, size = _read_header_json(file)
    entries = sorted(
        (
            _header_entry(file, name, info, data_start, size)
            for name, info in header.items()
            if name != "__metadata__"
        ),
        key=lambda e: e.start,
    )
    for a, b in zip(entries, entries[1:], strict=False):
        if b.start < a.end:
            raise _corrupt(file, f"tensors {a.name!r} and {b.name!r} overlap")
    return entries


def read_safetensors_headers(files: list[Path]) -> dict[str, SafetensorsEntry]:
    """Every tensor of a (sharded) checkpoint by name; a name in two files is an error."""
    entries: dict[str, SafetensorsEntry] = {}
    for file in files:
        for e in read_safetensors_header(file):
            if e.name in entries:
                raise ModelLoadError(
                    f"tensor {e.name!r} is in both {entries[e.name].file.name} and {file.name}"
                )
            entries[e.name] = e
    return entries


def iter_safetensors(
    entries: dict[str, SafetensorsEntry], shard: Any = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, read from its file straight into a CPU tensor of the file's dtype (no
    memory map, no intermediate copy), file by file in byte order; with a tensor-parallel
    ``shard``, only that rank's part of each (:meth:`WeightShard.read`)."""
    by_file: dict[Path, list[SafetensorsEntry]] = {}
    for e in entries.values():
        by_file.setdefault(e.file, []).append(e)
    for file, items in by_file.items():
        with open(file, "rb", buffering=0) as f:
            for e in sorted(items, key=lambda x: x.start):
                if shard is not None:
                    yield e.name, shard.read(f, e)
                    continue
                tensor = torch.empty(e.shape, dtype=e.dtype)
                _read_into(f, e, tensor)
                yield e.name, tensor
                del tensor  # the next tensor is allocated only once the caller dropped this one


def read_exactly(f: Any, view: memoryview, e: Any) -> None:
    """Fill ``view`` from ``f``'s position on; a file that ends first is a truncated ``e``
    (a tensor's entry in its file: its ``file`` and ``name``, such as a safetensors one)."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ModelLoadError(
                f"weights file {e.file} ended inside tensor {e.name!r}; the file is truncated"
            )
        done += n


def _read_into(f: Any, e: SafetensorsEntry, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return
    f.seek(e.start)
    read_exactly(f, memoryview(tensor.view(-1).view(torch.uint8).numpy()), e)
