"""Per-request sampling parameters, validated when built."""

from __future__ import annotations

import attrs

from pitstop.errors import InvalidRequestError


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to turn a request's logits into tokens, and when to stop.

    ``temperature=0`` is greedy decoding. ``top_k=-1`` (or 0 in vLLM's
    spelling is *not* accepted: use -1) disables top-k; ``top_p=1`` and
    ``min_p=0`` disable their filters. ``seed`` makes one request's sampling
    repeatable whatever else is in the batch.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = attrs.field(
        default=(), converter=lambda s: (s,) if isinstance(s, str) else tuple(s or ())
    )
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=lambda s: tuple(s or ()))
    ignore_eos: bool = False
    logprobs: bool = False

    def __attrs_post_init__(self) -> None:
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}; ask for at least one token",
        )
        _check(
            self.temperature >= 0,
            f"temperature must be >= 0, got {self.temperature!r}; use 0 for greedy decoding",
        )
        _check(
            0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}; use 1 to disable top-p",
        )
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}",
        )
        _check(
            0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}; use 0 to disable min-p",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop strings must be non-empty strings",
        )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1
