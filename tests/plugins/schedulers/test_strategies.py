"""Allocators x schedulers end to end on the real SmolLM2-135M (issues 3 and 4).

Greedy tokens must not depend on the strategy: every allocator x scheduler,
a KV cache small enough to preempt, and prefix-cache hits all give the tokens
of one reference run. Each run also records every step through an
``on_step_finished`` observer, so the per-step budgets, static batching and
the KV-cache statistics are checked on the real engine loop.

The CPU is slow (a SmolLM2 step takes 50-300 ms here), so outputs are short
(6-8 greedy tokens, ``ignore_eos``), each strategy combination runs once and
its record is shared by the tests that read it.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import attrs
import pytest
from helpers.models import smollm2_gguf

import pitstop
from pitstop import LLM, SamplingParams
from pitstop.ground.metrics import StepStats
from pitstop.plugin_system.plugin_manager import PluginManager

pytestmark = pytest.mark.slow

ALLOCATORS = ("preallocated", "paged", "prefix")
SCHEDULERS = ("fcfs", "continuous", "chunked")

MAX_MODEL_LEN = 320  # one preallocated region: 20 pages of 16 tokens
LARGE_CACHE = 48  # pages: nothing is preempted (two preallocated regions)
SMALL_CACHE = 20  # pages: the smallest cache the engine accepts; paged and prefix must preempt
CHUNK_SIZE = 48
MAX_BATCHED = 320  # >= max_model_len: continuous and fcfs never see an oversized prompt
SETTINGS: dict[str, Any] = dict(
    device="cpu",
    dtype="float32",
    max_model_len=MAX_MODEL_LEN,
    page_size=16,
    max_batch_size=3,
    max_prefill_batch=3,
    max_num_batched_tokens=MAX_BATCHED,
    chunk_size=CHUNK_SIZE,
)

# Mixed lengths, each a few tokens short of a page boundary so that decoding crosses it
# (which is what makes a full cache preempt); the 236-token prompt is chunked 5+ times
# under chunk_size=48.
PROMPT_LENGTHS = (13, 30, 45, 236, 62)
MAX_TOKENS = (8, 6, 7, 8, 6)
LONG = PROMPT_LENGTHS.index(236)

TEXTS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a small notebook in which he wrote the weather, the ships he saw and the birds.",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "energy into chemical energy. Inside the chloroplasts, chlorophyll absorbs mostly red and "
    "blue light, and the energy splits water molecules, releasing oxygen as a by-product.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = "
    "len(items) // 2\n    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n"
    "    merged = []\n    while left and right:\n        merged.append((left if left[0] <= right[0] "
    "else right).pop(0))\n    return merged + left + right\n",
    "In the spring of 1869 the two halves of the first transcontinental railroad met at "
    "Promontory Summit in the Utah Territory. The Central Pacific had built eastward from "
    "Sacramento, blasting tunnels through the granite of the Sierra Nevada with black powder and "
    "nitroglycerin, while the Union Pacific had raced westward across the plains from Omaha. "
    "Thousands of workers, many of them immigrants from China and Ireland, laid the track by "
    "hand, sometimes more than ten miles in a single day. When the last spike, made of gold, was "
    "driven into a laurel tie, a telegraph operator tapped out a single word to the waiting "
    "nation: done. Cities from New York to San Francisco celebrated with cannon fire and bells. "
    "A journey that had taken months by wagon or by ship around Cape Horn could now be made in "
    "about a week, and the railroad reshaped trade, settlement and the lives of the Native "
    "nations whose lands it crossed. Historians still argue about its costs and its meaning. "
    "Some point to the fortunes made by a handful of financiers and to the land grants that "
    "gave away millions of acres; others to the towns, farms and markets that grew along the "
    "line, and to the way it bound the western territories to the rest of the country.",
    "Dear team, thank you all for the hard work on the quarterly report. Before Friday, please "
    "check the revenue tables, confirm the figures for the northern region, and send me any "
    "comments on the draft summary so that we can finish the final version on Monday morning. "
    "If anything is missing or unclear, write to me directly rather than to the whole list, and "
    "remember that the board meets on Wednesday at eleven.",
)
SYSTEM_PROMPT = (
    "You are a careful assistant for a public library. Answer questions about opening hours, "
    "borrowing rules, fines, events, the reading rooms, the children's corner, interlibrary "
    "loans, the digital catalogue and the e-book service. Be brief and polite, never invent a "
    "rule, and when you are unsure say so and point the reader to the front desk. The library "
    "opens at nine on weekdays and at ten on Saturdays; it is closed on Sundays and on public "
    "holidays. Members may borrow up to twelve items for three weeks and renew them twice. "
    "Overdue items cost ten cents a day, and lost cards are replaced at the desk for two dollars."
)
PREFIX_LEN = 128  # 8 whole pages of the system prompt
QUESTIONS = (
    "When do you open on Saturday?",
    "Can I renew a book three times?",
    "How many items may a member borrow at once, and for how long?",
    "Is the library open on public holidays or on Sundays, and what about Saturdays?",
)


# ---------------------------------------------------------------- helpers


def _observer() -> tuple[ModuleType, list[tuple[StepStats, frozenset[str]]]]:
    """An in-process plugin recording each step's stats and the requests running after it."""
    trace: list[tuple[StepStats, frozenset[str]]] = []
    module = ModuleType("strategy_trace")

    @pitstop.hookimpl
    def on_step_finished(engine, stats) -> None:
        # ``running`` is the built-in schedulers' list of admitted sequences (BaseScheduler).
        trace.append((stats, frozenset(s.request_id for s in engine.scheduler.running)))

    module.on_step_finished = on_step_finished  # type: ignore[attr-defined]
    return module, trace


