"""What a sampler is handed (one step's per-row settings as device tensors) and what it returns.

Built by :func:`pitstop.requests.sampling.make_step_inputs`; the sampler protocol
(:class:`pitstop.plugin_system.protocols.Sampler`) re-exports both.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen
class SamplingBatch:
    """Per-row sampling settings of one step's logits, as tensors on the device."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; -1 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    generators: list[torch.Generator | None]  # per-row seeded generator
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    want_logprobs: bool = False
    # The largest top_k over the rows, known on the host so that a sampler never reads it back
    # from the device (that read would stall the overlapped loop); -1: some row keeps every token.
    max_top_k: int = -1
    # logprobs=k: most alternatives any row asks for (0: the chosen only; -1: the whole vocabulary)
    max_logprobs: int = 0
    # Logits processors, applied before greedy/temperature (None: no row uses them).
    needs_penalties: bool = False
    presence_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    # Per step (pitstop.requests.sampling.make_step_inputs):
    history: torch.Tensor | None = None  # [B, L] int64 prompt + output ids, padded with V
    prompt_lens: torch.Tensor | None = None  # [B] int64: history[:, :len] is the prompt
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids masked this step
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 allowed tokens (grammar)
    allowed: torch.Tensor | None = None  # [B, V] bool: allowed_token_ids (True where allowed)
    # logits_processors: per row (row, callables, prompt ids, output ids), run on the host's
    # view of the step after every other processor (pitstop.plugins.samplers.processors)
    user_processors: tuple[tuple[int, tuple[Any, ...], tuple[int, ...], tuple[int, ...]], ...] = ()


@attrs.frozen
class SamplerOutput:
    """Sampled tokens (and their log-probabilities when asked)."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, of the chosen tokens
    top_ids: torch.Tensor | None = None  # [B, K] int64: the K most likely tokens (logprobs=K)
    top_logprobs: torch.Tensor | None = None  # [B, K] float32
    ranks: torch.Tensor | None = None  # [B] int64: the chosen token's rank (1 = most likely)
