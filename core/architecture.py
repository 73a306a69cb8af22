"""What the checkpoint loaders ask a model plugin: its config parsing, tensor names and rotary.

A model plugin registers its factory with an :class:`Architecture`,
``register("LlamaForCausalLM", make_llama, architecture=LLAMA)``. The
Hugging Face loader (:mod:`pitstop.weights`) asks the registry for the
architecture a ``config.json`` names: its :attr:`~Architecture.config_from_hf`
builds the :class:`ModelConfig`, :attr:`~Architecture.weight_shapes` says
which tensors a checkpoint must hold and in what shape, and the runner builds
the rotary tables with :attr:`~Architecture.rotary`. GGUF files stay the
Llama family's (llama.cpp's tensor names are its own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from pitstop.model_config import ModelConfig
from pitstop.protocols import RotaryCache


def _keep_every_tensor(name: str) -> bool:
    """No checkpoint tensor is skipped."""
    del name
    return False


@attrs.frozen
class Architecture:
    """A model architecture's loading rules (all but the factory, which builds the module)."""

    # (config.json as a dict, where it came from) -> ModelConfig; None: pitstop's built-in
    # reader of the Llama family's config fields (through transformers' config classes)
    config_from_hf: Callable[[Mapping[str, Any], str], ModelConfig] | None
    # ModelConfig -> {Hugging Face tensor name: shape} of every tensor a checkpoint holds
    weight_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    # (config, positions, device) -> the cos/sin tables the model's attention reads
    rotary: Callable[[ModelConfig, int, torch.device], RotaryCache]
    # a checkpoint tensor the model recomputes instead of loading (rotary inv_freq, ...)
    ignored_tensor: Callable[[str], bool] = _keep_every_tensor
    # config.json model_type values it reads (for error messages and the registry lookup)
    model_types: tuple[str, ...] = ()
