"""A Hugging Face checkpoint folder: ``config.json`` + ``*.safetensors`` (sharded or not).

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.checkpoint import ModelSource
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugin_system.plugin_manager import PluginManager, get_plugin_manager
from pitstop.plugins.model_sources.huggingface.safetensors import (
    SafetensorsEntry,
    iter_safetensors,
    read_safetensors_headers,
)
from pitstop.plugins.model_sources.huggingface.tokenizer import load_hf_tokenizer


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
        tok = load_hf_tokenizer(folder)

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
