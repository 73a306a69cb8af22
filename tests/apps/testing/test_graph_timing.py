"""``pitstop.testing.timing``: kernels timed as the engine runs them, from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from pitstop.testing.timing import graph_seconds


def test_nothing_to_time_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one call"):
        graph_seconds([])


@pytest.mark.gpu
def test_on_the_gpu_a_copy_takes_about_its_bytes_over_the_bandwidth() -> None:
    """Two 256 MiB copies a replay, each on its own buffers: each call's time is a copy's, so
    its rate is within what any data-centre GPU moves (0.2 to 10 TB/s, read and written)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pairs = [
        (
            torch.empty(1 << 28, dtype=torch.uint8, device="cuda"),
            torch.empty(1 << 28, dtype=torch.uint8, device="cuda"),
        )
        for _ in range(2)
    ]
    seconds = graph_seconds([lambda p=p: p[1].copy_(p[0]) for p in pairs])
    rate = 2 * (1 << 28) / seconds
    assert 0.2e12 < rate < 10e12, f"{rate / 1e12:.2f} TB/s"
