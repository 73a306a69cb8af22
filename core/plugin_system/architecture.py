"""What the checkpoint loaders ask a model plugin: its config parsing, tensor names and rotary.

A model plugin registers its factory with an :class:`Architecture`,
``register("MyForCausalLM", make_my_model, architecture=MY_RULES)``. The
loaders treat every architecture alike, built-in or third-party:

- the ``huggingface`` model source (a plugin:
  :mod:`pitstop.plugins.model_sources.huggingface`) asks the registry which
  architecture a ``config.json`` names (``architectures``, then ``model_type``);
  its :attr:`~Architecture.config_from_hf` builds the :class:`ModelConfig`;
- the ``gguf`` model source (a plugin: :mod:`pitstop.plugins.model_sources.gguf`) asks
  which architecture claims the file's ``general.architecture``
  (:attr:`GGUFRules.architectures`); its :class:`GGUFRules` build the config from the
  file's metadata, rename each tensor to its Hugging Face name and fix up any the
  converter rearranged. The rules are declared here, with the architecture, so that a
  model plugin needs no source plugin to say how it reads GGUF files, and two claiming
  one value are refused when they register;
- both check every tensor against :attr:`~Architecture.weight_shapes`, and the
  runner builds the rotary tables with :attr:`~Architecture.rotary`;
- ``dummy:<preset>`` finds the architecture that gives that preset
  (:attr:`~Architecture.presets`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from pitstop.ground.model_config import ModelConfig
from pitstop.plugin_system.protocols import RotaryCache

if TYPE_CHECKING:
    import numpy as np


def _keep_every_tensor(name: str) -> bool:
    """No checkpoint tensor is skipped."""
    del name
    return False


def _unchanged(name: str, tensor: np.ndarray, config: ModelConfig) -> np.ndarray:
    """The tensor as the file stores it."""
    del name, config
    return tensor


# a rule that is not a function is refused when the Architecture is built, naming it
_callable = attrs.validators.is_callable()


def _non_empty(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or not all(isinstance(v, str) and v for v in value)
    ):
        raise ValueError(
            f"GGUFRules.{attribute.name} must be a tuple that names at least one "
            f"general.architecture value, got {value!r}"
        )


@attrs.frozen
class GGUFRules:
    """How an architecture reads a GGUF file (llama.cpp's format), whose tensors carry
    llama.cpp's names and whose shape lives in ``{general.architecture}.*`` metadata."""

    # the general.architecture values it reads (e.g. ("llama",)); one plugin claims each
    architectures: tuple[str, ...] = attrs.field(validator=_non_empty)
    # the open file (the gguf source's GGUFModelFile: metadata, tensor shapes, checked
    # readers) -> ModelConfig; checks every metadata field it reads and refuses those it
    # does not implement (the loader then checks every tensor against weight_shapes)
    config: Callable[[Any], ModelConfig] = attrs.field(validator=_callable)
    # GGUF tensor name -> Hugging Face name (a key of weight_shapes); None: maps to nothing
    tensor_name: Callable[[str], str | None] = attrs.field(validator=_callable)
    # a tensor read into the config instead of loaded as a weight (llama.cpp's rope_freqs)
    config_tensor: Callable[[str], bool] = attrs.field(
        default=_keep_every_tensor, validator=_callable
    )
    # (Hugging Face name, float32 array in that name's shape, config) -> the array the model
    # loads, same shape: undoes what the converter rearranged (llama.cpp permutes q/k rows)
    fix_tensor: Callable[[str, np.ndarray, ModelConfig], np.ndarray] = attrs.field(
        default=_unchanged, validator=_callable
    )
    # (Hugging Face name, its row count, config) -> the row order fix_tensor gives it (row i
    # of the result is row order[i] of the file), or None where fix_tensor keeps it as it is.
    # Declared by an architecture whose fix_tensor only reorders rows, so that a weight kept
    # in its quantized blocks (weights=gguf) is fixed without dequantizing; left None with a
    # fix_tensor of its own, every tensor is offered dequantized (the only safe form)
    fix_rows: Callable[[str, int, ModelConfig], np.ndarray | None] | None = attrs.field(
        default=None, validator=attrs.validators.optional(_callable)
    )

    @property
    def blocks_keep_values(self) -> bool:
        """Whether a tensor's quantized rows, reordered by :attr:`fix_rows`, hold what
        :attr:`fix_tensor` makes of it (no fix, or one declared a row permutation)."""
        return self.fix_rows is not None or self.fix_tensor is _unchanged


@attrs.frozen
class Architecture:
    """A model architecture's loading rules (all but the factory, which builds the module)."""

    # (config.json as a dict, where it came from) -> ModelConfig; every field decided
    # (read, known to have no effect, or refused with an error naming it)
    config_from_hf: Callable[[Mapping[str, Any], str], ModelConfig] = attrs.field(
        validator=_callable
    )
    # ModelConfig -> {Hugging Face tensor name: shape} of every tensor a checkpoint holds
    weight_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] = attrs.field(
        validator=_callable
    )
    # (config, positions, device) -> the cos/sin tables the model's attention reads
    rotary: Callable[[ModelConfig, int, torch.device], RotaryCache] = attrs.field(
        validator=_callable
    )
    # a checkpoint tensor the model recomputes instead of loading (rotary inv_freq, ...)
    ignored_tensor: Callable[[str], bool] = attrs.field(
        default=_keep_every_tensor, validator=_callable
    )
    # config.json model_type values it reads (for error messages and the registry lookup)
    model_types: tuple[str, ...] = attrs.field(
        default=(),
        validator=attrs.validators.deep_iterable(
            attrs.validators.instance_of(str), attrs.validators.instance_of(tuple)
        ),
    )
    # named shapes of it for ``dummy:<name>`` models (random weights, for benchmarks); each
    # one's architecture is the registered name, and a name only one plugin gives
    presets: Mapping[str, ModelConfig] = attrs.field(factory=dict)
    # how it reads GGUF files; None: it reads none (a GGUF of it is refused)
    gguf: GGUFRules | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(GGUFRules))
    )
