"""A model ready to build (:class:`ModelSource`), how its weights reach the model
(:func:`weight_stream`), and the safetensors reader.

Every loader (:mod:`pitstop.loading.weights` for Hugging Face folders, the hub cache
and dummy presets; a model source plugin, such as ``gguf``, for its own models)
returns a :class:`ModelSource` and reads safetensors files through here, so
no loader imports another to get them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from pitstop.errors import ConfigError, ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugin_system.protocols import KeepsBlocks, KeepsBlocksBase, ModelBase
from pitstop.plugin_system.registration import takes_keyword

# Called with no argument: every tensor whole; with ``shard=`` a tensor-parallel rank's weight
# cutter (:attr:`pitstop.runner.peers.RankParallel.shard`): only that rank's part of each tensor
# is read.
WeightsFn = Callable[..., Iterator[tuple[str, torch.Tensor]]]


@attrs.frozen
class ModelSource:
    """A model ready to build: its shape, tokenizer and a way to read its weights."""

    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None for dummy presets (unless a tokenizer was given)
    weights: WeightsFn | None  # each call starts a fresh pass; None => random weights
    description: str

    def __attrs_post_init__(self) -> None:
        check_vocabulary(self.model_config, self.tokenizer, self.description)

    @property
    def is_dummy(self) -> bool:
        return self.weights is None


def check_special_token_ids(config: ModelConfig, where: str) -> None:
    """Refuse a model whose BOS or EOS ids lie outside its vocabulary ``[0, vocab_size)``.

    Called by every loader as soon as the config is read (a model source's before it
    builds a slow tokenizer), so a bad id fails at once, not at the first request.
    """
    ids = {"bos_token_id": [] if config.bos_token_id is None else [config.bos_token_id]}
    ids["eos_token_id"] = list(config.eos_token_ids)
    for field, values in ids.items():
        bad = [i for i in values if isinstance(i, bool) or not isinstance(i, int)]
        bad += [i for i in values if isinstance(i, int) and not 0 <= i < config.vocab_size]
        if bad:
            raise ModelLoadError(
                f"{where}: {field} {bad[0]!r} is outside the vocabulary [0, {config.vocab_size}); "
                "the file is corrupt or its config belongs to another model: fix the id "
                "(or vocab_size) in the model's config"
            )


def check_vocabulary(config: ModelConfig, tokenizer: Tokenizer | None, where: str) -> None:
    """The model's special-token ids, and the tokenizer against the model's vocabulary.

    A tokenizer with more tokens than the embedding has rows (``vocab_size``) would
    encode text into ids the model cannot look up; its BOS/EOS ids must index the
    vocabulary too. A tokenizer smaller than the vocabulary is normal (padded
    embeddings). Raises :class:`ModelLoadError` naming both sizes and the fix.
    """
    check_special_token_ids(config, where)
    if tokenizer is None:
        return
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{where}: the tokenizer {tokenizer.name or ''} has {tokenizer.vocab_size:,} tokens but "
            f"the model's vocab_size is {config.vocab_size:,}, so text would encode into ids the "
            "embedding has no row for; use the model's own tokenizer (tokenizer=PATH) or fix "
            "vocab_size in its config"
        )
    special = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + list(
        tokenizer.eos_token_ids
    )
    bad = [i for i in special if not 0 <= i < config.vocab_size]
    if bad:
        raise ModelLoadError(
            f"{where}: the tokenizer's special token id {bad[0]} (BOS/EOS) is outside the "
            f"model's vocabulary [0, {config.vocab_size}); use the model's own tokenizer"
        )


# ---------------------------------------------------------------------- to the model
# (name, tensor), or (name, a weight in its checkpoint's blocks) for a KeepsBlocks format
WeightItem = tuple[str, Any]


def weight_stream(weights: WeightsFn | None, fmt: Any, model: Any) -> Iterator[WeightItem] | None:
    """The weights to load: with quantized blocks where the format keeps them, else dense.

    ``weights`` is a :class:`ModelSource`'s ``weights`` (None: dummy weights, returned as
    None). A format that keeps blocks (:class:`~pitstop.plugin_system.weight_format.KeepsBlocks`)
    needs a source that has them (its ``weights`` takes ``blocks=True``) and a model that
    loads them (``loads_quantized_weights``); anything else is a :class:`ConfigError`
    naming the fix.
    """
    if not isinstance(fmt, KeepsBlocks):
        return None if weights is None else weights()
    name = getattr(fmt, "name", type(fmt).__name__)
    if weights is None or not takes_keyword(weights, "blocks"):
        blocks_of = KeepsBlocksBase.of(fmt, "blocks_of")
        what = "dummy (random) weights" if weights is None else f"not {blocks_of}"
        raise ConfigError(
            f"weights={name!r} keeps {blocks_of}'s quantized blocks, but the model is {what}; "
            f"pass {KeepsBlocksBase.of(fmt, 'blocks_model')}, or use weights='dense' (or 'fp8')"
        )
    if not ModelBase.of(model, "loads_quantized_weights"):
        raise ConfigError(
            f"weights={name!r}: the {type(model).__name__} model plugin loads no quantized "
            "weights (it sets no loads_quantized_weights); use weights='dense'"
        )
    return offer_blocks(weights(blocks=True), fmt)


def offer_blocks(items: Iterable[WeightItem], fmt: Any) -> Iterator[WeightItem]:
    """``items`` with each weight in its blocks (anything but a tensor) that the format
    declines (``takes_blocks``) dequantized (its ``dequantize()``: float32)."""
    for name, item in items:
        if not isinstance(item, torch.Tensor) and not fmt.takes_blocks(name, item):
            item = item.dequantize()
        yield name, item


# ---------------------------------------------------------------------- safetensors
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


def _read_into(f: Any, e: SafetensorsEntry, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return
    f.seek(e.start)
    read_exactly(f, memoryview(tensor.view(-1).view(torch.uint8).numpy()), e)


def read_exactly(f: Any, view: memoryview, e: SafetensorsEntry) -> None:
    """Fill ``view`` from ``f``'s position on; a file that ends first is a truncated ``e``."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ModelLoadError(
                f"weights file {e.file} ended inside tensor {e.name!r}; the file is truncated"
            )
        done += n
