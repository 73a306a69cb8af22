"""What the engine hands back for each request."""

from __future__ import annotations

from collections.abc import Sequence

import attrs


def time_to_first_token(arrival: float, first_token: float | None) -> float | None:
    """TTFT: from arrival to the first output token (None before it)."""
    return None if first_token is None else first_token - arrival


def time_per_output_token(token_times: Sequence[float], num_tokens: int = 0) -> float | None:
    """TPOT: the mean time per output token after the first (vLLM's definition),
    ``(last - first) / (n - 1)`` with ``n = max(len(token_times), num_tokens)``.

    ``token_times`` are the times tokens arrived; ``num_tokens`` counts tokens
    when several can share one time (a streamed chunk over HTTP carries more than
    one). None with fewer than two times.
    """
    if len(token_times) < 2:
        return None
    n = max(len(token_times), num_tokens)
    return (token_times[-1] - token_times[0]) / (n - 1)


def inter_token_latencies(token_times: Sequence[float]) -> list[float]:
    """ITL: the gaps between consecutive token arrivals."""
    return [b - a for a, b in zip(token_times, token_times[1:], strict=False)]


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
        return time_to_first_token(self.arrival, self.first_token)

    @property
    def e2e(self) -> float | None:
        """End-to-end latency, from arrival to finish."""
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (:func:`time_per_output_token`)."""
        return time_per_output_token(self.token_times)

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        return inter_token_latencies(self.token_times)


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
