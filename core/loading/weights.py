"""Where a model comes from: :func:`load_model_source` turns a model name into its
shape (:class:`ModelConfig`), its tokenizer and its weights.

The registered model sources (plugins of kind ``source``) are asked, in name order,
whether they claim the model string; the first that does loads it. The shipped ones:
``gguf`` reads llama.cpp's GGUF files and the shipped ``smollm2-135m``; ``huggingface``
reads checkpoint folders and ``org/name`` ids of the local Hugging Face cache, and is
asked after the others (it sets ``asked_last``: it claims any folder). The engine's own
``"dummy:<preset>"`` is random weights in the shape of a preset a model plugin registers
(:attr:`Architecture.presets <pitstop.plugin_system.architecture.Architecture>`).
"""

from __future__ import annotations

from pathlib import Path

from pitstop.errors import ModelLoadError
from pitstop.loading.checkpoint import ModelSource
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugin_system.plugin_manager import (
    ALLOW_LIST_VARIABLE,
    PluginManager,
    get_plugin_manager,
)
from pitstop.plugin_system.protocols import ModelSourceReader, ModelSourceReaderBase


def load_model_source(
    model: str, *, tokenizer: str | None = None, plugins: PluginManager | None = None
) -> ModelSource:
    """Resolve ``model``: a string a registered model source claims (``smollm2-135m``, a
    .gguf file, a checkpoint folder, an ``org/name`` id in the local Hugging Face cache),
    or ``dummy:<preset>``.

    ``tokenizer`` (a folder with ``tokenizer.json``, that file, or a file a model source
    reads, such as a .gguf) replaces the model's own tokenizer. Every failure is a
    :class:`ModelLoadError` that says what is wrong and how to fix it.
    """
    plugins = plugins or get_plugin_manager()
    sources = model_sources(plugins)
    tok = load_tokenizer(tokenizer, sources, plugins) if tokenizer else None
    last = [s for s in sources if _asked_last(s)]
    source = _claimant([s for s in sources if not _asked_last(s)], model)
    if source is None and model.startswith("dummy:"):
        return _dummy(model, tok, plugins)
    source = source or _claimant(last, model)
    if source is not None:
        return source.load(model, tok)
    path = Path(model).expanduser()
    if path.is_file():
        raise _not_a_model(model, "a file no registered model source reads", sources, plugins)
    if path.is_dir():
        raise _not_a_model(model, "a folder no registered model source reads", sources, plugins)
    raise _not_a_model(
        model, "neither a known name nor an existing file or folder", sources, plugins
    )


def model_sources(plugins: PluginManager) -> list[ModelSourceReader]:
    """Every registered model source, built, in the order they are asked: by name, those
    that are asked last (``asked_last``) after the others."""
    built = [plugins.create("source", name, plugins) for name in plugins.names("source")]
    return sorted(built, key=_asked_last)


def load_tokenizer(
    path: str, sources: list[ModelSourceReader], plugins: PluginManager | None = None
) -> Tokenizer:
    """The tokenizer at ``path``: that of the first model source that reads it (a .gguf
    file's own; ``huggingface``: a folder with ``tokenizer.json``, or that file)."""
    for source in sources:
        tok = source.read_tokenizer(path)
        if tok is not None:
            return tok
    narrowed = f" ({ALLOW_LIST_VARIABLE} is set)" if plugins and plugins.allow is not None else ""
    raise ModelLoadError(
        f"tokenizer {path!r} is read by no registered model source; pass a folder with "
        f"tokenizer.json or a file a model source reads{narrowed}"
    )


def _asked_last(source: ModelSourceReader) -> bool:
    return bool(ModelSourceReaderBase.of(source, "asked_last"))


def _claimant(sources: list[ModelSourceReader], model: str) -> ModelSourceReader | None:
    """The first source that claims ``model``, or None."""
    return next((s for s in sources if s.claims(model)), None)


def _not_a_model(
    model: str, what: str, sources: list[ModelSourceReader], plugins: PluginManager
) -> ModelLoadError:
    """The error for a model string nothing reads: what it is, and every kind that loads."""
    narrowed = f" ({ALLOW_LIST_VARIABLE} is set)" if plugins.allow is not None else ""
    return ModelLoadError(
        f"model {model!r} is {what}; pass {''.join(f'{s.accepts}, ' for s in sources)}"
        f"or 'dummy:<preset>' (presets: {', '.join(plugins.presets())}){narrowed}"
    )


def _dummy(model: str, tok: Tokenizer | None, plugins: PluginManager) -> ModelSource:
    """Random weights in the shape of the preset ``dummy:<name>`` names."""
    presets = plugins.presets()
    preset = model.removeprefix("dummy:")
    if preset not in presets:
        raise ModelLoadError(
            f"unknown preset {preset!r} in {model!r}; the registered model plugins give "
            f"presets {', '.join(presets) or '(none)'}"
        )
    return ModelSource(
        model_config=presets[preset],
        tokenizer=tok,
        weights=None,
        description=f"dummy (random) weights in the shape of {preset}",
    )