def _llm(**settings: Any) -> tuple[LLM, list[tuple[StepStats, frozenset[str]]]]:
    smollm2_gguf()
    module, trace = _observer()
    llm = LLM(
        "smollm2-135m", plugins=PluginManager(extra_modules=[module]), **{**SETTINGS, **settings}
    )
    return llm, trace


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@functools.cache
def _encoded() -> tuple[tuple[int, ...], ...]:
    """Token ids of the texts, and of the prefix prompts (system prompt cut to PREFIX_LEN + question)."""
    from pitstop.loading.weights import load_model_source

    smollm2_gguf()
    tok = load_model_source("smollm2-135m").tokenizer
    assert tok is not None
    return tuple(tuple(tok.encode(t)) for t in (*TEXTS, SYSTEM_PROMPT, *QUESTIONS))


def _mixed_prompts() -> list[list[int]]:
    texts = _encoded()[: len(TEXTS)]
    prompts = [list(t[:n]) for t, n in zip(texts, PROMPT_LENGTHS, strict=True)]
    assert [len(p) for p in prompts] == list(PROMPT_LENGTHS), "a text encodes to too few tokens"
    return prompts


def _prefix_prompts() -> list[list[int]]:
    encoded = _encoded()
    system = list(encoded[len(TEXTS)][:PREFIX_LEN])
    assert len(system) == PREFIX_LEN
    return [system + list(q) for q in encoded[len(TEXTS) + 1 :]]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: tuple[int, ...] | int):
    if isinstance(max_tokens, int):
        max_tokens = (max_tokens,) * len(prompts)
    params = [_greedy(n) for n in max_tokens]
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def _assert_back_at_start(llm: LLM) -> None:
    """Every page free (prefix: cached pages nobody holds count as free) and nothing held."""
    stats = llm.engine.allocator.stats()
    assert stats.tokens_held == 0
    assert stats.pages_free == stats.num_pages
    assert stats.tokens_reserved == 0
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.num_waiting == llm.engine.scheduler.num_running == 0


@attrs.frozen
class Run:
    """What one strategy combination did on the mixed prompts."""

    tokens: list[list[int]]
    finish_reasons: list[str | None]
    num_preemptions: list[int]
    trace: list[tuple[StepStats, frozenset[str]]]
    preemptions: int
    prefix_hit_tokens: int


@functools.cache
def _run(allocator: str, scheduler: str, num_pages: int) -> Run:
    llm, trace = _llm(allocator=allocator, scheduler=scheduler, max_num_pages=num_pages)
    outs = _generate(llm, _mixed_prompts(), MAX_TOKENS)
    _assert_back_at_start(llm)
    return Run(
        tokens=[o.token_ids for o in outs],
        finish_reasons=[o.finish_reason for o in outs],
        num_preemptions=[o.metrics.num_preemptions for o in outs],
        trace=list(trace),
        preemptions=llm.engine.stats.preemptions,
        prefix_hit_tokens=llm.engine.allocator.stats().prefix_hit_tokens,
    )


