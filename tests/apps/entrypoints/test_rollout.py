"""The rollout engine on real SmolLM2 (fp32, CPU): after every weight update, and across
sleep and wake, greedy output equals a fresh engine loaded from the same checkpoint; a
refused batch changes nothing; sleep gives the memory back (RSS)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.rollout import smollm2_folder, smollm2_weights

from pitstop.entrypoints.llm import LLM
from pitstop.entrypoints.rollout.errors import (
    EngineBusyError,
    EngineSleepingError,
    WeightUpdateError,
)
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.errors import ConfigError

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SETTINGS = dict(
    device="cpu",
    dtype="float32",
    kv_cache_gib=0.05,
    max_model_len=256,
    allocator="prefix",
    threads=1,  # two threads on a shared 2-core machine ran ten times slower
)
CHANGED_LAYER = "model.layers.3."


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def changed_weights(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SmolLM2 with layer 3's projections perturbed (enough to change greedy tokens)."""
    gen = torch.Generator().manual_seed(0)
    out = dict(original)
    for name, t in original.items():
        if name.startswith(CHANGED_LAYER) and t.ndim == 2:
            out[name] = t + 0.5 * t.std() * torch.randn(t.shape, generator=gen)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rollout")
    original = smollm2_weights()
    return {
        "original": smollm2_folder(root / "original"),
        "changed": smollm2_folder(root / "changed", changed_weights(original)),
    }


