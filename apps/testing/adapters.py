"""The adapter check: every row of a batch that mixes adapters is its own reference's.

An adapter method (``adapter=NAME``, :mod:`pitstop.plugin_system.adapter`) is correct when
each row of any batch gives, token for token (greedy), what its own adapter gives alone
in the framework it was trained in (PEFT's ``merge_and_unload()`` for LoRA), and rows
without an adapter give the base model's tokens. :func:`check_adapters` draws with
Hypothesis a mix of the given adapters (``None``, the base model, among them) over prompts
of drawn lengths, runs each mix as one ``generate`` call (so the rows share steps) and
compares every row with its reference. How a third party runs it::

    from pitstop.testing.adapters import check_adapters

    def test_my_adapters(llm, my_request, base_greedy, my_greedy):
        check_adapters(llm, {None: base_greedy, my_request: my_greedy})

``references`` maps each adapter request to a function of the prompt ids that returns the
reference continuation of ``max_tokens`` tokens (cache it: each prompt is asked once per
adapter). Use an engine that runs in fp32 with poisoned memory, and a prefix-caching
allocator to check that two adapters never share cached pages (each drawn prompt is also
run again under every adapter of the mix).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pitstop.testing._hypothesis import suite_settings

__all__ = ["check_adapters"]

Reference = Callable[[list[int]], list[int]]


def check_adapters(
    llm: Any,
    references: Mapping[Hashable | None, Reference],
    *,
    max_examples: int = 4,
    max_rows: int = 4,
    max_tokens: int = 6,
    vocab: tuple[int, int] = (3, 1000),
    prompt_lengths: tuple[int, int] = (1, 40),
) -> None:
    """Draw mixes of ``references``' adapters and check every row against its reference.

    ``llm``: a :class:`pitstop.LLM` built with the adapter method (its ``max_loras`` at
    least the number of adapters in ``references``); ``vocab`` and ``prompt_lengths``
    bound the drawn prompt ids and lengths (inclusive).
    """
    from pitstop.entrypoints.sampling_params import SamplingParams

    adapters = list(references)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = st.lists(st.integers(*vocab), min_size=prompt_lengths[0], max_size=prompt_lengths[1])
    row = st.tuples(st.sampled_from(adapters), prompt)

    def run(rows: list[tuple[Any, list[int]]]) -> None:
        outs = llm.generate(
            prompt_token_ids=[p for _, p in rows],
            sampling_params=params,
            lora_request=[a for a, _ in rows],
            use_tqdm=False,
        )
        for (adapter, p), out in zip(rows, outs, strict=True):
            expected = references[adapter](p)
            assert out.token_ids == expected, (
                f"adapter {adapter!r}, prompt of {len(p)} tokens: {out.token_ids} != {expected}"
            )

    @suite_settings(max_examples)
    @given(rows=st.lists(row, min_size=1, max_size=max_rows))
    def mixes(rows: list[tuple[Any, list[int]]]) -> None:
        run(rows)
        # the first prompt again under every adapter of the mix, in one batch: a prefix
        # cache now holds its pages under the first row's adapter
        run([(adapter, rows[0][1]) for adapter, _ in rows])

    mixes()
