"""Start a real ``pitstop serve`` subprocess for tests, and stop it afterwards."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

from pitstop.bench.local_server import (
    ServerExited,
    ServerStartTimeout,
    free_port,
    stop,
    wait_healthy,
)

__all__ = ["free_port", "serve_subprocess"]


@contextlib.contextmanager
def serve_subprocess(
    args: list[str], env: dict[str, str], *, start_timeout: float
) -> Iterator[tuple[subprocess.Popen, str]]:
    """Run ``pitstop serve ARGS --port P``; yield (process, base URL) once ``/health`` answers.

    On exit a server still running is sent SIGTERM, then killed if it has not
    stopped within 10 s.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "pitstop.entrypoints.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, timeout_s=start_timeout)
        except ServerExited as exc:
            raise RuntimeError(
                f"the server exited with {exc.returncode}:\n{proc.stdout.read()}"
            ) from None
        except ServerStartTimeout:
            raise RuntimeError(f"the server did not come up within {start_timeout:.0f} s") from None
        yield proc, url
    finally:
        stop(proc, grace_s=10)
