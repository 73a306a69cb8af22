"""What the kernels decide by timing (:mod:`pitstop.plugins.kernels.triton_ops.tuning`): the
JSON store of decisions (CPU), and the timing itself (GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pitstop.plugins.kernels.triton_ops import tuning  # noqa: E402


def test_json_store_keeps_every_key_and_survives_a_bad_file(tmp_path: Path) -> None:
    """Writes add to what is there (re-read first); an unreadable file reads as empty and is
    rewritten whole at the next write."""
    store = tuning.JsonStore(tmp_path / "sub", "t.json")
    assert store.read() == {}
    store.write("a", [1, 2])
    tuning.JsonStore(tmp_path / "sub", "t.json").write("b", 3)
    assert store.read() == {"a": [1, 2], "b": 3}
    (tmp_path / "sub" / "t.json").write_text("{not json")
    assert store.read() == {}
    store.write("c", 4)
    assert json.loads((tmp_path / "sub" / "t.json").read_text()) == {"c": 4}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
def test_cold_median_times_each_run_after_a_read_of_more_than_l2() -> None:
    """A positive median for a 64 MB copy, replayed from a CUDA graph (``time_replays``), and
    the flush buffer made once a device, larger than the GPU's L2."""
    src = torch.ones(16 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    ms = tuning.time_replays(lambda: dst.copy_(src))
    assert 0 < ms < 100
    buffer = tuning._flush_buffer(torch.device("cuda", torch.cuda.current_device()))
    assert buffer.numel() * 4 == tuning.FLUSH_BYTES
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert tuning.FLUSH_BYTES > 4 * l2
    tuning.cold_median_ms(lambda: dst.copy_(src), warmup=1, rep=3)
    assert tuning._flush_buffer(buffer.device) is buffer
