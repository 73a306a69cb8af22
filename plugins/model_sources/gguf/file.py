"""Open a GGUF file and read its metadata and tensors: the file format only, no model knowledge.

The model loader (:mod:`pitstop.plugins.model_sources.gguf.loader`), the architecture
plugins it hands the open file to (:class:`GGUFModelFile`) and the tokenizer
(:func:`pitstop.plugins.model_sources.gguf.tokenizer.gguf_tokenizer`) all read GGUF files
through here. ``gguf`` is imported inside functions: a benchmark on dummy weights
needs none of it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import positive_int

log = logging.getLogger(__name__)


def require_gguf() -> Any:
    """The ``gguf`` package, or a ModelLoadError that says how to install it."""
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError(
            "loading a GGUF file needs the 'gguf' package: pip install 'pitstop[gguf]' (or pip install gguf)"
        ) from exc
    return gguf


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path``; a missing, foreign or corrupt file is a ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); "
            "pass a .gguf file, a Hugging Face checkpoint folder, or a model name"
        )
    gguf = require_gguf()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError, ...
        raise ModelLoadError(
            f"GGUF file {path} is corrupt or truncated ({type(exc).__name__}: {exc}); download it again"
        ) from exc


def _field_value(field: Any) -> Any:
    if hasattr(field, "contents"):
        return field.contents()
    # older gguf: decode the first data part by hand
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8")
    return part.tolist()[0] if len(part) == 1 else part.tolist()


def read_gguf_metadata(source: str | Path | Any, *, with_arrays: bool = False) -> dict[str, Any]:
    """Metadata of a GGUF file (a path or an open reader). Large arrays (the
    vocabulary, merges, scores) are left out unless ``with_arrays``."""
    reader = open_gguf(source) if isinstance(source, str | Path) else source
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if not with_arrays and len(field.data) > 64:
            continue
        try:
            meta[key] = _field_value(field)
        except Exception:  # an odd field must not stop the load
            log.debug("skipping GGUF metadata field %s", key)
    return meta


def gguf_eos_token_ids(metadata: dict[str, Any]) -> list[int]:
    """The end-of-sequence ids a GGUF file's tokenizer declares (EOS, then end of turn)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = [int(metadata[key]) for key in keys if isinstance(metadata.get(key), int)]
    return list(dict.fromkeys(ids))


def tensor_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape, rows first (as torch and Hugging Face write it; GGUF lists
    the dimensions the other way round)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor's values as float32, in its rows-first shape (``gguf`` dequantizes)."""
    gguf = require_gguf()
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(tensor_shape(tensor))


def check_tensor_bytes(reader: Any, tensors: list[Any], path: Any) -> None:
    """Each tensor's byte count from its type and shape, inside the file, no two overlapping."""
    gguf = require_gguf()
    size = len(reader.data)
    spans = []
    for t in tensors:
        dims = [int(d) for d in t.shape.tolist()]
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        except KeyError:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {t.name} has type {t.tensor_type!r}, which gguf cannot dequantize"
            ) from None
        numel = math.prod(dims)
        if not dims or dims[0] % block:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {t.name} has rows of {dims[:1]} values, not a whole "
                f"number of {t.tensor_type.name} blocks of {block}"
            )
        n_bytes = numel // block * type_size
        if t.data_offset < 0 or t.data_offset + n_bytes > size or t.data.nbytes != n_bytes:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {t.name} claims bytes {t.data_offset:,}..."
                f"{t.data_offset + n_bytes:,}, beyond the file's {size:,}; the file is truncated"
            )
        spans.append((t.data_offset, t.data_offset + n_bytes, t.name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ModelLoadError(
                f"GGUF file {path}: tensors {a} and {b} overlap; the file is corrupt"
            )


@attrs.frozen
class GGUFModelFile:
    """An open GGUF file, as an architecture plugin's :class:`~pitstop.plugin_system.architecture.GGUFRules`
    read it to build a :class:`~pitstop.ground.model_config.ModelConfig`: its metadata, its
    tensors' names and shapes, and checked readers of both (errors name the file)."""

    path: Path
    reader: Any = attrs.field(repr=False)  # gguf.GGUFReader
    # scalar fields and short arrays (read_gguf_metadata); long arrays: array_length
    metadata: dict[str, Any] = attrs.field(repr=False)

    @classmethod
    def open(cls, path: str | Path) -> GGUFModelFile:
        """Open ``path`` (a missing, foreign or corrupt file is a ModelLoadError)."""
        reader = open_gguf(path)
        return cls(Path(path), reader, read_gguf_metadata(reader))

    @property
    def architecture(self) -> Any:
        """``general.architecture``: which model the file holds (None when absent)."""
        return self.metadata.get("general.architecture")

    @property
    def keys(self) -> list[str]:
        """Every metadata key of the file, long arrays included."""
        return [k for k in self.reader.fields if not k.startswith("GGUF.")]

    def array_length(self, key: str) -> int | None:
        """How many values the metadata array ``key`` holds (None when the file has no such key)."""
        field = self.reader.fields.get(key)
        return None if field is None else len(field.data)

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's GGUF name -> its shape, rows first."""
        return {t.name: tensor_shape(t) for t in self.reader.tensors}

    def count(self, key: str, limit: int, default: int | None = None) -> int:
        """The positive whole-number metadata field ``key`` (at most ``limit``), else a
        ModelLoadError naming it (``default`` when the file lacks it; none: it must be there)."""
        value = self.metadata.get(key, default)
        if value is None:
            raise ModelLoadError(
                f"GGUF file {self.path} lacks the metadata field {key}; the file is incomplete"
            )
        return positive_int(value, key, f"GGUF file {self.path}", limit)

    def number(self, key: str, default: float, low: float, high: float) -> float:
        """The metadata number ``key`` (``default`` when absent), strictly between ``low``
        and ``high``, else a ModelLoadError naming it."""
        value = self.metadata.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not low < value < high
        ):
            raise ModelLoadError(
                f"GGUF file {self.path}: {key}={value!r} is not a number between {low} and {high}"
            )
        return float(value)

    def read_tensor(self, name: str) -> np.ndarray:
        """The tensor ``name`` as float32, rows first, its bytes checked against the file
        first (for a tensor an architecture reads into its config rather than loads)."""
        tensor = next((t for t in self.reader.tensors if t.name == name), None)
        if tensor is None:
            raise ModelLoadError(f"GGUF file {self.path} has no tensor {name}")
        check_tensor_bytes(self.reader, [tensor], self.path)
        return dequantize(tensor)

    @property
    def bos_token_id(self) -> int | None:
        """The tokenizer's beginning-of-sequence id (``tokenizer.ggml.bos_token_id``)."""
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        return int(bos) if isinstance(bos, int) else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence ids (:func:`gguf_eos_token_ids`)."""
        return tuple(gguf_eos_token_ids(self.metadata))
