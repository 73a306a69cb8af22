"""Where a model comes from: :func:`load_model_source` turns a model name into its
shape (:class:`ModelConfig`), its tokenizer and its weights.

The registered model sources (plugins of kind ``source``: ``gguf`` reads llama.cpp's
GGUF files and the shipped ``smollm2-135m``) are asked first, in name order, whether they
claim the model string; the first that does loads it. When none does, the model is one of
the engine's own:

- a Hugging Face checkpoint folder (``config.json``, ``*.safetensors``, ``tokenizer.json``);
- a Hugging Face model id ``org/name``, resolved from the local Hugging Face cache only
  (pitstop never downloads): its snapshot is a checkpoint folder, or holds one file a
  model source claims;
- ``"dummy:<preset>"``: random weights in the shape of a preset a model plugin registers
  (:attr:`Architecture.presets <pitstop.plugin_system.architecture.Architecture>`).

A checkpoint loads exactly or not at all: the architecture plugin its
``config.json`` names reads the config, deciding every field (implemented or
refused: :attr:`Architecture.config_from_hf <pitstop.plugin_system.architecture.Architecture>`);
every tensor's name, dtype, shape and byte range is checked against that
config (the plugin's ``weight_shapes``) before anything is allocated; a tensor
that maps to nothing is an error, not a skip. Every architecture, built-in or
third-party, is found the same way: through the plugin registry.

Weights are yielded lazily as ``(Hugging Face name, CPU tensor in the
checkpoint's dtype)``, read straight from the file into the tensor; the model
casts each one once, as it copies it into its parameter, so loading holds the
final weights plus one tensor. ``lm_head.weight`` is absent when the model ties
it to the embedding (unless the checkpoint carries it, then it must equal the
embedding).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.checkpoint import (  # noqa: F401  (the names this module has always offered)
    SAFETENSORS_DTYPES,
    ModelSource,
    SafetensorsEntry,
    WeightsFn,
    iter_safetensors,
    read_safetensors_header,
    read_safetensors_headers,
)
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugin_system.plugin_manager import (
    ALLOW_LIST_VARIABLE,
    PluginManager,
    get_plugin_manager,
)
from pitstop.plugin_system.protocols import ModelSourceReader

# A Hugging Face repository id: "org/name" (letters, digits, '-', '_', '.').
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def load_model_source(
    model: str, *, tokenizer: str | None = None, plugins: PluginManager | None = None
) -> ModelSource:
    """Resolve ``model``: a string a registered model source claims (``smollm2-135m``, a
    .gguf file), else a checkpoint folder, an ``org/name`` id in the local Hugging Face
    cache, or ``dummy:<preset>``.

    ``tokenizer`` (a folder with ``tokenizer.json``, that file, or a file a model source
    reads, such as a .gguf) replaces the model's own tokenizer. Every failure is a
    :class:`ModelLoadError` that says what is wrong and how to fix it.
    """
    plugins = plugins or get_plugin_manager()
    sources = model_sources(plugins)
    tok = load_tokenizer(tokenizer, sources) if tokenizer else None
    source = _claimant(sources, model)
    if source is not None:
        return source.load(model, tok)
    if model.startswith("dummy:"):
        return _dummy(model, tok, plugins)
    path = Path(model).expanduser()
    if path.is_dir():
        return load_hf_checkpoint(path, tok, plugins)
    if path.is_file():
        raise _not_a_model(model, "a file no registered model source reads", sources, plugins)
    if _REPO_ID.match(model):
        return _load_snapshot(model, resolve_hub_model(model), tok, plugins, sources)
    raise _not_a_model(
        model, "neither a known name nor an existing file or folder", sources, plugins
    )


def model_sources(plugins: PluginManager) -> list[ModelSourceReader]:
    """Every registered model source, built, in the order they are asked: by name."""
    return [plugins.create("source", name, plugins) for name in plugins.names("source")]


def load_tokenizer(path: str, sources: list[ModelSourceReader]) -> Tokenizer:
    """The tokenizer at ``path``: the first model source that reads it (a .gguf file's
    own), else a folder with ``tokenizer.json`` or that file."""
    for source in sources:
        tok = source.read_tokenizer(path)
        if tok is not None:
            return tok
    return Tokenizer.from_pretrained(path)


def _claimant(sources: list[ModelSourceReader], model: str) -> ModelSourceReader | None:
    """The first source that claims ``model``, or None."""
    return next((s for s in sources if s.claims(model)), None)


def _not_a_model(
    model: str, what: str, sources: list[ModelSourceReader], plugins: PluginManager
) -> ModelLoadError:
    """The error for a model string nothing reads: what it is, and every kind that loads."""
    narrowed = f" ({ALLOW_LIST_VARIABLE} is set)" if plugins.allow is not None else ""
    return ModelLoadError(
        f"model {model!r} is {what}; pass {''.join(f'{s.accepts}, ' for s in sources)}a "
        "Hugging Face checkpoint folder, an 'org/name' id in the local Hugging Face cache, "
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


# ---------------------------------------------------------------------- the HF cache
def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (as huggingface_hub
    does: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def resolve_hub_model(repo_id: str) -> Path:
    """The local snapshot folder of ``repo_id`` (``org/name``) in the Hugging Face cache.

    Resolution is offline (``local_files_only``), so ``HF_HUB_OFFLINE`` always holds:
    pitstop never downloads. A model that is not in the cache is a
    :class:`ModelLoadError` naming the cache folder and how to fill it.
    """
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # a dependency of transformers: normally present
        raise ModelLoadError(
            f"resolving the model id {repo_id!r} needs huggingface_hub: pip install huggingface_hub"
        ) from exc
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except (OSError, ValueError) as exc:  # LocalEntryNotFoundError is an OSError
        raise ModelLoadError(
            f"model {repo_id!r} is not in the local Hugging Face cache {cache}, nor a file or "
            f"folder here (pitstop resolves ids offline and never downloads); download it where "
            f"the Hub is reachable "
            f"(`hf download {repo_id}`) into that cache, point HF_HUB_CACHE or HF_HOME at the "
            "cache that holds it, or pass the checkpoint's folder"
        ) from exc
    if not folder.is_dir():
        raise ModelLoadError(
            f"the Hugging Face cache entry of {repo_id!r} ({folder}) is not a folder"
        )
    return folder


def _load_snapshot(
    repo_id: str,
    folder: Path,
    tok: Tokenizer | None,
    plugins: PluginManager,
    sources: list[ModelSourceReader],
) -> ModelSource:
    """A snapshot holds a checkpoint folder, or files a model source reads (one of them)."""
    if (folder / "config.json").is_file():
        return load_hf_checkpoint(folder, tok, plugins)
    files = sorted(f for f in folder.iterdir() if f.is_file())
    found = [(f, s) for f in files if (s := _claimant(sources, str(f))) is not None]
    if len(found) == 1:
        file, source = found[0]
        return source.load(str(file), tok)
    if found:
        raise ModelLoadError(
            f"the cached repository {repo_id!r} holds {len(found)} model files "
            f"({', '.join(f.name for f, _ in found)}); pass the path of one, e.g. {found[0][0]}"
        )
    accepted = "; ".join(s.accepts for s in sources) or "no registered model source"
    raise ModelLoadError(
        f"the cached repository {repo_id!r} ({folder}) has neither config.json nor a file "
        f"a model source reads ({accepted})"
    )


# ---------------------------------------------------------------------- HF folders
def load_hf_checkpoint(
    folder: str | Path, tok: Tokenizer | None = None, plugins: PluginManager | None = None
) -> ModelSource:
    """A Hugging Face checkpoint folder: ``config.json`` + ``*.safetensors`` (sharded or not).

    The config and every tensor header are checked here, before any weight is read.
    """
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"folder {folder} has no config.json; a Hugging Face checkpoint folder needs "
            "config.json and *.safetensors files"
        )
    config = read_hf_config(folder, plugins)

    files = _safetensors_files(folder)
    entries = read_safetensors_headers(files)
    check_checkpoint_tensors(entries, config, where=str(folder), plugins=plugins)
    if tok is None and (folder / "tokenizer.json").is_file():
        tok = Tokenizer.from_pretrained(folder)

    def weights(shard: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors(entries, shard)

    return ModelSource(
        model_config=config,
        tokenizer=tok,
        weights=weights,
        description=f"Hugging Face checkpoint {folder} ({len(files)} safetensors file(s))",
    )


def read_hf_config(folder: str | Path, plugins: PluginManager | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint folder's ``config.json``, read by the
    registered architecture it names (``architectures``, then ``model_type``: see
    :meth:`PluginManager.architecture_for_hf`); one no plugin reads is a ModelLoadError
    that lists what the registered plugins read."""
    folder = Path(folder)
    config_file = folder / "config.json"
    try:
        raw = json.loads(config_file.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_file}: {exc}; the file is corrupt") from exc
    auto_map = raw.get("auto_map")
    if auto_map:
        classes = sorted(map(str, auto_map)) if isinstance(auto_map, dict | list) else [auto_map]
        raise ModelLoadError(
            f"{config_file} has auto_map: the checkpoint needs its own Python code "
            f"({', '.join(map(str, classes))}), and pitstop does not run a "
            "checkpoint's code, whatever trust_remote_code says; use a checkpoint of an "
            "architecture a registered model plugin reads (pitstop plugins lists them), or "
            "install a model plugin for it"
        )
    plugins = plugins or get_plugin_manager()
    found = plugins.architecture_for_hf(raw)
    if found is None:
        model_types = plugins.hf_model_types()
        raise ModelLoadError(
            f"{config_file} describes model_type={raw.get('model_type')!r} (architectures="
            f"{raw.get('architectures')!r}), which no registered model plugin reads; the "
            f"registered ones read model_type {', '.join(sorted(model_types)) or '(none)'} "
            f"(architectures {', '.join(plugins.names('model'))}): install the plugin of this "
            "architecture"
        )
    return found[1].config_from_hf(raw, str(config_file))


