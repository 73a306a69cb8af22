"""Timing kernels as an engine runs them: replays of one CUDA graph.

A decode step replays a captured graph, so a kernel's launch gaps and host time are not part
of its cost there; timing it eagerly would count them. :func:`graph_seconds` captures the
given calls once (after running each eagerly on a side stream, which compiles and warms it)
and returns the
median time of a call over ``replays`` replays. Give each call its own buffers when the
kernel reads more than the L2 holds in a real step (a replay then reads from memory, not
from the L2 the previous call left warm).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch


def graph_seconds(calls: Sequence[Callable[[], Any]], replays: int = 20) -> float:
    """Median seconds per call of ``calls``, replayed from one CUDA graph (CUDA only)."""
    if not calls:
        raise ValueError("graph_seconds needs at least one call to time")
    # compile and warm up outside the capture, on a side stream (as torch advises before a
    # capture: libraries such as cuBLAS set up their state there, not in the graph)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times) / len(calls)
