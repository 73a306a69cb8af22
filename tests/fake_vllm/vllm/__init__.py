"""A stand-in for vLLM in the CPU tests of ``--peer vllm``: the few names the peer uses.

``LLM(**kwargs)`` records its arguments (``$FAKE_VLLM_RECORD``) and, with
``$FAKE_VLLM_FAIL=load``, fails as a vLLM that cannot load the model does;
``generate`` returns exactly ``max_tokens`` token ids per prompt. The server side
is :mod:`vllm.entrypoints.cli.main`.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

__version__ = "0.24.0+fake"


class SamplingParams:
    """Keeps the keyword arguments it was given."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.max_tokens = kwargs["max_tokens"]


def _record(kind: str, value: Any) -> None:
    path = os.environ.get("FAKE_VLLM_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "value": value}) + "\n")


class LLM:
    """Records its arguments; generates ``max_tokens`` zeros per prompt."""

    def __init__(self, **kwargs: Any) -> None:
        _record("llm", kwargs)
        if os.environ.get("FAKE_VLLM_FAIL") == "load":
            raise RuntimeError("fake vLLM: Engine core initialization failed")
        self.llm_engine = SimpleNamespace(vllm_config=f"FakeVllmConfig({sorted(kwargs)})")

    def generate(self, prompts: list, params: list, use_tqdm: bool = True) -> list:
        if os.environ.get("FAKE_VLLM_FAIL") == "crash":
            os._exit(9)  # a process that dies without a word (OOM-killed, segfault)
        _record(
            "generate",
            [[len(p["prompt_token_ids"]), s.kwargs] for p, s in zip(prompts, params, strict=True)],
        )
        time.sleep(0.01)
        return [
            SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=[0] * s.max_tokens)], num_cached_tokens=0
            )
            for s in params
        ]
