"""Grammar backends are plugins: the engine builds the one ``grammar`` names, through the plugin
manager, at the first structured request, and drives it only through its protocol.

A fake backend here, registered the way a third-party distribution registers one, forces the
output to the first string of a ``choice`` token by token (so a random tiny model writes it
exactly) and refuses every other constraint: its refusal fails only the request that asked.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import pitstop
from pitstop import LLM, EngineConfig, SamplingParams
from pitstop.errors import InvalidRequestError, PluginError
from pitstop.plugin_system.kinds import KINDS, lacks, missing_members
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.plugin_system.protocols import GrammarBackend, GrammarMatcher


class FirstChoiceMatcher:
    """Follows one sample: the token ids of the choice, and how many were accepted."""

    def __init__(self, backend: FirstChoice, ids: list[int]) -> None:
        self.backend = backend
        self.ids = ids
        self.pos = 0

    def accept(self, token_id: int) -> None:
        """Advance over the next token of the choice; any other token is refused."""
        if self.is_finished or token_id != self.ids[self.pos]:
            raise InvalidRequestError(f"the first-choice grammar refused token {token_id}")
        self.pos += 1

    @property
    def is_finished(self) -> bool:
        """Every token of the choice accepted."""
        return self.pos == len(self.ids)


class FirstChoice:
    """A grammar backend: the output is the first string of a ``choice``, nothing else."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.rows_filled = 0

    def new_state(self, spec: Any) -> FirstChoiceMatcher:
        """A matcher over the first choice's token ids; other constraints are refused."""
        if spec.kind != "choice":
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} is not supported by the first-choice backend"
            )
        return FirstChoiceMatcher(self, self.tokenizer.encode(spec.choice[0], False))

    def check(self, spec: Any) -> None:
        """Refuse what new_state refuses."""
        self.new_state(spec)

    def bitmask(self, states: Any) -> torch.Tensor:
        """One bit set per constrained row (its next token), every bit for the others."""
        mask = torch.full((len(states), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for row, state in enumerate(states):
            if state is None:
                continue
            self.rows_filled += 1
            mask[row] = 0
            if not state.is_finished:
                token = state.ids[state.pos]
                bit = 1 << (token % 32)
                mask[row, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
        return mask


BUILT: list[FirstChoice] = []


def _make_first_choice(config: EngineConfig, tokenizer: Any, vocab_size: int) -> FirstChoice:
    backend = FirstChoice(tokenizer, vocab_size)
    BUILT.append(backend)
    return backend


def _plugin() -> ModuleType:
    module = ModuleType("first_choice_grammar")

    @pitstop.hookimpl
    def register_grammars(register) -> None:
        register("first-choice", _make_first_choice)

    module.register_grammars = register_grammars  # type: ignore[attr-defined]
    return module


def test_the_fake_backend_and_matcher_conform() -> None:
    backend = FirstChoice(None, 64)
    assert missing_members(KINDS["grammar"], backend) == []
    assert lacks(GrammarMatcher, FirstChoiceMatcher(backend, [1])) == []
    assert isinstance(backend, GrammarBackend)


def test_a_third_party_grammar_backend_is_picked_by_name(tmp_path: Path) -> None:
    from helpers.models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, "llama")
    pm = PluginManager(allow=["pitstop"], extra_modules=[_plugin()])
    assert pm.names("grammar") == ["first-choice", "llguidance"]
    BUILT.clear()
    llm = LLM(str(folder), device="cpu", grammar="first-choice", max_num_pages=64, plugins=pm)
    free = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate("Hello", free, use_tqdm=False)
    # built at the first structured request
    assert BUILT == [] and llm.engine.intake.grammars is None

    choice = SamplingParams(
        temperature=1.0, seed=1, max_tokens=20, structured_outputs={"choice": ["blue sky", "x"]}
    )
    outs = llm.generate(["Colour:", "Sky:"], [choice, free], use_tqdm=False)
    assert outs[0].outputs[0].text == "blue sky" and outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[1].outputs[0].token_ids) == 4  # the free row beside it ran unmasked
    assert len(BUILT) == 1 and llm.engine.intake.grammars is BUILT[0] and BUILT[0].rows_filled > 0

    with pytest.raises(InvalidRequestError, match="not supported by the first-choice backend"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "a+"}))
    assert not llm.engine.has_unfinished_requests()  # refused before it was queued
    again = llm.generate("Again:", choice, use_tqdm=False)[0].outputs[0]
    assert again.text == "blue sky" and len(BUILT) == 1  # one backend per engine


def test_an_unknown_grammar_backend_is_refused_before_any_weight_loads() -> None:
    with pytest.raises(PluginError, match=r"unknown grammar 'xgrammar'.*llguidance"):
        PluginManager().resolve(EngineConfig(grammar="xgrammar"))


def test_a_backend_lacking_a_member_names_it() -> None:
    module = ModuleType("half_grammar")

    class NoBitmask:
        def new_state(self, spec: Any) -> None:  # noqa: D102
            return None

        def check(self, spec: Any) -> None:  # noqa: D102
            return None

    @pitstop.hookimpl
    def register_grammars(register) -> None:
        register("half", lambda config, tokenizer, vocab_size: NoBitmask())

    module.register_grammars = register_grammars  # type: ignore[attr-defined]
    pm = PluginManager(load_entry_points=False, extra_modules=[module])
    with pytest.raises(PluginError, match=r"grammar 'half'.*lacks bitmask.*GrammarBackend"):
        pm.create("grammar", "half", EngineConfig(), None, 64)


def test_llguidance_is_the_built_in_backend() -> None:
    pm = PluginManager()
    assert EngineConfig().grammar == "llguidance" and "llguidance" in pm.names("grammar")
    assert pm.get("grammar", "llguidance").module == "pitstop.plugins.grammars.llguidance"
