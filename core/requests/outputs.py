"""What the engine hands back for each request."""

from __future__ import annotations

from collections.abc import Sequence

import attrs


def time_to_first_token(arrival: float, first_token: float | None) -> float | None:
    """TTFT: from arrival to the first output token (None before it)."""
    return None if first_token is None else first_token - arrival


def end_to_end_latency(arrival: float, finish: float | None) -> float | None:
    """E2E: from arrival to the request's finish (None before it)."""
    return None if finish is None else finish - arrival


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
        return end_to_end_latency(self.arrival, self.finish)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (:func:`time_per_output_token`)."""
        return time_per_output_token(self.token_times)

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        return inter_token_latencies(self.token_times)


@attrs.frozen
class Logprob:
    """One token's log-probability, its rank (1 = most likely) and its text (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]
"""A position's log-probabilities: the chosen token's and the top ``k`` alternatives', by id."""


class CallableBool(int):
    """A truth value that is also callable: ``if out.finished:`` and ``out.finished()`` (the
    latter is how vLLM code asks a ``CompletionOutput``) both work. It compares equal to
    True or False (``out.finished == True``), but is not the object ``True``."""

    def __new__(cls, value: object) -> CallableBool:
        return super().__new__(cls, bool(value))

    def __call__(self) -> bool:
        """The value as a plain bool."""
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))

    __str__ = __repr__


@attrs.frozen
class CompletionOutput:
    """One sample of a request (``n`` of them per request).

    ``text`` and ``token_ids`` hold everything generated so far; ``text_delta``
    and ``new_token_ids`` what the last step added (for streaming).
    ``logprobs`` (when asked) has one :data:`TokenLogprobs` per token;
    ``cumulative_logprob`` is the sum of the chosen tokens' log-probabilities.
    ``finish_reason`` is ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or
    None while running; ``stop_reason`` is the stop string or stop token id
    that ended it (None for EOS or any other reason). A stop token's text is
    not in ``text`` unless ``include_stop_str_in_output`` (as a stop string's).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_delta: str = ""
    new_token_ids: list[int] = attrs.Factory(list)

    @property
    def finished(self) -> CallableBool:
        """Whether this sample has stopped: a truth value, also callable as vLLM's
        ``CompletionOutput.finished()`` is."""
        return CallableBool(self.finish_reason is not None)


@attrs.frozen
class RequestOutput:
    """A request's output so far (or final, when ``finished``), in vLLM's shape.

    ``outputs`` holds one :class:`CompletionOutput` per sample (``n``);
    ``finished`` is a bool attribute, as in vLLM. ``num_cached_tokens`` counts
    the prompt tokens the prefix cache served (not computed) at the request's
    last admission.
    ``text``, ``token_ids``, ``finish_reason``, ``text_delta``,
    ``new_token_ids`` and ``logprobs`` are shortcuts to ``outputs[0]``'s
    (the only sample when ``n == 1``). ``prompt_logprobs`` (when asked) has
    None for the first prompt token and one :data:`TokenLogprobs` for each
    later one.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None  # set on the final output (finished=True)
    error: str | None = None  # why a request with finish_reason "error" was stopped
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        """``outputs[0].text``."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """``outputs[0].token_ids``."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        """``outputs[0].finish_reason`` ("error" when any sample failed)."""
        if any(o.finish_reason == "error" for o in self.outputs):
            return "error"
        return self.outputs[0].finish_reason

    @property
    def text_delta(self) -> str:
        """``outputs[0].text_delta``."""
        return self.outputs[0].text_delta

    @property
    def new_token_ids(self) -> list[int]:
        """``outputs[0].new_token_ids``."""
        return self.outputs[0].new_token_ids

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """``outputs[0].logprobs``."""
        return self.outputs[0].logprobs

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated over every sample."""
        return sum(len(o.token_ids) for o in self.outputs)
