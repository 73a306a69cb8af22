"""The ``huggingface`` model source: checkpoint folders and the local Hugging Face cache.

Registered through the ``pitstop`` entry point ``model-sources-huggingface``, like any
other plugin. It claims a model string that is

- an existing folder: a Hugging Face checkpoint (``config.json``, ``*.safetensors``,
  ``tokenizer.json``; :mod:`~pitstop.plugins.model_sources.huggingface.checkpoint`);
- a Hugging Face model id ``org/name`` that is not a file here, resolved from the local
  Hugging Face cache only (pitstop never downloads): its snapshot is a checkpoint folder,
  or holds one file another source claims (:mod:`~pitstop.plugins.model_sources.huggingface.hub`).

It is asked after every other source (``asked_last``), since it claims any folder, and it
reads a ``tokenizer=`` folder with ``tokenizer.json`` (or that file).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pitstop.loading.checkpoint import ModelSource
from pitstop.loading.tokenizer import Tokenizer
from pitstop.loading.weights import model_sources
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.protocols import ModelSourceReaderBase
from pitstop.plugins.model_sources.huggingface.checkpoint import load_hf_checkpoint
from pitstop.plugins.model_sources.huggingface.hub import REPO_ID, load_snapshot, resolve_hub_model
from pitstop.plugins.model_sources.huggingface.tokenizer import load_hf_tokenizer

if TYPE_CHECKING:
    from pitstop.plugin_system.plugin_manager import PluginManager


class HuggingFaceSource(ModelSourceReaderBase):
    """Reads Hugging Face checkpoint folders, and ``org/name`` ids of the local cache."""

    accepts = "a Hugging Face checkpoint folder, an 'org/name' id in the local Hugging Face cache"
    asked_last = True  # it claims any folder: a source of a folder format of its own goes first

    def __init__(self, plugins: PluginManager) -> None:
        self.plugins = plugins

    def claims(self, model: str) -> bool:
        """An existing folder, or an ``org/name`` id that is not a file here."""
        path = Path(model).expanduser()
        return path.is_dir() or (not path.is_file() and REPO_ID.match(model) is not None)

    def load(self, model: str, tokenizer: Tokenizer | None) -> ModelSource:
        """The checked :class:`ModelSource` of the folder, or of the id's cached snapshot
        (``tokenizer`` replaces its own)."""
        path = Path(model).expanduser()
        if path.is_dir():
            return load_hf_checkpoint(path, tokenizer, self.plugins)
        others = [s for s in model_sources(self.plugins) if not isinstance(s, HuggingFaceSource)]
        return load_snapshot(model, resolve_hub_model(model), tokenizer, self.plugins, others)

    def read_tokenizer(self, path: str) -> Tokenizer:
        """The tokenizer of a folder with ``tokenizer.json`` or of that file; any other path
        is a ``ModelLoadError`` that says what to pass (asked last, it reads what no other
        source does)."""
        return load_hf_tokenizer(path)


def make_huggingface_source(plugins: PluginManager) -> HuggingFaceSource:
    """Hugging Face checkpoint folders and ``org/name`` ids of the local Hugging Face cache."""
    return HuggingFaceSource(plugins)


@hookimpl
def register_model_sources(register: Any) -> None:
    """Register the ``huggingface`` model source."""
    register("huggingface", make_huggingface_source)