@pytest.fixture(scope="module")
def expected(folders: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Greedy tokens of a fresh engine of each checkpoint (built, run, closed)."""
    with LLM(str(folders["changed"]), **SETTINGS) as fresh:
        changed = greedy(fresh)
    return {"changed": changed}


@pytest.fixture(scope="module")
def llm(folders: dict[str, Path]) -> Iterator[LLM]:
    with LLM(str(folders["original"]), enable_sleep_mode=True, **SETTINGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> list[list[int]]:
    return greedy(llm)


@pytest.fixture
def restored(llm: LLM, folders: dict[str, Path]) -> Iterator[LLM]:
    """The module's engine, its original weights written back after the test."""
    yield llm
    if llm.is_sleeping():
        llm.wake_up()
    llm.update_weights_from_disk(folders["original"])


def test_one_layer_updated_equals_a_fresh_engine(
    restored: LLM, folders, expected, baseline
) -> None:
    assert expected["changed"] != baseline  # the change shows in the tokens
    changed = changed_weights(smollm2_weights())
    layer = [(n, t) for n, t in changed.items() if n.startswith(CHANGED_LAYER)]
    assert restored.update_weights(layer) == 9
    assert greedy(restored) == expected["changed"]


def test_every_tensor_updated_equals_a_fresh_engine(restored: LLM, expected) -> None:
    changed = changed_weights(smollm2_weights())
    assert restored.update_weights(iter(changed.items())) == len(changed)
    assert greedy(restored) == expected["changed"]


def test_update_from_disk_equals_a_fresh_engine(restored: LLM, folders, expected, baseline) -> None:
    restored.update_weights_from_disk(folders["changed"])
    assert greedy(restored) == expected["changed"]
    restored.update_weights_from_disk(folders["original"])
    assert greedy(restored) == baseline


def test_a_refused_batch_changes_nothing(restored: LLM, baseline) -> None:
    model = restored.engine.runner.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    changed = changed_weights(smollm2_weights())
    good = [(n, t) for n, t in changed.items() if n.startswith(CHANGED_LAYER)]
    cases = {
        "model.layers.99.mlp.up_proj.weight": (torch.zeros(1536, 576), "has no tensor named"),
        "model.layers.0.mlp.up_proj.weight": (torch.zeros(3, 3), r"shape \(3, 3\)"),
        "model.norm.weight": (torch.ones(576, dtype=torch.float16), "torch.float16"),
    }
    for name, (tensor, why) in cases.items():
        with pytest.raises(WeightUpdateError, match=rf"{re.escape(repr(name))}.*{why}|{why}"):
            restored.update_weights([*good, (name, tensor)])
    name, tensor = next((n, t) for n, t in good if t.ndim == 2)
    nan = tensor.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(WeightUpdateError, match="NaN"):
        restored.update_weights([*[g for g in good if g[0] != name], (name, nan)])
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert greedy(restored) == baseline


def test_a_tied_head_is_the_embedding(restored: LLM) -> None:
    embed = restored.engine.runner.model.embed_tokens
    new = torch.randn_like(embed) * 0.02
    restored.update_weights([("lm_head.weight", new)])
    assert torch.equal(embed, new)


def test_sleep_and_wake_keep_outputs_identical(restored: LLM, folders, baseline) -> None:
    for _ in range(2):
        restored.sleep(level=1)
        assert restored.is_sleeping()
        with pytest.raises(EngineSleepingError, match="wake_up"):
            restored.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        restored.wake_up()
        assert not restored.is_sleeping()
        assert greedy(restored) == baseline
    restored.sleep(level=2)
    restored.wake_up(tags=["weights"])
    assert restored.is_sleeping()  # the KV cache is still released
    restored.update_weights_from_disk(folders["original"])
    restored.wake_up(tags=["kv_cache"])
    assert greedy(restored) == baseline


def test_level_2_needs_new_weights_before_generating(restored: LLM) -> None:
    restored.sleep(level=2)
    with pytest.raises(EngineSleepingError, match=r"wake_up\(tags=\['weights'\]\)"):
        restored.update_weights([("model.norm.weight", torch.ones(576))])
    restored.wake_up()
    with pytest.raises(EngineSleepingError, match="update_weights"):
        restored.generate(PROMPTS[0], GREEDY, use_tqdm=False)


def test_sleep_refuses_with_a_request_unfinished(restored: LLM) -> None:
    rid = restored.engine.add_request(PROMPTS[0], GREEDY)
    try:
        with pytest.raises(EngineBusyError, match=rid):
            restored.sleep(level=1)
        with pytest.raises(EngineBusyError):
            restored.update_weights([("model.norm.weight", torch.ones(576))])
    finally:
        restored.engine.abort(rid)
    assert not restored.is_sleeping()


def test_sleep_needs_sleep_mode(folders) -> None:
    # a stand-in for an engine built without enable_sleep_mode: its rollout has no memory
    from pitstop.entrypoints.rollout.control import Rollout

    class NoEngine:
        runner = None
        device = torch.device("cpu")

    with pytest.raises(ConfigError, match="enable_sleep_mode=True"):
        Rollout(NoEngine(), None).sleep(1)  # type: ignore[arg-type]


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status")


def test_sleep_level_2_gives_the_memory_back(restored: LLM, folders, baseline) -> None:
    runner = restored.engine.runner
    held = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    held += runner.kv_cache.numel() * runner.kv_cache.element_size()
    awake = _rss()
    restored.sleep(level=2)
    asleep = _rss()
    assert awake - asleep > 0.8 * held, (awake, asleep, held)
    restored.wake_up()
    restored.update_weights_from_disk(folders["original"])
    back = _rss()
    assert back - asleep > 0.8 * held, (asleep, back, held)
    assert greedy(restored) == baseline


TRAINER = """
import sys, torch
from safetensors.torch import load_file
from pitstop.entrypoints.rollout.transfer import trainer_group

port, path = int(sys.argv[1]), sys.argv[2]
weights = load_file(path)
group = trainer_group("127.0.0.1", port, world_size=2, group_name="rl-test", backend="gloo")
for name in sorted(weights):  # batch 1: every tensor, in the order the engine names them
    group.broadcast(weights[name])
group.broadcast(torch.ones(3))  # batch 2: a norm of the wrong shape, refused by the engine
group.destroy()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_trainer_process_broadcasts_new_weights(restored: LLM, folders, expected) -> None:
    import subprocess
    import sys

    from safetensors import safe_open

    path = folders["changed"] / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        names = sorted(f.keys())
        slices = [f.get_slice(n) for n in names]
        shapes = [s.get_shape() for s in slices]
    port = _free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(path)])
    try:
        restored.init_weight_update_group("127.0.0.1", port, 1, 2, "rl-test", backend="gloo")
        n = restored.update_weights_from_distributed(names, ["float32"] * len(names), shapes)
        assert n == len(names)
        with pytest.raises(WeightUpdateError, match=r"'model.norm.weight' has shape \(3,\)"):
            restored.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[3]])
        assert trainer.wait(timeout=60) == 0
    finally:
        restored.destroy_weight_update_group()
        if trainer.poll() is None:
            trainer.kill()
    assert greedy(restored) == expected["changed"]
