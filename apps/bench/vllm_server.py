"""``vllm serve`` for ``pitstop bench online --peer vllm``: start it, wait for it, stop it.

:class:`VllmServer` starts ``python -P -m vllm.entrypoints.cli.main serve MODEL`` (the
``vllm`` command, found through the interpreter that has vLLM, so no ``bin/`` folder
has to be on ``PATH``) on a free loopback port with the flags of
:func:`pitstop.bench.vllm_peer.engine_args`, waits until ``GET /health`` answers 200,
and on leaving (a finished run, an error, Ctrl-C, SIGTERM) stops the server and every
process it started. A server that exits or does not answer within the start-up
timeout is a :class:`~pitstop.bench.vllm_peer.VllmPeerError` that quotes the end of
its log.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from pitstop.bench.local_server import (
    HOST,
    ServerExited,
    ServerStartTimeout,
    free_port,
    wait_healthy,
)
from pitstop.bench.vllm_peer import (
    VllmPeerError,
    log_tail,
    missing_module_hint,
    peer_python,
    start_process,
    stop_on_sigterm,
    stop_process,
    where,
)

ENV_START_TIMEOUT = "PITSTOP_VLLM_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 900.0  # torch.compile + CUDA graph capture take about a minute
POLL_S = 0.5


def serve_flags(args: dict[str, Any]) -> list[str]:
    """``vllm serve`` flags of ``LLM(...)``-style keyword arguments (``model`` excluded):
    ``max_num_seqs=64`` -> ``--max-num-seqs 64``; True -> ``--flag``; False ->
    ``--no-flag``; a dict or list -> its JSON; None -> nothing."""
    out: list[str] = []
    for key, value in args.items():
        if key == "model" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict | list):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def serve_argv(args: dict[str, Any], port: int, host: str = HOST) -> list[str]:
    """The command line that serves ``args["model"]`` on ``host:port``."""
    cmd = [peer_python(), "-P", "-m", "vllm.entrypoints.cli.main", "serve", str(args["model"])]
    return cmd + serve_flags(args) + ["--host", host, "--port", str(port)]


class VllmServer:
    """A ``vllm serve`` process for the duration of a ``with`` block (its URL in ``url``)."""

    def __init__(
        self,
        args: dict[str, Any],
        *,
        workdir: Path,
        log_path: Path,
        start_timeout_s: float | None = None,
    ) -> None:
        self.args = args
        self.workdir = workdir
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s or float(
            os.environ.get(ENV_START_TIMEOUT) or DEFAULT_START_TIMEOUT_S
        )
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.argv = serve_argv(args, self.port)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._sigterm = stop_on_sigterm()

    def __enter__(self) -> VllmServer:
        self._sigterm.__enter__()
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            start = time.monotonic()
            self.proc = start_process(self.argv, self.log_path, self.workdir)
            self._wait_healthy(start)
            self.startup_s = time.monotonic() - start
        except BaseException:
            self.stop()
            self._sigterm.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.stop()
        finally:
            self._sigterm.__exit__(exc_type, exc, tb)

    def stop(self) -> None:
        """Stop the server and its children (SIGTERM, then SIGKILL); safe to call twice."""
        if self.proc is not None:
            stop_process(self.proc)

    def _wait_healthy(self, start: float) -> None:
        assert self.proc is not None
        left = self.start_timeout_s - (time.monotonic() - start)
        try:
            wait_healthy(self.url, self.proc, timeout_s=left, poll_s=POLL_S)
        except ServerExited as exc:
            tail = log_tail(self.log_path)
            fix = missing_module_hint(tail)
            hint = f"; fix: {fix}" if fix else ""
            raise VllmPeerError(
                f"vllm serve ({where()}) exited with status {exc.returncode} before it answered "
                f"/health{hint}; the end of its log ({self.log_path}):\n{tail}"
            ) from None
        except ServerStartTimeout:
            raise VllmPeerError(
                f"vllm serve did not answer {self.url}/health within "
                f"{self.start_timeout_s:.0f} s (set {ENV_START_TIMEOUT} for more); the end of "
                f"its log ({self.log_path}):\n{log_tail(self.log_path)}"
            ) from None