@pytest.fixture(scope="module")
def reference() -> tuple[LLM, list[tuple[StepStats, frozenset[str]]], list[list[int]]]:
    """paged + continuous, a large cache and a large batch: the tokens every other run must give."""
    llm, trace = _llm(
        allocator="paged",
        scheduler="continuous",
        max_num_pages=64,
        max_batch_size=8,
        max_prefill_batch=8,
    )
    outs = _generate(llm, _mixed_prompts(), MAX_TOKENS)
    assert [len(o.token_ids) for o in outs] == list(MAX_TOKENS)
    assert llm.engine.stats.preemptions == 0
    return llm, trace, [o.token_ids for o in outs]


# ---------------------------------------------------------------- every combination, same tokens


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_greedy_tokens_are_identical_for_every_allocator_and_scheduler(
    reference, allocator: str, scheduler: str
) -> None:
    run = _run(allocator, scheduler, LARGE_CACHE)
    assert run.tokens == reference[2]
    assert run.finish_reasons == ["length"] * len(PROMPT_LENGTHS)
    assert run.preemptions == 0
    for stats, running in run.trace:
        assert (
            stats.num_seqs <= SETTINGS["max_batch_size"]
            and len(running) <= SETTINGS["max_batch_size"]
        )
        assert stats.num_preempted == 0


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_chunked_never_exceeds_its_budget_and_splits_the_long_prompt(
    reference, allocator: str
) -> None:
    trace = [stats for stats, _ in _run(allocator, "chunked", LARGE_CACHE).trace]
    assert (
        max(s.num_tokens for s in trace) == CHUNK_SIZE
    )  # the budget is used to the full, never more
    # the 236-token prompt needs at least ceil(236 / 48) = 5 steps of prompt tokens ...
    assert sum(1 for s in trace if s.num_prefill_tokens) >= -(-PROMPT_LENGTHS[LONG] // CHUNK_SIZE)
    # ... and decodes run in the same steps as prompt chunks
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in trace)


@pytest.mark.parametrize("scheduler", ["fcfs", "continuous"])
def test_continuous_and_fcfs_stay_within_max_num_batched_tokens(reference, scheduler: str) -> None:
    trace = [stats for stats, _ in _run("paged", scheduler, LARGE_CACHE).trace]
    assert max(s.num_tokens for s in trace) <= MAX_BATCHED


def _joins_while_running(trace: list[tuple[StepStats, frozenset[str]]]) -> list[int]:
    """Steps in which a request joined while a request running before it was still running."""
    steps = []
    before: frozenset[str] = frozenset()
    for stats, running in trace:
        if running - before and running & before:
            steps.append(stats.step)
        before = running
    return steps


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_fcfs_admits_nothing_into_a_running_batch(reference, allocator: str) -> None:
    fcfs = _run(allocator, "fcfs", LARGE_CACHE)
    assert _joins_while_running(fcfs.trace) == []
    # more than one batch ran (max_batch_size=3 for 5 prompts), so the check had something to see
    sets = [frozenset(), *(running for _, running in fcfs.trace)]
    formed = [now for prev, now in zip(sets, sets[1:], strict=False) if now - prev]
    assert len(formed) >= 2
    # and the same prompts under continuous batching do join a running batch
    assert _joins_while_running(_run(allocator, "continuous", LARGE_CACHE).trace)


# ---------------------------------------------------------------- preemption


@pytest.mark.parametrize(
    ("allocator", "scheduler"),
    [("paged", "fcfs"), ("paged", "continuous"), ("paged", "chunked"), ("prefix", "chunked")],
)
def test_a_cache_too_small_for_the_batch_preempts_and_changes_no_token(
    reference, allocator: str, scheduler: str
) -> None:
    # 20 pages of 16 tokens: the first prompts fill the cache, and decoding across page
    # boundaries needs pages nobody has. (preallocated never preempts: a region holds
    # max_model_len tokens; with one region it runs the prompts one at a time.)
    run = _run(allocator, scheduler, SMALL_CACHE)
    assert run.preemptions > 0
    assert sum(run.num_preemptions) == run.preemptions
    assert run.finish_reasons == ["length"] * len(PROMPT_LENGTHS)
    assert run.tokens == reference[2]
    if allocator == "prefix":  # a preempted sequence finds its own computed pages again
        assert run.prefix_hit_tokens > 0
    # _run checked the allocator is back at its start state once every request finished


