"""Read a GGUF file: its model shape, its tensors (dequantized, Hugging Face names), a cache.

GGUF is llama.cpp's format: its ``general.architecture`` says which model it
holds, and the architecture plugin that claims that value
(:class:`~pitstop.plugin_system.architecture.GGUFRules`, found through the registry) reads
the rest: the :class:`ModelConfig` from the metadata, each tensor's Hugging
Face name, and any fix-up of a tensor the converter rearranged. This module
knows no architecture: it asks, checks every tensor's name and shape against
the plugin's ``weight_shapes`` and its bytes against the file, dequantizes to
float32 and caches the result.

Every metadata field and tensor is checked before anything is allocated
(:func:`gguf_model_config`): a field the plugin does not implement, a count that
is zero or absurd, a shape that disagrees with the metadata or a byte range
outside the file is a :class:`ModelLoadError` naming it.

Dequantizing takes seconds, so :func:`load_gguf` keeps the result (one
safetensors file, the model config and the tokenizer) under
``${PITSTOP_CACHE_DIR:-~/.cache/pitstop}/gguf/<content hash>-v<version>/`` and
reads that next time; its size is logged when it is written, and
``pitstop cache list|clear`` shows and empties the cache.

``gguf`` is imported inside functions: a benchmark on dummy weights needs none of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.gguf_file import (
    GGUFModelFile,
    check_tensor_bytes,
    dequantize,
    require_gguf,
    tensor_shape,
)
from pitstop.loading.quantized import QuantizedWeight
from pitstop.plugin_system.architecture import Architecture

if TYPE_CHECKING:
    from pitstop.loading.checkpoint import ModelSource
    from pitstop.loading.tokenizer import Tokenizer
    from pitstop.plugin_system.plugin_manager import PluginManager

log = logging.getLogger(__name__)

# Bump when the cache layout or the conversion changes: old entries are then ignored.
CACHE_VERSION = 2


def gguf_architecture(file: GGUFModelFile, plugins: PluginManager | None = None) -> Architecture:
    """The registered architecture that claims the file's ``general.architecture``; an
    unclaimed one is a ModelLoadError naming what the registered plugins claim."""
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    plugins = plugins or get_plugin_manager()
    found = plugins.architecture_for_gguf(file.architecture)
    if found is None:
        claims = dict(sorted(plugins.gguf_claims().items()))
        listed = f"{', '.join(claims)} ({', '.join(claims.values())})" if claims else "none"
        raise ModelLoadError(
            f"GGUF file {file.path} holds a model of architecture {file.architecture!r} "
            f"(general.architecture), which no registered model plugin reads; the registered "
            f"ones read {listed}: install the plugin of {file.architecture!r}, or load a "
            "Hugging Face checkpoint"
        )
    return found[1]


def gguf_model_config(
    file: GGUFModelFile, plugins: PluginManager | None = None
) -> tuple[ModelConfig, Architecture]:
    """The :class:`ModelConfig` of an open GGUF file and the architecture that read it.

    The plugin that claims the file checks every metadata field that shapes the
    model (present, a positive whole number below a bound, consistent with the
    others); then every tensor is checked here: its name maps to a Hugging Face one,
    its shape is what the metadata makes it, and its bytes lie inside the file
    without overlapping another tensor's. All of it before anything proportional to
    a claimed size is allocated.
    """
    rules = gguf_architecture(file, plugins)
    assert rules.gguf is not None  # architecture_for_gguf finds only those with rules
    config = rules.gguf.config(file)
    _check_tensors(file, config, rules)
    return config, rules


def _check_tensors(file: GGUFModelFile, config: ModelConfig, rules: Architecture) -> None:
    """Each tensor's name and shape against the config, its bytes against the file."""
    assert rules.gguf is not None
    expected = rules.weight_shapes(config)
    unknown, seen = [], set()
    for t in file.reader.tensors:
        if rules.gguf.config_tensor(t.name):
            continue
        name = rules.gguf.tensor_name(t.name)
        if name is None or name not in expected:
            unknown.append(t.name)
            continue
        seen.add(name)
        shape = tensor_shape(t)
        if shape != expected[name]:
            raise ModelLoadError(
                f"GGUF file {file.path}: tensor {t.name} has shape {list(shape)}, but the "
                f"metadata (embedding_length={config.hidden_size}, feed_forward_length="
                f"{config.intermediate_size}, head counts {config.num_heads}/{config.num_kv_heads} "
                f"of {config.head_size}, {config.vocab_size} tokens) makes it {list(expected[name])}"
            )
    if unknown:
        raise ModelLoadError(
            f"GGUF file {file.path} has {len(unknown)} tensor(s) that map to nothing pitstop runs "
            f"(or that the other layers lack), e.g. {unknown[:5]}; it refuses rather than skips them"
        )
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ModelLoadError(
            f"GGUF file {file.path} lacks {len(missing)} tensor(s) a {config.architecture} needs, "
            f"e.g. {missing[:3]}; the file is incomplete"
        )
    check_tensor_bytes(file.reader, file.reader.tensors, file.path)


