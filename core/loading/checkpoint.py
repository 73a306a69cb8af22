"""A model ready to build (:class:`ModelSource`), the checks every source makes, and how
its weights reach the model (:func:`weight_stream`).

Every loader (a model source plugin, such as ``huggingface`` or ``gguf``, and
:mod:`pitstop.loading.weights` for dummy presets) returns a :class:`ModelSource`, whose
construction checks the model's special-token ids and its tokenizer against its vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
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
