"""A Hugging Face folder's safetensors, for ``update_weights_from_disk``: every tensor's
name, shape and dtype from the headers first (so a batch is checked before any value is
read), then the tensors one at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pitstop.entrypoints.rollout.errors import WeightUpdateError
from pitstop.entrypoints.rollout.weight_update import TensorSpec

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a folder (those its index names, else every ``*.safetensors``),
    or the one file given."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise WeightUpdateError(f"{path} is neither a folder nor a safetensors file")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightUpdateError(f"cannot read {index}: {exc!r}") from exc
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(
            f"{path} has no *.safetensors file; save the weights with transformers' "
            "save_pretrained or safetensors.torch.save_file"
        )
    return files


def read_specs(files: list[Path]) -> list[tuple[Path, TensorSpec]]:
    """Every tensor's file and spec, read from the headers only."""
    from safetensors import safe_open

    out = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    part = f.get_slice(name)
                    dtype = _DTYPES.get(part.get_dtype())
                    if dtype is None:
                        raise WeightUpdateError(
                            f"{file.name}: tensor {name!r} has dtype {part.get_dtype()}; "
                            f"weight updates read {sorted(_DTYPES)}"
                        )
                    out.append((file, TensorSpec(name, tuple(part.get_shape()), dtype)))
        except (OSError, ValueError, RuntimeError) as exc:  # safetensors' SafetensorError
            raise WeightUpdateError(f"cannot read {file}: {exc}") from exc
    return out


def iter_tensors(specs: list[tuple[Path, TensorSpec]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``specs``, file by file, each read when the caller asks for it."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for file, spec in specs:
        by_file.setdefault(file, []).append(spec.name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)
