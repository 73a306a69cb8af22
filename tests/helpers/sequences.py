"""Sequences for the allocator tests: made from token ids, and counted as computed."""

from __future__ import annotations

from typing import Any

from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.requests.sequence import Sequence


def seq(tokens: list[int] | range, name: str = "r") -> Sequence:
    """A sequence of the prompt ``tokens`` (default sampling), request id ``name``."""
    return Sequence(
        request_id=name, prompt_token_ids=list(tokens), sampling_params=SamplingParams()
    )


def compute_all(allocator: Any, s: Sequence) -> None:
    """Count every token of ``s`` as computed and tell ``allocator`` (which caches full pages)."""
    s.num_computed_tokens = s.num_tokens
    allocator.on_tokens_computed(s)
