"""vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``, as the fake's generate reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """The three fields the bench's peer passes."""

    lora_name: str
    lora_int_id: int
    lora_path: str
