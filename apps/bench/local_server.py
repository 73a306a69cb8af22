"""A server process on this machine: a free loopback port, and the wait for ``GET /health``.

``pitstop bench --peer vllm`` (``vllm serve``), the soak (``benchmarks/soak.py``)
and the tests' ``pitstop serve`` subprocesses all start a server and poll its
``/health`` until it answers 200, giving up when the process exits or a
start-up time passes. :func:`wait_healthy` is that loop; each caller turns
its two exceptions into its own message (with the server's log). :func:`stop`
ends a server started as one process (``vllm serve``, which starts children,
is stopped by its group: :func:`pitstop.bench.vllm_peer.stop_process`).
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request

HOST = "127.0.0.1"


class ServerExited(RuntimeError):
    """The server process ended before ``/health`` answered 200 (``returncode`` says how)."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"the server exited with status {returncode} before /health answered")
        self.returncode = returncode


class ServerStartTimeout(TimeoutError):
    """``/health`` did not answer 200 within the start-up time."""


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def health(url: str, timeout: float = 2.0) -> bool:
    """Whether ``GET url/health`` answers 200 now (no proxy: the server is local)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(
    url: str, process: subprocess.Popen, *, timeout_s: float, poll_s: float = 0.1
) -> float:
    """Wait until ``GET url/health`` answers 200; return the seconds waited.

    Raises :class:`ServerExited` when ``process`` ends first and
    :class:`ServerStartTimeout` after ``timeout_s`` seconds.
    """
    start = time.monotonic()
    while True:
        code = process.poll()
        if code is not None:
            raise ServerExited(code)
        if health(url):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise ServerStartTimeout(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
        time.sleep(poll_s)


def stop(process: subprocess.Popen, grace_s: float) -> None:
    """End ``process`` if it still runs: SIGTERM, then SIGKILL after ``grace_s`` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
