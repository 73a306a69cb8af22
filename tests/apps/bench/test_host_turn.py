"""``benchmarks/host_turn.py`` (issue 44): the engine's host time a step without a device.

Its runner stand-in must keep the engine's loop honest: every sequence decodes one token a
step and finishes at its ``max_tokens``, with nothing left held."""

from __future__ import annotations

from pathlib import Path

from helpers.scripts import benchmark_script


def test_the_stand_in_runner_drives_every_sequence_to_its_length(tmp_path: Path) -> None:
    turn = benchmark_script("host_turn")
    engine = turn.engine_for(turn.tiny_model(tmp_path), seqs=8, steps=6)
    assert engine.scheduler.num_running == 8
    finished = []
    for _ in range(40):
        finished += engine.step(stream=False)
        if not engine.has_unfinished_requests():
            break
    finished += engine.drain()
    assert sorted(o.request_id for o in finished) == sorted(f"r{i}" for i in range(8))
    assert all(len(o.outputs[0].token_ids) == 6 + 8 for o in finished)  # max_tokens = steps + 8
    stats = engine.allocator.stats()
    assert stats.tokens_held == 0 and stats.pages_free == stats.num_pages, "every page back"
