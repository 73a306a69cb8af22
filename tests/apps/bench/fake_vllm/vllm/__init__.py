"""A stand-in for vLLM in the CPU tests of ``--peer vllm``: the few names the peer uses.

``LLM(**kwargs)`` records its arguments (``$FAKE_VLLM_RECORD``) and, with
``$FAKE_VLLM_FAIL=load``, fails as a vLLM that cannot load the model does;
``generate`` returns exactly ``max_tokens`` token ids per prompt (and records the
``lora_request`` list it is given, as :mod:`vllm.lora.request`'s values). The server side
is :mod:`vllm.entrypoints.cli.main`. With ``profiler_config`` (vLLM's torch profiler),
``start_profile``/``stop_profile`` write a Chrome trace of made-up kernels per
generate call: one ``nvjet_gemm`` (100 µs) a step, one ``flash_fwd_prefill`` (50 µs)
per prompt, one ``paged_decode_attention`` (20 µs) per decode step.
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
        self._kwargs = kwargs
        if os.environ.get("FAKE_VLLM_FAIL") == "load":
            raise RuntimeError("fake vLLM: Engine core initialization failed")
        self.llm_engine = SimpleNamespace(vllm_config=f"FakeVllmConfig({sorted(kwargs)})")
        self._profile_dir = (kwargs.get("profiler_config") or {}).get("torch_profiler_dir")
        self._events: list[dict[str, Any]] | None = None
        self._traces = 0

    def start_profile(self) -> None:
        self._events = []

    def stop_profile(self) -> None:
        assert self._profile_dir and self._events is not None, "start_profile first"
        os.makedirs(self._profile_dir, exist_ok=True)
        self._traces += 1
        path = os.path.join(self._profile_dir, f"rank0.{self._traces}.pt.trace.json")
        with open(path, "w") as f:
            json.dump({"traceEvents": self._events}, f)
        self._events = None

    def _kernels(self, prompts: int, steps: int) -> None:
        if self._events is None:
            return
        ts = float(len(self._events))
        for name, dur, count in (
            ("nvjet_gemm", 100.0, steps),
            ("flash_fwd_prefill", 50.0, prompts),
            ("paged_decode_attention", 20.0, steps - 1),
        ):
            for _ in range(count):
                self._events.append(
                    {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
                )
                ts += dur

    def generate(
        self, prompts: list, params: list, use_tqdm: bool = True, lora_request: Any = None
    ) -> list:
        if os.environ.get("FAKE_VLLM_FAIL") == "crash":
            os._exit(9)  # a process that dies without a word (OOM-killed, segfault)
        _record(
            "generate",
            [[len(p["prompt_token_ids"]), s.kwargs] for p, s in zip(prompts, params, strict=True)],
        )
        if lora_request is not None:
            assert self._kwargs.get("enable_lora"), "a LoRA request to an engine without LoRA"
            _record("lora", [[r.lora_name, r.lora_int_id, r.lora_path] for r in lora_request])
        time.sleep(0.01)
        self._kernels(len(prompts), max(s.max_tokens for s in params))
        return [
            SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=[0] * s.max_tokens)], num_cached_tokens=0
            )
            for s in params
        ]
