"""Start a real ``pitstop serve`` subprocess for tests, and stop it afterwards."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_subprocess(
    args: list[str], env: dict[str, str], *, start_timeout: float
) -> Iterator[tuple[subprocess.Popen, str]]:
    """Run ``pitstop serve ARGS --port P``; yield (process, base URL) once ``/health`` answers.

    On exit a server still running is sent SIGTERM, then killed if it has not
    stopped within 10 s.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "pitstop.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {proc.returncode}:\n{proc.stdout.read()}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up within {start_timeout:.0f} s")
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
