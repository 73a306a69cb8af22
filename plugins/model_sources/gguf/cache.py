"""The cache of converted GGUF files, and ``pitstop cache list|clear``.

Dequantizing takes seconds, so the loader keeps the result of each file (one
safetensors file, the model config and the tokenizer) under
``${PITSTOP_CACHE_DIR:-~/.cache/pitstop}/gguf/<content hash>-v<version>/`` and reads that
next time; its size is logged when it is written, and ``pitstop cache list|clear``
(registered by :mod:`pitstop.plugins.model_sources.gguf.source`) shows and empties it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugins.model_sources.huggingface.safetensors import (
    iter_safetensors,
    read_safetensors_headers,
)
from pitstop.plugins.model_sources.huggingface.tokenizer import save_hf_tokenizer

log = logging.getLogger(__name__)

# Bump when the cache layout or the conversion changes: old entries are then ignored.
CACHE_VERSION = 2

# ---------------------------------------------------------------------- the folders
# Layout: ${PITSTOP_CACHE_DIR:-~/.cache/pitstop}/gguf/<sha256 of the file>-v<version>/ holds
# model.safetensors (float32), pitstop_config.json, the tokenizer and source.json;
# gguf/digests/ remembers each file's hash by (path, size, mtime) so it is computed once.
_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "pitstop_config.json"
_SOURCE_FILE = "source.json"
_DIGESTS = "digests"


def cache_root() -> Path:
    """The pitstop cache folder: ``$PITSTOP_CACHE_DIR``, else ``~/.cache/pitstop``."""
    return Path(os.environ.get("PITSTOP_CACHE_DIR") or Path.home() / ".cache" / "pitstop")


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's content, remembered per (path, size, mtime) under the cache."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
    memo = cache_root() / "gguf" / _DIGESTS / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    try:
        digest = memo.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            return digest
    except OSError:
        pass
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError as exc:  # an unwritable cache only costs hashing the file again next time
        log.info(
            "could not keep the hash of %s in %s (%s); it will be hashed again", path, memo, exc
        )
    return digest


def cache_dir_for(path: str | Path) -> Path:
    """Where the converted form of a GGUF file lives: keyed by its content (SHA-256), so
    two copies of one file share an entry and a changed file gets a new one."""
    return cache_root() / "gguf" / f"{file_sha256(path)[:32]}-v{CACHE_VERSION}"


def is_cached(folder: Path) -> bool:
    """Whether ``folder`` (:func:`cache_dir_for`) holds a finished conversion."""
    return (folder / _CONFIG_FILE).is_file()


def _config_to_json(config: ModelConfig) -> str:
    data = attrs.asdict(config)
    data["eos_token_ids"] = list(config.eos_token_ids)
    if config.rope_freq_factors is not None:
        data["rope_freq_factors"] = list(config.rope_freq_factors)
    return json.dumps(data, indent=2)


def read_cached_config(folder: Path) -> ModelConfig:
    """The model config a finished conversion in ``folder`` keeps; a damaged one is a
    ModelLoadError that says how to clear it."""
    try:
        data = json.loads((folder / _CONFIG_FILE).read_text())
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        if data.get("rope_freq_factors") is not None:
            data["rope_freq_factors"] = tuple(data["rope_freq_factors"])
        return ModelConfig(**data)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"the GGUF cache {folder} is damaged ({exc}); run `pitstop cache clear` and load again"
        ) from exc


def _folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def write_cache(
    target: Path,
    source: Path,
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    tokenizer: Tokenizer,
) -> None:
    """Write the conversion of the GGUF file ``source`` (its dequantized ``tensors``, its
    config and tokenizer) into a temporary folder next to ``target``, then rename it into
    place (atomic: a reader never sees half a cache; a concurrent writer's copy wins or
    loses whole)."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        weights = dict(tensors)
        save_file(weights, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        del weights
        save_hf_tokenizer(tokenizer, tmp)
        (tmp / _CONFIG_FILE).write_text(_config_to_json(config))
        record = {
            "source": str(source.resolve()),
            "sha256": file_sha256(source),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "cache_version": CACHE_VERSION,
        }
        (tmp / _SOURCE_FILE).write_text(json.dumps(record, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_cached(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
            return
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning(
        "converted %s once and cached its dequantized weights at %s: %s on disk "
        "(`pitstop cache list` shows the cache, `pitstop cache clear` empties it)",
        source.name,
        target,
        format_size(_folder_size(target)),
    )


def iter_cached(folder: Path, shard: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The dequantized weights of a finished conversion (a tensor-parallel ``shard``: that
    rank's part of each)."""
    return iter_safetensors(read_safetensors_headers([folder / _WEIGHTS_FILE]), shard)


# ---------------------------------------------------------------------- pitstop cache
@attrs.frozen
class CacheEntry:
    """One converted GGUF file in the cache."""

    key: str
    path: Path
    size_bytes: int
    source: str  # the GGUF file it was converted from ("?" when unknown)
    created: str
    current: bool  # False: written by another cache version, never read again


def cache_entries() -> list[CacheEntry]:
    """Every entry of the GGUF cache, newest first."""
    root = cache_root() / "gguf"
    if not root.is_dir():
        return []
    entries = []
    for folder in root.iterdir():
        if not folder.is_dir() or folder.name == _DIGESTS or folder.name.startswith("."):
            continue
        try:
            record = json.loads((folder / _SOURCE_FILE).read_text())
        except (OSError, ValueError):
            record = {}
        entries.append(
            CacheEntry(
                key=folder.name,
                path=folder,
                size_bytes=_folder_size(folder),
                source=str(record.get("source", "?")),
                created=str(record.get("created", "?")),
                current=folder.name.endswith(f"-v{CACHE_VERSION}") and bool(record),
            )
        )
    return sorted(entries, key=lambda e: e.created, reverse=True)


def clear_cache(keys: list[str] | None = None) -> tuple[int, int]:
    """Delete the given entries (every entry, unfinished conversions and the hash memo
    when ``keys`` is None); returns (entries removed, bytes freed)."""
    root = cache_root() / "gguf"
    if not root.is_dir():
        return 0, 0
    entries = {e.key: e for e in cache_entries()}
    if keys is not None:
        unknown = [k for k in keys if k not in entries]
        if unknown:
            raise ModelLoadError(
                f"no cache entry {unknown[0]!r}; `pitstop cache list` shows the keys"
            )
        doomed = [entries[k].path for k in keys]
    else:
        doomed = [p for p in root.iterdir() if p.is_dir()]
    count = sum(1 for p in doomed if p.name in entries)
    freed = sum(_folder_size(p) for p in doomed)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return count, freed


def format_size(n: int) -> str:
    """``517.3 MB``: bytes in decimal units, as ``du -h --si`` and file managers write them."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def run_cache_command(args: argparse.Namespace) -> int:
    """List or clear the cache of converted GGUF files."""
    if args.cache_command == "list":
        entries = cache_entries()
        print(
            f"GGUF cache at {cache_root() / 'gguf'}: {len(entries)} entries, "
            f"{format_size(sum(e.size_bytes for e in entries))}"
        )
        width = max((len(e.key) for e in entries), default=0)
        for e in entries:
            stale = "" if e.current else "  (stale: an older pitstop wrote it; clear it)"
            print(
                f"  {e.key:<{width}}  {format_size(e.size_bytes):>9}  {e.created:<24}  "
                f"{e.source}{stale}"
            )
        return 0
    count, freed = clear_cache(args.keys or None)
    print(f"removed {count} cache entries, {format_size(freed)}, from {cache_root() / 'gguf'}")
    return 0


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """``pitstop cache list`` and ``pitstop cache clear [KEY...]``: the subcommand's own
    subcommands."""
    cache_sub = parser.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("list", help="every cached conversion: key, size, date, source file")
    clear = cache_sub.add_parser("clear", help="delete cached conversions (all unless keys given)")
    clear.add_argument("keys", nargs="*", help="keys from `pitstop cache list` (default: all)")
