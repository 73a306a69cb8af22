"""The GPU correctness matrix's models besides SmolLM2: their checkpoints, references and rows.

- ``qwen3-moe``: a random Qwen3-MoE checkpoint (seeded; 8 experts, top-2, a dense layer
  among the sparse ones, SmolLM2's vocabulary so the chat prompts' ids fit), against
  transformers' float32 greedy decoding of the same ids (issue 48);
- ``smollm2+lora``: the real SmolLM2 with a random PEFT LoRA adapter (seeded, rank 8, every
  projection) on every other prompt, against PEFT's ``merge_and_unload()`` model on those
  prompts and transformers' base model on the others (issue 47); also with ``fused.layer``,
  the adapter's deltas inside the layer's GEMMs.

Each is built once, in the matrix's own process, before its rows start.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

try:
    from helpers.checkpoints import save_random_lora
    from helpers.models import make_tiny_checkpoint
except ImportError:  # run as a script: tests/helpers itself is on sys.path
    from checkpoints import save_random_lora
    from models import make_tiny_checkpoint

MOE_KERNELS = ("reference", "fused")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@attrs.frozen
class ModelUnderTest:
    """What a row runs (a path the engine loads, the adapter it applies) and what it must give."""

    path: str
    reference: list[list[int]]  # greedy tokens per prompt
    margins: list[list[float]]  # the top-2 logit margin at each of those tokens
    lora_path: str | None = None  # an adapter for the even prompts


def model_rows() -> list[dict[str, Any]]:
    """The rows of the other models: each under the paged and prefix allocators, the chunked
    scheduler with a 64-token budget (chunks beside decodes), both kernel sets."""
    rows = []
    for model, allocator, kernels in itertools.product(
        ("qwen3-moe", "smollm2+lora"), ("paged", "prefix"), MOE_KERNELS
    ):
        settings: dict[str, Any] = {
            "allocator": allocator,
            "scheduler": "chunked",
            "kernels": kernels,
            "chunk_size": 64,
        }
        if model == "smollm2+lora":
            settings |= {"enable_lora": True, "max_lora_rank": 8}
        rows.append(
            {"name": f"{model}/{allocator}/chunked/{kernels}", "model": model, "settings": settings}
        )
    # the adapter's deltas inside fused.layer's GEMMs (steps up to 64 rows) and after cuBLAS
    for allocator in ("paged", "prefix"):
        settings = {
            "allocator": allocator,
            "scheduler": "chunked",
            "kernels": "fused",
            "chunk_size": 64,
            "enable_lora": True,
            "max_lora_rank": 8,
            "options": {"fused.layer": True},
        }
        name = f"smollm2+lora/{allocator}/chunked/fused+layer"
        rows.append({"name": name, "model": "smollm2+lora", "settings": settings})
    return rows


def build_model(
    key: str,
    gguf: Path,
    prompt_ids: list[list[int]],
    base_reference: list[list[int]],
    base_margins: list[list[float]],
    workdir: Path,
    device: str,
    greedy_reference: Callable[[Any, list[list[int]]], tuple[list[list[int]], list[list[float]]]],
) -> ModelUnderTest:
    """Write ``key``'s checkpoint (or adapter) under ``workdir`` and compute its reference with
    ``greedy_reference(model, prompt_ids) -> (tokens, margins)`` (the matrix's)."""
    import torch

    if key == "qwen3-moe":
        folder = make_tiny_checkpoint(
            workdir,
            "qwen3_moe",
            seed=48,
            with_tokenizer=False,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=3,
            mlp_only_layers=[0],
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        tokens, margins = greedy_reference(model.to(device).eval(), prompt_ids)
        return ModelUnderTest(str(folder), tokens, margins)
    if key == "smollm2+lora":
        import peft
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        folder = save_random_lora(
            base, workdir / "smollm2-lora", rank=8, alpha=16, targets=LORA_TARGETS, seed=47,
            b_scale=1,
        )  # fmt: skip
        merged = peft.PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
        merged = merged.to(device).eval()
        even = prompt_ids[0::2]
        tokens, margins = greedy_reference(merged, even)
        changed = sum(t != base_reference[2 * i] for i, t in enumerate(tokens))
        if not changed:  # the rows would pass without the adapter applied: worthless
            raise RuntimeError("the random adapter changes no prompt's greedy tokens")
        reference = [
            tokens[i // 2] if i % 2 == 0 else base_reference[i] for i in range(len(prompt_ids))
        ]
        gaps = [margins[i // 2] if i % 2 == 0 else base_margins[i] for i in range(len(prompt_ids))]
        return ModelUnderTest(str(gguf), reference, gaps, lora_path=str(folder))
    raise ValueError(f"no matrix model {key!r}: qwen3-moe or smollm2+lora")
