"""vLLM's module path ``vllm.lora.request``: ``from pitstop.lora.request import LoRARequest``.

The class, a request's value naming an adapter, lives with the entry points that take it
(:mod:`pitstop.entrypoints.lora_request`); the engine hands it to the adapter plugin as is.
"""

from __future__ import annotations

from pitstop.entrypoints.lora_request import LoRARequest

__all__ = ["LoRARequest"]
