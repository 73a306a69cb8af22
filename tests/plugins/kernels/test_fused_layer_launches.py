"""Launches per decoder layer of a decode step with the fused layer (issue 44's "at most six").

A tiny Qwen3 on the ``fused`` kernel set (Triton's interpreter on the CPU, compiled on a
GPU) decodes a batch; every launch inside a decoder layer is counted over whole decode
steps: each Triton kernel launch (``JITFunction[grid](...)``, patched at
``KernelInterface.__getitem__``) and each torch op that would launch a kernel (a
``TorchDispatchMode``: everything but views and allocations; ``mm``/``addmm_`` are the
cuBLAS GEMMs on a GPU). Counted per way the layer runs:

- Triton GEMMs (steps within ``fused.layer_rows``): six with the one-launch decode merge
  (QKV+norm, rotary+store+q/k norm, attention, O+residual, gate-up+norm+SiLU·mul,
  down+residual), seven with the separate merge kernel;
- cuBLAS (``fused.layer_rows = 0``): seven with the one-launch merge (QKV GEMM, rotary with
  the row scale, attention, O ``addmm_``, gate-up GEMM, SiLU·mul with the row scale, down
  ``addmm_``);
- the unfused layer, for comparison: nine with the one-launch merge.

The GPU profile of the captured graph (``benchmarks/kernel_profile.py``) is the measured
figure; this test keeps the structure from regressing on any machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from helpers.launches import KernelLaunches, count_triton_launches  # noqa: E402
from helpers.models import make_tiny_checkpoint  # noqa: E402

from pitstop import LLM, SamplingParams  # noqa: E402

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def count(monkeypatch: pytest.MonkeyPatch) -> KernelLaunches:
    """Launches inside decoder layers (``scope``, switched by the layers' hooks)."""
    counter = KernelLaunches()
    count_triton_launches(monkeypatch, counter, lambda kernel: counter.scope > 0)
    return counter


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("launches"), "qwen3")


def _per_layer(folder: Path, counter: KernelLaunches, options: dict[str, Any]) -> float:
    """Launches per layer and decode step: a batch of 4 prompts prefilled, then only decode
    steps counted (hooks on every layer switch the counting on)."""
    llm = LLM(
        str(folder),
        device=DEVICE,
        dtype="float32",
        kv_cache_gib=0.01,
        max_model_len=128,
        kernels="fused",
        enforce_eager=True,
        options={"fused.decode_merge": "last-program", **options},
    )
    model = llm.engine.runner.model
    decoding = {"on": False, "layer_calls": 0}

    def pre(module: Any, args: Any) -> None:
        if decoding["on"]:
            counter.scope += 1
            decoding["layer_calls"] += 1

    def post(module: Any, args: Any, out: Any) -> None:
        if decoding["on"]:
            counter.scope -= 1

    for layer in model.layers:
        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
    forward = llm.engine.runner.forward

    def counted_forward(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        decoding["on"] = all(len(i.token_ids) == 1 for i in inputs)
        try:
            return forward(inputs, *args, **kwargs)
        finally:
            decoding["on"] = False

    llm.engine.runner.forward = counted_forward
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 9, 3, 12)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with counter:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert decoding["layer_calls"] > 0, "no decode step was counted"
    return counter.total / decoding["layer_calls"]


@pytest.mark.parametrize(
    "options,launches",
    [
        ({"fused.layer": True}, 6),  # Triton GEMMs
        ({"fused.layer": True, "fused.layer_rows": 0}, 7),  # cuBLAS, the row scale deferred
        ({"fused.layer": False}, 9),  # the unfused layer
    ],
    ids=["triton", "cublas", "unfused"],
)
def test_launches_per_decode_layer(
    qwen3: Path, count: KernelLaunches, options: dict[str, Any], launches: int
) -> None:
    got = _per_layer(qwen3, count, options)
    detail = f"Triton {dict(count.triton)}, torch {dict(count.torch)}"
    assert got == launches, f"{got:g} launches a layer, not {launches}: {detail}"