def iter_gguf_tensors(
    file: GGUFModelFile, config: ModelConfig, rules: Architecture, *, blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every weight of an open GGUF file: Hugging Face name, float32, HF shape, on CPU.

    With ``blocks``, each 2-D block-quantized tensor comes as a :class:`QuantizedWeight`
    instead (its bytes copied out of the file's map, its rows reordered as the
    architecture's ``fix_rows`` says; see :func:`gguf_blocks`). The file must have passed
    :func:`gguf_model_config` (every name maps, every shape fits).
    """
    assert rules.gguf is not None
    for t in file.reader.tensors:
        if rules.gguf.config_tensor(t.name):  # part of the config, not a weight
            continue
        name = rules.gguf.tensor_name(t.name)
        if name is None:  # refused by _check_tensors; never reached for a checked file
            raise ModelLoadError(f"GGUF file {file.path}: tensor {t.name} maps to nothing")
        kept = gguf_blocks(t, name, config, rules) if blocks else None
        if kept is not None:
            yield name, kept
            continue
        stored = dequantize(t)
        w = rules.gguf.fix_tensor(name, stored, config)
        if getattr(w, "shape", None) != stored.shape:
            raise ModelLoadError(
                f"GGUF file {file.path}: the {config.architecture} plugin's fix_tensor turned "
                f"{t.name} of shape {list(stored.shape)} into {getattr(w, 'shape', type(w))}; "
                "it must keep the shape (the tensors were checked in it)"
            )
        yield name, torch.from_numpy(np.ascontiguousarray(w).copy())


def gguf_blocks(
    tensor: Any, name: str, config: ModelConfig, rules: Architecture
) -> QuantizedWeight | None:
    """A 2-D block-quantized GGUF tensor as a :class:`QuantizedWeight` in the model's row
    order; None for one that comes dense (a float type, a vector, or an architecture whose
    ``fix_tensor`` is not declared a row permutation by ``fix_rows``)."""
    assert rules.gguf is not None
    gguf = require_gguf()
    shape = tensor_shape(tensor)
    block, _ = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    if len(shape) != 2 or block == 1:
        return None
    if not rules.gguf.blocks_keep_values:
        return None  # a fix_tensor that may change values: only the dequantized tensor is safe
    fix_rows = rules.gguf.fix_rows
    data = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(shape[0], -1)
    weight = QuantizedWeight.of(torch.from_numpy(data.copy()), tensor.tensor_type.name, shape)
    order = None if fix_rows is None else fix_rows(name, shape[0], config)
    if order is None:
        return weight
    if sorted(int(i) for i in order) != list(range(shape[0])):
        raise ModelLoadError(
            f"the {config.architecture} plugin's fix_rows gave {name} a row order that is not a "
            f"permutation of its {shape[0]} rows"
        )
    return weight.take_rows(order)


# ---------------------------------------------------------------------- cache
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


def _config_to_json(config: ModelConfig) -> str:
    data = attrs.asdict(config)
    data["eos_token_ids"] = list(config.eos_token_ids)
    if config.rope_freq_factors is not None:
        data["rope_freq_factors"] = list(config.rope_freq_factors)
    return json.dumps(data, indent=2)


def _config_from_json(text: str) -> ModelConfig:
    data = json.loads(text)
    data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
    if data.get("rope_freq_factors") is not None:
        data["rope_freq_factors"] = tuple(data["rope_freq_factors"])
    return ModelConfig(**data)


def _folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _write_cache(
    target: Path,
    config: ModelConfig,
    file: GGUFModelFile,
    rules: Architecture,
    tokenizer: Tokenizer,
) -> None:
    """Convert into a temporary folder next to ``target``, then rename it into place
    (atomic: a reader never sees half a cache; a concurrent writer's copy wins or loses whole)."""
    from safetensors.torch import save_file

    source = file.path
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tensors = dict(iter_gguf_tensors(file, config, rules))
        save_file(tensors, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        del tensors
        tokenizer.save(tmp)
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
            if not (target / _CONFIG_FILE).is_file():
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


def _iter_cached(file: Path, shard: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    from pitstop.loading.checkpoint import iter_safetensors, read_safetensors_headers

    return iter_safetensors(read_safetensors_headers([file]), shard)


def load_gguf(
    path: str | Path, *, tokenizer: Tokenizer | None = None, plugins: PluginManager | None = None
) -> ModelSource:
    """A :class:`ModelSource` for a GGUF file, checked; its dense weights converted once and cached.

    ``tokenizer`` replaces the file's own tokenizer when given; ``plugins`` is the
    registry asked which architecture reads the file (default: the process's own).
    The source's ``weights()`` reads the dequantized cache, writing it on its first call
    (so a model loaded with ``weights=gguf`` never writes one); ``weights(blocks=True)``
    reads the file itself, its block-quantized matrices as
    :class:`~pitstop.loading.quantized.QuantizedWeight`.
    """
    from pitstop.loading.checkpoint import ModelSource, check_special_token_ids
    from pitstop.loading.tokenizer import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    cache = cache_dir_for(path)
    if (cache / _CONFIG_FILE).is_file():
        try:
            config = _config_from_json((cache / _CONFIG_FILE).read_text())
        except (OSError, ValueError, TypeError) as exc:
            raise ModelLoadError(
                f"the GGUF cache {cache} is damaged ({exc}); run `pitstop cache clear` and load "
                "again"
            ) from exc
        reading = GGUFConversion(path, cache, plugins)
        return ModelSource(
            model_config=config,
            tokenizer=tokenizer or Tokenizer.from_pretrained(cache),
            weights=reading.weights,
            description=f"GGUF {path} (cached at {cache})",
        )
    file = GGUFModelFile.open(path)
    config, rules = gguf_model_config(file, plugins)
    check_special_token_ids(config, f"GGUF file {path}")  # before the slow tokenizer build
    own_tokenizer = Tokenizer.from_gguf(path, file.metadata)
    conversion = GGUFConversion(path, cache, plugins, (file, config, rules, own_tokenizer))
    return ModelSource(
        model_config=config,
        tokenizer=tokenizer or own_tokenizer,
        weights=conversion.weights,
        description=f"GGUF {path} (dequantized into {cache} when first read)",
    )


@attrs.define
class GGUFConversion:
    """A GGUF model's weights: dequantized from the cache (written on the first read) or
    as the file's blocks. ``opened``: the file, config, architecture and tokenizer, when
    the loader has them (no cache yet); else they are read again when needed."""

    path: Path
    cache: Path
    plugins: PluginManager | None
    opened: tuple[GGUFModelFile, ModelConfig, Architecture, Tokenizer] | None = None

    def _open(self) -> tuple[GGUFModelFile, ModelConfig, Architecture]:
        if self.opened is not None:
            return self.opened[:3]
        file = GGUFModelFile.open(self.path)
        config, rules = gguf_model_config(file, self.plugins)
        return file, config, rules

    def _tokenizer(self, file: GGUFModelFile) -> Tokenizer:
        from pitstop.loading.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.path, file.metadata)

    def weights(
        self, shard: Any = None, *, blocks: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Every weight: dense (the cache), or with ``blocks`` the quantized matrices kept."""
        if blocks:
            if shard is not None:
                raise ModelLoadError(
                    "a GGUF file's quantized blocks are read whole; tensor parallelism takes "
                    "its dense weights (weights='dense')"
                )
            return iter_gguf_tensors(*self._open(), blocks=True)
        if not (self.cache / _CONFIG_FILE).is_file():
            file, config, rules = self._open()
            tokenizer = self.opened[3] if self.opened else self._tokenizer(file)
            try:
                _write_cache(self.cache, config, file, rules, tokenizer)
            except ModelLoadError:  # the file cannot be converted (an OSError too): no fallback
                raise
            except OSError as exc:  # the cache cannot be written: convert on every load instead
                log.warning(
                    "cannot cache GGUF file %s under %s (%s); converting on every load",
                    self.path,
                    self.cache,
                    exc,
                )
                tensors = iter_gguf_tensors(file, config, rules)
                return tensors if shard is None else shard.take_all(tensors)
        return _iter_cached(self.cache / _WEIGHTS_FILE, shard)


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


def _cmd_cache(args: Any) -> int:
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


def add_subcommand(sub: Any) -> None:
    """``pitstop cache list`` and ``pitstop cache clear [KEY...]``."""
    p = sub.add_parser("cache", help="list or clear the cache of converted GGUF files")
    cache_sub = p.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("list", help="every cached conversion: key, size, date, source file")
    clear = cache_sub.add_parser("clear", help="delete cached conversions (all unless keys given)")
    clear.add_argument("keys", nargs="*", help="keys from `pitstop cache list` (default: all)")
    p.set_defaults(func=_cmd_cache)
