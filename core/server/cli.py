"""``pitstop serve MODEL``: the OpenAI-compatible HTTP server.

Found by :mod:`pitstop.cli`, which calls :func:`add_subcommand`. The web
libraries are imported only when the command runs, so ``pitstop`` works
without them (``pip install 'pitstop[serve]'`` adds them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from types import FrameType
from typing import Any

from pitstop.config import EngineConfig, add_cli_flags

log = logging.getLogger(__name__)


def add_subcommand(subparsers: Any) -> None:
    """Add ``serve`` to the ``pitstop`` command."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over OpenAI's completions and chat API, with /health and /metrics.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="'smollm2-135m', a .gguf file, a Hugging Face folder or 'dummy:<preset>' (or set it in --config)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("PITSTOP_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PITSTOP_API_KEY; unset: no auth)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body; larger gets 413 (default 1 MiB)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="model name clients send (default: MODEL)"
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM, seconds running requests may finish before they are aborted (default 10)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's own log level (default warning)",
    )
    add_cli_flags(p, with_model=False)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGINT/SIGTERM; exit 0 after a graceful shutdown."""
    try:
        import uvicorn
    except ModuleNotFoundError as exc:
        raise SystemExit(f"pitstop serve needs {exc.name}: pip install 'pitstop[serve]'") from exc

    from pitstop.async_engine import AsyncLLM
    from pitstop.errors import ConfigError
    from pitstop.server.app import ServerSettings, create_app

    if args.max_body_bytes <= 0:
        raise ConfigError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    if args.drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    config = EngineConfig.from_cli(args)
    settings = ServerSettings(
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        served_model_name=args.served_model_name,
        drain_timeout_s=args.drain_timeout,
    )
    llm = AsyncLLM.from_config(config)
    app = create_app(llm, settings)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=int(args.drain_timeout) + 5,
        lifespan="on",
    )
    server = _build_server(uv_config, llm, args.drain_timeout)
    log.info(
        "serving %s on http://%s:%d (auth %s)",
        settings.served_model_name or config.model,
        args.host,
        args.port,
        "on" if settings.api_key else "off",
    )
    server.run()
    llm.close()  # normally a no-op: the app's shutdown already joined the engine
    log.info("stopped")
    return 0


def _build_server(config: Any, llm: Any, drain_timeout: float) -> Any:
    """uvicorn's server, with a shutdown that drains the engine and exits 0.

    uvicorn re-raises a captured SIGTERM after its own shutdown, which would
    end the process with status -15. This server takes the signal itself: it
    stops the listener (uvicorn's shutdown), tells the engine to finish what
    runs within the drain timeout and abort the rest (so open streams end
    with a final chunk and ``[DONE]``), and lets ``run`` return.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(config)
            self._loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            grace = drain_timeout
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting
                grace = 0.0
            else:
                log.info("signal %d: stop accepting, drain for up to %.1f s", sig, drain_timeout)
                self.should_exit = True
            loop = self._loop
            if loop is not None and not loop.is_closed():
                # not from the signal handler itself: the loop thread may hold the engine's lock
                loop.call_soon_threadsafe(llm.begin_shutdown, grace)
            else:
                llm.begin_shutdown(grace)

    return DrainingServer()
