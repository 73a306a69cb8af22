"""Issue 32: a checkpoint with NaN or infinite weights is refused at load (check_weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from pitstop.config import EngineConfig
from pitstop.entrypoints.engine_args import engine_config
from pitstop.errors import ModelLoadError
from pitstop.loading.finite_weights import check_finite, finite_weights
from pitstop.loop.engine import LLMEngine


def _config(folder: Path, **kw: object) -> EngineConfig:
    return engine_config(
        model=str(folder), device="cpu", dtype="float32", kv_cache_gib=0.02, max_model_len=64, **kw
    )


def _spoil(folder: Path, name: str, value: float, count: int) -> None:
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    flat = tensors[name].view(-1)
    flat[:count] = value
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(("value", "word"), [(float("nan"), "3 NaN"), (float("inf"), "3 infinite")])
def test_a_checkpoint_with_non_finite_weights_is_refused(
    tmp_path: Path, value: float, word: str
) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama", with_tokenizer=False)
    name = "model.layers.1.mlp.down_proj.weight"
    _spoil(folder, name, value, 3)
    with pytest.raises(ModelLoadError, match=name) as err:
        LLMEngine(_config(folder))
    assert word in str(err.value) and "check_weights=false" in str(err.value)
    LLMEngine(_config(folder, check_weights=False))  # the documented way round it


def test_finite_tensors_pass_unchanged() -> None:
    pairs = [("a", torch.randn(4, 4)), ("b", torch.arange(5)), ("c", torch.randn(3).half())]
    assert list(finite_weights(pairs)) == pairs
    check_finite("empty", torch.empty(0))
    with pytest.raises(ModelLoadError, match="'m'"):
        check_finite("m", torch.tensor([1.0, -float("inf")], dtype=torch.bfloat16))
