"""vLLM's module path ``vllm.outputs``: ``from pitstop.outputs import RequestOutput, CompletionOutput``.

The classes live in :mod:`pitstop.requests.outputs`.
"""

from __future__ import annotations

from pitstop.requests.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]
