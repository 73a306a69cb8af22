"""Random LoRA adapters for a benchmark (``pitstop bench --lora-adapters N``).

Issue 47's figures run dummy weights with random adapters of rank 16 on every projection
(q, k, v, o, gate, up, down of every layer); no adapter exists for a dummy model's shape,
so the bench writes them: PEFT's folder layout (``adapter_config.json`` and
``adapter_model.safetensors`` in Hugging Face names), which the ``lora`` adapter plugin
and vLLM's ``--enable-lora`` both read. Requests are given the adapters in turn (request
``k`` the ``k mod N``-th), so ``N = 1`` is "every request with one adapter" and ``N = 8``
"requests spread over 8 adapters".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def write_random_adapters(
    model_config: Any, count: int, rank: int, folder: Path, seed: int = 0
) -> list[Path]:
    """``count`` adapters of ``rank`` on every projection of ``model_config``'s layers,
    bf16, under ``folder/adapter-K``; their folders. A's rows are scaled by ``1/sqrt(in)``
    and B is small, so the adapted model's activations stay the size of the base model's."""
    from safetensors.torch import save_file

    from pitstop.plugins.adapters.lora.peft_adapter import expected_shapes

    shapes = expected_shapes(model_config)
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for k in range(count):
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(model_config.num_layers):
            for module in PROJECTIONS:
                out, inp = shapes[module]
                block = "self_attn" if module in ("q", "k", "v", "o") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}_proj"
                a = torch.randn(rank, inp, generator=gen) * inp**-0.5
                b = torch.randn(out, rank, generator=gen) * 0.01
                tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
        path = folder / f"adapter-{k}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "r": rank,
                    "lora_alpha": 2 * rank,
                    "target_modules": [f"{m}_proj" for m in PROJECTIONS],
                    "bias": "none",
                    "task_type": "CAUSAL_LM",
                }
            )
        )
        paths.append(path)
    return paths


def lora_requests(paths: list[Path]) -> list[Any]:
    """One vLLM-style ``LoRARequest`` per adapter folder (ids from 1)."""
    from pitstop.entrypoints.lora_request import LoRARequest

    return [LoRARequest(f"bench-{k}", k + 1, str(p)) for k, p in enumerate(paths)]


_WRITTEN: dict[tuple[int, int], list[Any]] = {}


def bench_adapters(run: Any, count: int) -> list[Any]:
    """``count`` random adapters for a bench run's model (rank ``--lora-rank``) as
    ``LoRARequest`` values, written once per (count, rank) into a temporary folder that lives as
    long as the process: pitstop's columns and the vLLM peer read the same files."""
    import sys
    import tempfile

    rank = int(getattr(run.args, "lora_rank", 16) or 16)
    key = (count, rank)
    if key not in _WRITTEN:
        folder = Path(tempfile.mkdtemp(prefix="pitstop-bench-lora-"))
        print(f"[bench] writing {count} random LoRA adapter(s) of rank {rank} to {folder}",
              file=sys.stderr)  # fmt: skip
        _WRITTEN[key] = lora_requests(write_random_adapters(run.model_config, count, rank, folder))
    return _WRITTEN[key]
