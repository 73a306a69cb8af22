"""What the engine hands back for each request."""

from __future__ import annotations

import attrs


@attrs.frozen
class RequestMetrics:
    """Per-request wall-clock times (``time.perf_counter`` seconds) and counts."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finish: float | None
    token_times: tuple[float, ...]
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        """End-to-end latency, from arrival to finish."""
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@attrs.frozen
class RequestOutput:
    """A request's output so far (or final, when ``finished``).

    ``text`` and ``token_ids`` hold everything generated; ``text_delta`` and
    ``new_token_ids`` what this step added (for streaming).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    text_delta: str = ""
    new_token_ids: list[int] = attrs.Factory(list)
    logprobs: list[float] | None = None
    metrics: RequestMetrics | None = None  # set on the final output (finished=True)
    error: str | None = None  # why a request with finish_reason "error" was stopped
