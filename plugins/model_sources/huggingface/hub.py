"""Hugging Face model ids (``org/name``), resolved from the local Hugging Face cache only.

pitstop never downloads: a snapshot in the cache is a checkpoint folder
(:func:`~pitstop.plugins.model_sources.huggingface.checkpoint.load_hf_checkpoint`), or
holds one file another model source claims (a ``.gguf``), which that source loads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pitstop.errors import ModelLoadError
from pitstop.loading.checkpoint import ModelSource
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.plugin_system.protocols import ModelSourceReader
from pitstop.plugins.model_sources.huggingface.checkpoint import load_hf_checkpoint

# A Hugging Face repository id: "org/name" (letters, digits, '-', '_', '.').
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


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


def load_snapshot(
    repo_id: str,
    folder: Path,
    tok: Tokenizer | None,
    plugins: PluginManager,
    sources: list[ModelSourceReader],
) -> ModelSource:
    """A snapshot holds a checkpoint folder, or files a model source reads (one of them):
    ``sources`` are the other registered sources, in the order they are asked."""
    if (folder / "config.json").is_file():
        return load_hf_checkpoint(folder, tok, plugins)
    files = sorted(f for f in folder.iterdir() if f.is_file())
    found = [(f, s) for f in files if (s := _claimant(sources, f)) is not None]
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


def _claimant(sources: list[ModelSourceReader], file: Path) -> ModelSourceReader | None:
    """The first source that claims ``file``, or None."""
    return next((s for s in sources if s.claims(str(file))), None)