def _safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those the index names when there is one, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc!r}; the file is corrupt") from exc
        files = [folder / n for n in names]
        absent = [str(n) for n, f in zip(names, files, strict=True) if not f.is_file()]
        if absent:
            raise ModelLoadError(
                f"{index} names weight files that are not in {folder}: {absent[:5]}; the download "
                "is incomplete"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in folder.glob("*.bin"))) or "none"
        raise ModelLoadError(
            f"folder {folder} has no *.safetensors weights (.bin files found: {found}); pitstop reads "
            "safetensors only: convert with transformers' save_pretrained(..., safe_serialization=True)"
        )
    return files


def check_checkpoint_tensors(
    entries: dict[str, SafetensorsEntry],
    config: ModelConfig,
    where: str,
    plugins: PluginManager | None = None,
) -> None:
    """Every tensor's name and shape against what a model of ``config`` holds (its
    architecture's ``weight_shapes``): unknown, missing and misshapen tensors are errors
    before anything is allocated."""
    rules = (plugins or get_plugin_manager()).architecture(config.architecture)
    ignored_checkpoint_tensor = rules.ignored_tensor
    expected = rules.weight_shapes(config)
    if config.tie_word_embeddings:
        expected.setdefault("lm_head.weight", (config.vocab_size, config.hidden_size))
    names = [n for n in entries if not ignored_checkpoint_tensor(n)]
    unknown = [n for n in names if n not in expected]
    if unknown:
        raise ModelLoadError(
            f"{where} has {len(unknown)} tensor(s) that map to nothing in a {config.architecture} "
            f"of this config, e.g. {unknown[:5]}; pitstop refuses rather than skips them (a "
            "skipped tensor changes the output)"
        )
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [n for n in expected if n not in entries and n not in optional]
    if missing:
        raise ModelLoadError(
            f"{where} lacks {len(missing)} tensor(s) a {config.architecture} of this config needs, "
            f"e.g. {missing[:3]}"
        )
    for name in names:
        shape = entries[name].shape
        if shape != expected[name]:
            raise ModelLoadError(
                f"{where}: tensor {name!r} has shape {shape}, but the config (hidden_size="
                f"{config.hidden_size}, intermediate_size={config.intermediate_size}, vocab_size="
                f"{config.vocab_size}, heads {config.num_heads}/{config.num_kv_heads} of "
                f"{config.head_size}) makes it {expected[name]}"
            )
