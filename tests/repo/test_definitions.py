"""Definitions that once had several copies: one each now, pinned here."""

from __future__ import annotations

import pytest
import torch

from pitstop.bench.report import RequestRecord
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.plugin_system.sampler import make_generator
from pitstop.plugins.samplers.batch import is_greedy, make_sampling_batch
from pitstop.plugins.samplers.draws import exponential_race
from pitstop.requests.outputs import RequestMetrics, time_per_output_token
from pitstop.requests.sampling_params import SAMPLING_EPS


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.5 * SAMPLING_EPS}, True),
        ({"temperature": SAMPLING_EPS}, False),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 1}, True),
    ],
)
def test_one_greedy_threshold(kwargs: dict, greedy: bool) -> None:
    params = SamplingParams(**kwargs)
    assert SAMPLING_EPS == 1e-5
    assert params.greedy is greedy and is_greedy(params) is greedy
    batch = make_sampling_batch([params], [None], "cpu")
    assert batch.all_greedy is greedy and (float(batch.temperature[0]) == 0.0) is greedy


def _metrics(times: tuple[float, ...]) -> RequestMetrics:
    return RequestMetrics(
        arrival=0.0,
        first_scheduled=0.0,
        first_token=times[0] if times else None,
        finish=times[-1] if times else None,
        token_times=times,
        num_prompt_tokens=3,
        num_cached_prompt_tokens=0,
        num_preemptions=0,
    )


def _record(times: tuple[float, ...], output_len: int) -> RequestRecord:
    return RequestRecord(
        request_id="r",
        input_len=3,
        output_len=output_len,
        arrival=0.0,
        first_token=times[0] if times else None,
        finish=times[-1] if times else None,
        token_times=times,
    )


def test_one_tpot_formula() -> None:
    times = (1.0, 2.0, 4.0)
    # (last - first) / (tokens - 1): vLLM's TPOT
    assert time_per_output_token(times) == 1.5
    assert _metrics(times).tpot == _record(times, 3).tpot == 1.5
    # five tokens in three streamed chunks: the gaps are shared by four tokens after the first
    assert _record(times, 5).tpot == time_per_output_token(times, 5) == 0.75
    assert _metrics((1.0,)).tpot is None and _record((1.0,), 1).tpot is None
    assert _metrics(times).ttft == _record(times, 3).ttft == 1.0
    assert _metrics(times).inter_token_latencies == _record(times, 3).itls == [1.0, 2.0]


def test_exponential_race_draws_each_row_from_its_own_generator() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    shared = make_generator(0, "cpu")
    before = shared.get_state()
    first = exponential_race(probs, [make_generator(7, "cpu")] * 3, shared)
    assert torch.equal(shared.get_state(), before)  # every row seeded: shared untouched
    again = exponential_race(probs, [make_generator(7, "cpu")] * 3, make_generator(1, "cpu"))
    assert int(first[0]) == 1 and torch.equal(first, again)
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[exponential_race(probs[1:2], [None], shared)] += 1
    assert torch.allclose(counts / counts.sum(), probs[1], atol=0.04)
