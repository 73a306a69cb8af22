"""What the runner's parts (capture, graphs, piecewise steps, memory planning) read of
the runner: :class:`RunnerView`, a protocol :class:`~pitstop.runner.model_runner.ModelRunner`
satisfies, so that the parts depend on the members they use and not on the runner's
module (which imports them)."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class RunnerView(Protocol):
    """The members of a model runner its parts use (types of the parts' own objects
    are left open: they are defined in the parts' modules)."""

    config: Any  # EngineConfig
    device: torch.device
    dtype: torch.dtype
    model: Any  # the model plugin's module
    model_config: Any  # ModelConfig
    kv_cache: Any  # per-layer (K, V) page tensors
    page_size: int
    rotary: Any  # RotaryCache
    poison: bool
    step_token_budget: int | None
    graphs: Any  # DecodeGraphs | None
    mixed_graphs: Any  # PiecewiseGraphs | None
    verify_graphs: Any  # VerifyGraphs | None
    last_sampled: Any  # the previous step's sampled ids on the device

    def bytes_per_page(self) -> int:
        """Bytes of one KV page over all layers."""
        ...

    def init_kv_cache(self, num_pages: int) -> None:
        """Allocate the KV cache with ``num_pages`` pages."""
        ...

    def run_synthetic_step(self, num_seqs: int, num_tokens: int, pages_per_seq: int) -> None:
        """Run one made-up step of this shape (memory profiling)."""
        ...

    def _pending_row(self, seq_id: int) -> int:
        """The row of the previous step's sampled ids that holds ``seq_id``'s pending token."""
        ...
