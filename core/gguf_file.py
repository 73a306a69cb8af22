"""Open a GGUF file and read its metadata: the file format only, no model knowledge.

The model loader (:mod:`pitstop.gguf_loader`) and the tokenizer
(:meth:`pitstop.tokenizer.Tokenizer.from_gguf`) both read GGUF files through
here. ``gguf`` is imported inside functions: a benchmark on dummy weights
needs none of it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pitstop.errors import ModelLoadError

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
