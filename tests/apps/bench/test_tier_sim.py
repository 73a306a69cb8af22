"""``benchmarks/tier_sim.py`` (issue 50): the ``multiturn`` turns replayed through the
``tiered`` allocator on the CPU, with copies that end at once and copies that stay in
flight for two steps (a GPU's): the same hits and the same bytes either way, each page
saved once (duplicates of in-flight saves once cost the H200 run a third of its hits)."""

from __future__ import annotations

from helpers.scripts import benchmark_script


def test_late_copies_change_neither_hits_nor_bytes(capsys) -> None:
    sim = benchmark_script("tier_sim")
    prompt_only = sim.replay(240, host_gib=64, late=False)
    late = sim.replay(240, host_gib=64, late=True)
    assert late == prompt_only
    assert 0.5 < late["hit_rate"] < 1.0  # the conversations come back from the host
    small = sim.replay(240, host_gib=1, late=True)  # a host tier far too small: few hits
    assert small["hit_rate"] < late["hit_rate"]
    assert sim.main(["--num-requests", "24", "--late"]) == 0
    assert "hit rate" in capsys.readouterr().out


def test_the_replay_runs_as_many_conversations_at_once_as_the_driver() -> None:
    """720 turns are 30 groups of conversations for 16 clients: run all at once (the replay
    before 2026-12-07), each conversation's next turn came after more history than the host
    tier holds (24.7% hits); the driver's 16 clients keep the hits of a short run."""
    sim = benchmark_script("tier_sim")
    short = sim.replay(240, host_gib=64, late=False)
    long = sim.replay(720, host_gib=64, late=False)
    assert long["gib_to_host"] > 64  # the host tier filled and evicted
    assert abs(long["hit_rate"] - short["hit_rate"]) < 0.02
