"""pitstop: an LLM inference engine in which every strategy is a plugin chosen by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pitstop.config import EngineConfig
from pitstop.entrypoints.inputs import TextPrompt, TokensPrompt
from pitstop.entrypoints.lora_request import LoRARequest
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.entrypoints.structured import StructuredOutputs
from pitstop.errors import (
    ConfigError,
    InvalidRequestError,
    ModelLoadError,
    PitstopError,
    PluginError,
)
from pitstop.plugin_system.hookspecs import hookimpl

__version__ = "0.1.0"


if TYPE_CHECKING:
    from pitstop.entrypoints.llm import LLM
    from pitstop.loop.engine import LLMEngine
    from pitstop.requests.outputs import RequestOutput


def __getattr__(name: str):
    # The engine pulls in torch and the model code; import it only when asked.
    if name == "LLM":
        from pitstop.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pitstop.loop.engine import LLMEngine

        return LLMEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from pitstop.requests import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'pitstop' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "LoRARequest",
    "ModelLoadError",
    "PitstopError",
    "PluginError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
    "TextPrompt",
    "TokensPrompt",
    "hookimpl",
]
