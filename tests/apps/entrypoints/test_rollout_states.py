"""A Hypothesis sequence of sleep, wake, update and generate on a tiny model: the output
never changes (the weights written are the originals), every KV page comes back, and the
memory the engine holds is exactly what its state says (none leaked, none lost)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import make_tiny_checkpoint
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pitstop.entrypoints.llm import LLM
from pitstop.entrypoints.rollout.errors import EngineSleepingError
from pitstop.entrypoints.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 41]}, {"prompt_token_ids": [7, 7, 8]}]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", with_tokenizer=False)


def _held_bytes(llm: LLM) -> int:
    runner = llm.engine.runner
    tensors = [*runner.model.parameters(), runner.kv_cache]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_sleep_wake_update_generate_sequences(tiny: Path) -> None:
    from safetensors.torch import load_file

    original = load_file(str(tiny / "model.safetensors"))
    llm = LLM(
        str(tiny),
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.01,
        max_model_len=64,
        allocator="prefix",
        threads=1,
        enable_sleep_mode=True,
    )
    baseline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    full = _held_bytes(llm)
    runner = llm.engine.runner
    weight_bytes = sum(p.untyped_storage().nbytes() for p in runner.model.parameters())
    kv_bytes = runner.kv_cache.untyped_storage().nbytes()
    names = sorted(original)

    class Rollouts(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            llm.wake_up()
            llm.update_weights(original.items())
            self.released: set[str] = set()
            self.missing = False

        @rule(level=st.sampled_from([1, 2]))
        def sleep(self, level: int) -> None:
            llm.sleep(level=level)
            self.released = {"weights", "kv_cache"}
            self.missing = self.missing or level == 2

        @rule(tags=st.sampled_from([None, ["weights"], ["kv_cache"]]))
        def wake(self, tags: list[str] | None) -> None:
            llm.wake_up(tags)
            self.released -= set(tags or ["weights", "kv_cache"])

        @precondition(lambda self: "weights" not in self.released)
        @rule(subset=st.sets(st.sampled_from(names), min_size=1))
        def update_some(self, subset: set[str]) -> None:
            llm.update_weights([(n, original[n]) for n in sorted(subset)])

        @precondition(lambda self: "weights" not in self.released)
        @rule()
        def update_all(self) -> None:
            llm.update_weights(original.items())
            self.missing = False

        @rule()
        def generate(self) -> None:
            if self.released or self.missing:
                with pytest.raises(EngineSleepingError):
                    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
                return
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == baseline

        @invariant()
        def pages_all_free(self) -> None:
            stats = llm.engine.allocator.stats()
            assert stats.pages_free == stats.num_pages

        @invariant()
        def memory_is_what_the_state_says(self) -> None:
            expected = full
            if "weights" in self.released:
                expected -= weight_bytes
            if "kv_cache" in self.released:
                expected -= kv_bytes
            assert _held_bytes(llm) == expected
            assert llm.is_sleeping() == bool(self.released)
            if "weights" not in self.released:  # a CPU engine keeps no host copy once awake
                assert llm.rollout.sleep_state._host is None

    Rollouts.TestCase.settings = settings(max_examples=6, stateful_step_count=8, deadline=None)
    try:
        Rollouts.TestCase().runTest()
        # the last example may end after a level-2 sleep and a wake without an update: the
        # weights are then memory to reload, as vLLM's, which the engine refuses to run on
        # (EngineSleepingError); once reloaded they are whole and give the same tokens
        llm.wake_up()
        llm.update_weights(original.items())
        assert _held_bytes(llm) == full
        assert not torch.isnan(next(llm.engine.runner.model.parameters())).any()
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == baseline
    finally:
        llm.wake_up()
        llm.close()


def test_updates_land_in_merged_projections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With merged q/k/v and gate/up (as the fused kernel set asks; here the reference set
    made to ask, which is faster to build on CPU), a k_proj and an up_proj land in their
    rows and nothing else moves; after a full update every merged weight is the new
    checkpoint's parts, stacked."""
    from safetensors.torch import load_file, save_file

    from pitstop.entrypoints.rollout.errors import WeightUpdateError
    from pitstop.plugins.kernels.reference import ReferenceKernels

    monkeypatch.setattr(ReferenceKernels, "merge_projections", True)

    a = make_tiny_checkpoint(tmp_path, "llama", seed=0, with_tokenizer=False)
    b = make_tiny_checkpoint(tmp_path, "llama", seed=1, with_tokenizer=False)
    new = load_file(str(b / "model.safetensors"))
    old = load_file(str(a / "model.safetensors"))
    settings = dict(device="cpu", dtype="float32", kv_cache_gib=0.01, max_model_len=64, threads=1)
    p = "model.layers.0."

    def parts(src: dict[str, torch.Tensor], *names: str) -> torch.Tensor:
        return torch.cat([src[p + n + ".weight"] for n in names])

    with LLM(str(a), **settings) as llm:
        model = llm.engine.runner.model
        assert model.merged
        before = {n: t.clone() for n, t in model.named_parameters()}
        poisoned = dict(new)
        last = sorted(poisoned)[-1]
        poisoned[last] = poisoned[last].clone()
        poisoned[last].view(-1)[0] = float("nan")
        save_file(poisoned, str(tmp_path / "nan.safetensors"))
        with pytest.raises(WeightUpdateError, match=f"NaN.*{last}"):
            llm.update_weights_from_disk(tmp_path / "nan.safetensors")
        assert all(torch.equal(t, before[n]) for n, t in model.named_parameters())
        k, up = p + "self_attn.k_proj.weight", p + "mlp.up_proj.weight"
        llm.update_weights([(k, new[k]), (up, new[up])])
        qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
        mixed = {**old, k: new[k], up: new[up]}
        assert torch.equal(
            qkv, parts(mixed, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        )
        assert torch.equal(gate_up, parts(mixed, "mlp.gate_proj", "mlp.up_proj"))
        llm.update_weights(new.items())
        assert torch.equal(
            qkv, parts(new, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        )
        assert torch.equal(gate_up, parts(new, "mlp.gate_proj", "mlp.up_proj"))
        assert torch.equal(model.embed_tokens, new["model.embed_tokens.weight"])
