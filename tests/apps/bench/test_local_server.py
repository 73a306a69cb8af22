"""The one wait for a local server's ``/health`` (vllm serve, the soak, the tests' servers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.bench.local_server import (
    ServerExited,
    ServerStartTimeout,
    free_port,
    health,
    wait_healthy,
)


def test_waits_for_health_then_returns(tmp_path: Path) -> None:
    (tmp_path / "health").write_text("ok")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "-d", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        assert wait_healthy(url, proc, timeout_s=30, poll_s=0.05) < 30
        assert health(url)
    finally:
        proc.terminate()
        proc.wait(10)
    assert not health(url)


def test_a_process_that_exits_is_server_exited() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(ServerExited) as exc:
        wait_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=30, poll_s=0.05)
    assert exc.value.returncode == 3


def test_no_answer_in_time_is_a_timeout() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(ServerStartTimeout, match="within 0 s"):
            wait_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=0.3, poll_s=0.05)
    finally:
        proc.kill()
        proc.wait(10)
