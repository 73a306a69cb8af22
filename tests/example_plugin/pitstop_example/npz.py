"""A tiny third-party model source: ``npz``, a bigram model saved with ``numpy.savez``.

It claims a model string that is an existing ``*.npz`` file holding two arrays of one
shape ``[V, H]``, ``embed`` and ``head``, and loads it as a
:class:`~pitstop_example.bigram.BigramForCausalLM` (``LLM("model.npz")``): the config from
the arrays' shape, the weights under the Hugging Face names the model loads, the
tokenizer the user gives (``tokenizer=``) or none (prompts as token ids).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pitstop.errors import ModelLoadError
from pitstop.loading.checkpoint import ModelSource
from pitstop.plugin_system.protocols import ModelSourceReaderBase
from pitstop_example import bigram

ARRAYS = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight"}


class NpzSource(ModelSourceReaderBase):
    """Bigram models saved as ``.npz`` files (``embed`` and ``head``, both ``[V, H]``)."""

    accepts = "a bigram .npz file"

    def claims(self, model: str) -> bool:
        """An existing file named ``*.npz``."""
        path = Path(model)
        return path.suffix == ".npz" and path.is_file()

    def load(self, model: str, tokenizer: Any) -> ModelSource:
        """The bigram model of the file; a missing array or a shape that disagrees is an error."""
        with np.load(model) as arrays:
            found = {name: np.asarray(arrays[name], dtype=np.float32) for name in arrays.files}
        shapes = {name: found[name].shape if name in found else None for name in ARRAYS}
        embed = shapes["embed"]
        if embed is None or len(embed) != 2 or set(shapes.values()) != {embed}:
            raise ModelLoadError(
                f"{model} must hold arrays embed and head of one shape [V, H], got {shapes}"
            )
        config = bigram._bigram_config(embed[0], embed[1], 4096, ())

        def weights(shard: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
            pairs = ((hf_name, torch.from_numpy(found[name])) for name, hf_name in ARRAYS.items())
            return pairs if shard is None else shard.take_all(pairs)  # a rank's part of each

        return ModelSource(config, tokenizer, weights, f"bigram arrays {model}")


def make_npz_source(plugins: Any) -> NpzSource:
    """Bigram models saved with numpy.savez (embed and head arrays)."""
    del plugins  # it reads one architecture, its own
    return NpzSource()