# ---------------------------------------------------------------- prefix caching


def test_prefix_cache_computes_only_uncached_tokens_and_changes_no_token(reference) -> None:
    prompts = _prefix_prompts()
    lengths = [len(p) for p in prompts]
    assert all(n > PREFIX_LEN for n in lengths)
    expected = [o.token_ids for o in _generate(reference[0], prompts, 6)]  # paged

    llm, _ = _llm(allocator="prefix", scheduler="continuous", max_num_pages=LARGE_CACHE)
    engine = llm.engine
    # the first request alone: nothing cached yet
    first = _generate(llm, prompts[:1], 6)[0]
    assert first.metrics.num_cached_prompt_tokens == 0
    assert engine.stats.prompt_tokens == lengths[0]
    assert engine.allocator.stats().prefix_hit_tokens == 0
    # then the other three, in one batch: each finds the 8 pages of the shared prefix
    rest = _generate(llm, prompts[1:], 6)
    assert [o.metrics.num_cached_prompt_tokens for o in rest] == [PREFIX_LEN] * 3
    stats = engine.allocator.stats()
    assert stats.prefix_hit_tokens == 3 * PREFIX_LEN
    assert stats.prefix_queried_tokens == sum(lengths)
    # only the uncached tokens were computed
    assert engine.stats.prompt_tokens == sum(lengths) - 3 * PREFIX_LEN
    assert [o.token_ids for o in [first, *rest]] == expected
    # the shared pages stay cached but count as free
    assert engine.allocator.num_evictable_pages > 0
    _assert_back_at_start(llm)


# ---------------------------------------------------------------- utilization


@pytest.mark.parametrize("allocator", ["paged", "preallocated"])
def test_kv_utilization_of_one_100_token_sequence(reference, allocator: str) -> None:
    prompt = (_encoded()[LONG] * 2)[:100]
    if allocator == "paged":
        llm, trace = reference[0], reference[1]
        trace.clear()
    else:
        llm, trace = _llm(allocator=allocator, max_num_pages=LARGE_CACHE)
    _generate(llm, [list(prompt)], 2)
    num_pages = llm.engine.allocator.stats().num_pages
    after_prefill = trace[0][
        0
    ].allocator  # 100 prompt tokens computed, the first output token not yet
    if allocator == "paged":  # ceil(100 / 16) = 7 pages
        assert (after_prefill.tokens_held, after_prefill.tokens_reserved) == (100, 112)
        assert after_prefill.pages_free == num_pages - 7
        assert after_prefill.utilization == pytest.approx(100 / 112)
    else:  # one whole max_model_len region
        assert (after_prefill.tokens_held, after_prefill.tokens_reserved) == (100, MAX_MODEL_LEN)
        assert after_prefill.pages_free == num_pages - MAX_MODEL_LEN // 16
        assert after_prefill.utilization == pytest.approx(100 / MAX_MODEL_LEN)
    _assert_back_at_start(llm)


# ---------------------------------------------------------------- admission order


def test_shortest_first_overtakes_a_long_prompt_and_aging_lets_it_run() -> None:
    # One sequence at a time; all four arrive together, the long one first. shortest-first
    # admits the 5-token prompt before it; once the first finished (3 steps) every request
    # has waited past the 3-step bound, so the aged ones go in arrival order: the long one
    # next, ahead of the two shorter prompts still waiting.
    text = _encoded()[LONG]
    prompts = [list(text[:40]), list(text[40:45]), list(text[45:51]), list(text[51:58])]
    llm, _ = _llm(
        scheduler="continuous",
        allocator="paged",
        max_num_pages=LARGE_CACHE,
        max_batch_size=1,
        max_prefill_batch=1,
        admission="shortest-first",
        options={"scheduler.max_wait_steps": 3},
    )
    outs = _generate(llm, prompts, 3)
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled)
    assert order == [1, 0, 2, 3]
