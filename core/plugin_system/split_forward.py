"""An optional capability of a model: its forward pass cut at each attention.

The runner's piecewise CUDA graphs (:mod:`pitstop.runner.piecewise`) need it; a model
without it runs prefill and mixed steps eagerly.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from pitstop.ground.attention import AttentionMetadata
from pitstop.plugin_system.protocols import RotaryCache


@runtime_checkable
class SplitAttention(Protocol):
    """A layer's attention that can run apart from its projections."""

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention of the rotated queries over the paged cache: ``[T, heads * head_size]``."""
        ...


@runtime_checkable
class SplitLayer(Protocol):
    """A decoder layer cut at its attention (see :class:`SplitForwardModel`)."""

    self_attn: SplitAttention

    def before_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything up to attention (norm, projections, rotary, the cache store): (q, residual)."""
        ...

    def after_attention(
        self, o: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after attention (output projection, norm, MLP): (hidden, residual)."""
        ...


@runtime_checkable
class SplitForwardModel(Protocol):
    """An optional capability of a :class:`Model`: its forward pass cut at each attention.

    The runner captures prefill and mixed steps as CUDA graphs of the pieces
    between attentions, and runs attention (whose shapes change with the
    step) eagerly between them (``pitstop.runner.model_runner.PiecewiseGraphs``). A model
    whose ``layers`` are :class:`SplitLayer` s and that has ``embed`` and
    ``final_norm`` gets this; any other runs those steps eagerly.
    """

    layers: Any  # a sequence (torch.nn.ModuleList) of SplitLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``[T, hidden]``."""
        ...

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's residual add and the final norm."""
        ...
