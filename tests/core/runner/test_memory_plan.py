"""How the runner sizes its KV cache on CUDA: the profile step's peak, without a GPU.

``profile_peak_memory`` reads torch's CUDA allocator statistics; here a fake allocator
stands in for them, so that the arithmetic is checked on any machine.
"""

from __future__ import annotations

import pytest
import torch

from pitstop.config import EngineConfig
from pitstop.runner.memory_plan import profile_peak_memory


class FakeAllocator:
    """``memory_allocated`` and its peak, as torch.cuda counts them."""

    def __init__(self, allocated: int) -> None:
        self.allocated = allocated
        self.peak = allocated

    def take(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(
            torch.cuda,
            "reset_peak_memory_stats",
            lambda device=None: setattr(self, "peak", self.allocated),
        )
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)


@pytest.mark.parametrize("activations", [0, 7_000_000])
def test_the_peak_leaves_out_the_cache_made_for_the_profile_step(
    monkeypatch: pytest.MonkeyPatch, activations: int
) -> None:
    """The made-up step's own KV cache is dropped once it ran, and the real cache takes its
    place: only the step's activations (and what stays allocated) count against the cache's
    budget. Before, the made-up cache (a ``max_model_len`` of tokens) was counted too."""
    fake = FakeAllocator(allocated=50_000_000)  # the weights
    fake.install(monkeypatch)
    per_page = 98_304 * 16  # qwen3-30b-a3b's K and V of a 16-token page
    shapes: list[tuple[int, int, int]] = []

    def run_step(num_seqs: int, num_tokens: int, pages_per_seq: int) -> int:
        shapes.append((num_seqs, num_tokens, pages_per_seq))
        cache = num_seqs * pages_per_seq * per_page
        fake.take(cache)
        fake.take(activations)  # the forward's temporaries, freed at its end
        fake.take(-activations)
        return cache

    config = EngineConfig(
        model="dummy:qwen3-30b-a3b", max_model_len=4096, max_num_batched_tokens=4096
    )
    peak = profile_peak_memory(config, torch.device("cuda"), 16, 4096, run_step)
    assert shapes == [(1, 4096, 256)]
    assert peak == activations
