"""vLLM's module path ``vllm.inputs``: ``from pitstop.inputs import TextPrompt, TokensPrompt``.

The prompt forms live in :mod:`pitstop.entrypoints.inputs`; ``LLM.generate`` takes them.
"""

from __future__ import annotations

from pitstop.entrypoints.inputs import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
