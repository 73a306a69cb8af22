"""``benchmarks/gpu_busy.py`` (issue 44): where the device sits idle between kernels.

The idle report must charge each gap to the kernels around it, skip overlapping kernels
(a kernel that starts before the latest end so far leaves no gap) and keep the device's own
launch spacing apart from the gaps worth a look."""

from __future__ import annotations

from helpers.scripts import benchmark_script


def test_idle_gaps_are_charged_to_the_kernels_around_them() -> None:
    busy = benchmark_script("gpu_busy")
    events = [
        (0.0, 10.0, "gemm"),
        (2.0, 3.0, "inside"),  # within gemm: no gap, and gemm stays the kernel before
        (10.5, 5.0, "norm"),  # 0.5 µs after gemm: launch spacing
        (20.0, 5.0, "attn"),  # 4.5 µs after norm
        (21.0, 2.0, "overlap"),  # starts inside attn
        (40.0, 1.0, "gemm"),  # 15 µs after attn (its end, not overlap's)
        (100.0, 1.0, "norm"),  # a second step: 59 µs after gemm
    ]
    rows = busy.idle_gaps(events, steps=2, top=5)
    assert rows[0].startswith("|   | idle between kernels | 39.5 us/step")
    assert "gaps of 1 us or less: 0.2 us/step, 0.5 a step" in rows[0]
    assert rows[1:] == [
        "|   | idle 29.5 us/step | 0.50 a step | `gemm` -> `norm` |",
        "|   | idle 7.5 us/step | 0.50 a step | `attn` -> `gemm` |",
        "|   | idle 2.2 us/step | 0.50 a step | `norm` -> `attn` |",
    ]
