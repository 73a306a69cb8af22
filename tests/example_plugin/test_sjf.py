"""The ``sjf`` scheduler's own tests: pitstop's scheduler contract, then what makes it sjf."""

from __future__ import annotations

from pitstop_example.sjf import make_sjf

from pitstop import EngineConfig
from pitstop.entrypoints.engine_args import engine_config
from pitstop.testing.scheduler import SimRequest, Workload, check_scheduler_contract, simulate


def test_sjf_meets_the_scheduler_contract() -> None:
    # each example under the overlapped loop (lag 1) or the serial one (lag 0)
    check_scheduler_contract(make_sjf, max_examples=100)


def test_sjf_meets_the_contract_in_arrival_order_and_by_prompt() -> None:
    for options in ({"sjf.max_wait_steps": 0}, {"sjf.job_size": "prompt"}):
        check_scheduler_contract(
            make_sjf, config_overrides={"options": options}, max_examples=30, lags=(1,)
        )


def _config(**options: object) -> EngineConfig:
    return engine_config(
        max_model_len=64, page_size=4, max_batch_size=1, max_prefill_batch=1, options=options
    )


# One sequence at a time: the order of first steps is the admission order.
LONG_FIRST = Workload(
    (
        SimRequest("long", prompt_len=4, max_tokens=40),
        SimRequest("short", prompt_len=4, max_tokens=2),
        SimRequest("medium", prompt_len=4, max_tokens=10),
    ),
    num_pages=32,
)


def _first_steps(config: EngineConfig, workload: Workload) -> list[str]:
    waits = simulate(make_sjf, config, workload).max_wait_steps
    return sorted(waits, key=lambda rid: waits[rid])


def test_the_shortest_job_runs_first() -> None:
    # job size prompt + max_tokens: the short one, then the medium one, then the long one
    assert _first_steps(_config(), LONG_FIRST) == ["short", "medium", "long"]
    # by prompt only every job is alike: arrival order
    assert _first_steps(_config(**{"sjf.job_size": "prompt"}), LONG_FIRST) == [
        "long",
        "short",
        "medium",
    ]


def test_a_long_job_waits_at_most_the_aging_bound() -> None:
    # a stream of short jobs keeps arriving; the long one still starts once it has aged
    shorts = tuple(SimRequest(f"s{i}", 2, 2, arrival_step=i) for i in range(40))
    workload = Workload((SimRequest("long", 2, 30), *shorts), num_pages=32)
    never_aged = simulate(make_sjf, _config(**{"sjf.max_wait_steps": 1000}), workload)
    aged = simulate(make_sjf, _config(**{"sjf.max_wait_steps": 8}), workload)
    assert never_aged.max_wait_steps["long"] > 40  # behind every short job
    # aged after 8 steps; then it waits only for the running job to finish
    assert aged.max_wait_steps["long"] <= 8 + 3
