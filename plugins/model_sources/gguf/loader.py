"""Read a GGUF file: its model shape, its tensors (dequantized, Hugging Face names).

GGUF is llama.cpp's format: its ``general.architecture`` says which model it
holds, and the architecture plugin that claims that value
(:class:`~pitstop.plugin_system.architecture.GGUFRules`, found through the registry) reads
the rest: the :class:`ModelConfig` from the metadata, each tensor's Hugging
Face name, and any fix-up of a tensor the converter rearranged. This module
knows no architecture: it asks, checks every tensor's name and shape against
the plugin's ``weight_shapes`` and its bytes against the file, and dequantizes to
float32.

Every metadata field and tensor is checked before anything is allocated
(:func:`gguf_model_config`): a field the plugin does not implement, a count that
is zero or absurd, a shape that disagrees with the metadata or a byte range
outside the file is a :class:`ModelLoadError` naming it.

Dequantizing takes seconds, so :func:`load_gguf` keeps the result in a cache
(:mod:`pitstop.plugins.model_sources.gguf.cache`) and reads that next time.

``gguf`` is imported inside functions: a benchmark on dummy weights needs none of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.checkpoint import ModelSource, check_special_token_ids
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugin_system.architecture import Architecture
from pitstop.plugin_system.plugin_manager import get_plugin_manager
from pitstop.plugins.model_sources.gguf.cache import (
    cache_dir_for,
    is_cached,
    iter_cached,
    read_cached_config,
    write_cache,
)
from pitstop.plugins.model_sources.gguf.file import (
    GGUFModelFile,
    check_tensor_bytes,
    dequantize,
    require_gguf,
    tensor_shape,
)
from pitstop.plugins.model_sources.gguf.quantized import QuantizedWeight
from pitstop.plugins.model_sources.gguf.tokenizer import gguf_tokenizer
from pitstop.plugins.model_sources.huggingface.tokenizer import load_hf_tokenizer

if TYPE_CHECKING:
    from pitstop.plugin_system.plugin_manager import PluginManager

log = logging.getLogger(__name__)


def gguf_architecture(file: GGUFModelFile, plugins: PluginManager | None = None) -> Architecture:
    """The registered architecture that claims the file's ``general.architecture``; an
    unclaimed one is a ModelLoadError naming what the registered plugins claim."""
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


# ---------------------------------------------------------------------- the source
def load_gguf(
    path: str | Path, *, tokenizer: Tokenizer | None = None, plugins: PluginManager | None = None
) -> ModelSource:
    """A :class:`ModelSource` for a GGUF file, checked; its dense weights converted once and cached.

    ``tokenizer`` replaces the file's own tokenizer when given; ``plugins`` is the
    registry asked which architecture reads the file (default: the process's own).
    The source's ``weights()`` reads the dequantized cache, writing it on its first call
    (so a model loaded with ``weights=gguf`` never writes one); ``weights(blocks=True)``
    reads the file itself, its block-quantized matrices as
    :class:`~pitstop.plugins.model_sources.gguf.quantized.QuantizedWeight`.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    cache = cache_dir_for(path)
    if is_cached(cache):
        config = read_cached_config(cache)
        reading = GGUFConversion(path, cache, plugins)
        return ModelSource(
            model_config=config,
            tokenizer=tokenizer or load_hf_tokenizer(cache),
            weights=reading.weights,
            description=f"GGUF {path} (cached at {cache})",
        )
    file = GGUFModelFile.open(path)
    config, rules = gguf_model_config(file, plugins)
    check_special_token_ids(config, f"GGUF file {path}")  # before the slow tokenizer build
    own_tokenizer = gguf_tokenizer(path, file.metadata)
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
        if not is_cached(self.cache):
            file, config, rules = self._open()
            tokenizer = self.opened[3] if self.opened else gguf_tokenizer(self.path, file.metadata)
            try:
                tensors = iter_gguf_tensors(file, config, rules)
                write_cache(self.cache, self.path, config, tensors, tokenizer)
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
        return iter_cached(self.cache, shard)
