"""The rollout engine on CUDA (run on the H200; skipped without a GPU): with CUDA graphs
captured, an update and sleep/wake cycles keep greedy output equal to a fresh engine's,
and ``sleep(level=2)`` frees at least 95% of what the engine holds (``mem_get_info``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.rollout import smollm2_folder, smollm2_weights

from pitstop.entrypoints.llm import LLM
from pitstop.entrypoints.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# a fixed KV cache each: the test holds two engines at once (a fraction of the GPU would count
# the first engine's memory against the second's)
SETTINGS = dict(device="cuda", dtype="float32", max_model_len=1024, kv_cache_gib=1.0)


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rollout-gpu")
    original = smollm2_weights()
    gen = torch.Generator().manual_seed(0)
    changed = {
        n: (t + 0.5 * t.std() * torch.randn(t.shape, generator=gen))
        if n.startswith("model.layers.3.") and t.ndim == 2
        else t
        for n, t in original.items()
    }
    return {
        "original": smollm2_folder(root / "original"),
        "changed": smollm2_folder(root / "changed", changed),
    }


@pytest.fixture(scope="module")
def llm(folders) -> Iterator[LLM]:
    with LLM(str(folders["original"]), enable_sleep_mode=True, **SETTINGS) as engine:
        yield engine


def test_graphs_survive_updates_and_sleep(llm: LLM, folders) -> None:
    assert llm.engine.runner.graphs is not None  # CUDA graphs captured
    baseline = greedy(llm)
    with LLM(str(folders["changed"]), **SETTINGS) as fresh:
        expected = greedy(fresh)
    assert expected != baseline
    llm.update_weights_from_disk(folders["changed"])
    assert greedy(llm) == expected
    for level in (1, 1, 2):
        llm.sleep(level=level)
        llm.wake_up()
        if level == 2:
            llm.update_weights(_cuda(folders["changed"]))  # from GPU tensors
        assert greedy(llm) == expected, level
    llm.update_weights_from_disk(folders["original"])
    assert greedy(llm) == baseline


def _cuda(folder: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [(n, t.cuda()) for n, t in load_file(str(folder / "model.safetensors")).items()]


def test_sleep_frees_the_engines_memory(llm: LLM, folders) -> None:
    runner = llm.engine.runner
    held = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    held += runner.kv_cache.numel() * runner.kv_cache.element_size()
    torch.cuda.synchronize()
    awake = torch.cuda.mem_get_info()[0]
    llm.sleep(level=2)
    asleep = torch.cuda.mem_get_info()[0]
    assert asleep - awake >= 0.95 * held, (awake, asleep, held)
    llm.wake_up()
    llm.update_weights_from_disk(folders["original"])


NCCL_TRAINER = """
import sys, torch
from safetensors.torch import load_file
from pitstop.entrypoints.rollout.transfer import trainer_group

port, path = int(sys.argv[1]), sys.argv[2]
torch.cuda.set_device(1)
weights = {n: t.cuda() for n, t in load_file(path).items()}
group = trainer_group("127.0.0.1", port, world_size=2, group_name="rl-nccl", backend="nccl")
for name in sorted(weights):
    group.broadcast(weights[name])
torch.cuda.synchronize()
group.destroy()
"""


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_a_trainer_on_another_gpu_broadcasts_over_nccl(llm: LLM, folders) -> None:
    """The trainer on cuda:1 broadcasts the changed weights to the engine on cuda:0 over
    NCCL; greedy output then equals a fresh engine of that checkpoint. Prints the rate."""
    import socket
    import subprocess
    import sys
    import time

    from safetensors import safe_open

    path = folders["changed"] / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        names = sorted(f.keys())
        shapes = [f.get_slice(n).get_shape() for n in names]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with LLM(str(folders["changed"]), **SETTINGS) as fresh:
        expected = greedy(fresh)
    trainer = subprocess.Popen([sys.executable, "-c", NCCL_TRAINER, str(port), str(path)])
    try:
        llm.init_weight_update_group("127.0.0.1", port, 1, 2, "rl-nccl", backend="nccl")
        start = time.perf_counter()
        llm.update_weights_from_distributed(names, ["float32"] * len(names), shapes)
        took = time.perf_counter() - start
        assert trainer.wait(timeout=120) == 0
    finally:
        llm.destroy_weight_update_group()
        if trainer.poll() is None:
            trainer.kill()
    size = sum(4 * int(torch.Size(s).numel()) for s in shapes)
    print(
        f"nccl broadcast + update: {size / 1e9:.2f} GB in {took:.3f} s, {size / took / 1e9:.1f} GB/s"
    )
    assert greedy(llm) == expected
    llm.update_weights_from_disk(folders["original"])
