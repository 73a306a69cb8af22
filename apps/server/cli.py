"""``pitstop serve MODEL``: the OpenAI-compatible HTTP server.

Registered through the ``register_commands`` hook (entry point ``commands-serve``). The web
libraries are imported only when the command runs, so ``pitstop`` works
without them (``pip install 'pitstop[serve]'`` adds them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from pitstop.entrypoints.engine_args import add_cli_flags, config_from_cli
from pitstop.plugin_system.hookspecs import hookimpl

if TYPE_CHECKING:
    from pitstop.server.settings import ServerSettings

log = logging.getLogger(__name__)


def _names(text: str) -> list[str]:
    """A comma-separated flag value as a list (``--allowed-origins a,b``)."""
    return [part.strip() for part in text.split(",") if part.strip()]


@hookimpl
def register_commands(register: Any) -> None:
    """Register ``pitstop serve``."""
    register(
        "serve",
        add_arguments,
        cmd_serve,
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over OpenAI's completions and chat API, with /health and /metrics.",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``pitstop serve``'s flags: the model, the server's own, then every engine flag."""
    p.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="model",
        help="'smollm2-135m', a .gguf file, a Hugging Face folder or 'dummy:<preset>' (or "
        "--model, as vllm serve takes it, or set it in --config)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes; several keys after one flag "
        "(as vLLM's) or the flag repeated "
        "(default: $PITSTOP_API_KEY; unset: no auth)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body; larger gets 413 (default 1 MiB)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients send; the first is the one answers carry, all are listed "
        "by /v1/models; any other name is a 404 (default: MODEL)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served as model names (needs --enable-lora): NAME=PATH or vLLM's "
        'JSON {"name": ..., "path": ...}; /v1/models lists them with the model as parent '
        "(default: none; more load later through POST /v1/load_lora_adapter)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM, seconds running requests may finish before they are aborted (default 10)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_names,
        action="extend",
        default=None,
        metavar="ORIGIN[,ORIGIN]",
        help="web origins (https://app.example) whose pages may call the server; a request with "
        "any other Origin header gets 403; '*' allows all (default: none)",
    )
    g.add_argument(
        "--allowed-hosts",
        type=_names,
        action="extend",
        default=None,
        metavar="NAME[,NAME]",
        help="names the Host header may carry; others get 403 (DNS rebinding); '*' allows all "
        "(default: localhost, 127.0.0.1, ::1 when bound to loopback, else all)",
    )
    g.add_argument(
        "--max-json-depth",
        type=int,
        default=32,
        help="deepest nesting of arrays and objects in a request body; deeper gets 400 (default 32)",
    )
    g.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a whole request; slower gets 408 and is closed (default 30)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections; more get 429 with Retry-After (default 1024)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting for a place in the running batch; more get 429 (default 1024)",
    )
    g.add_argument(
        "--max-requests-per-client",
        type=int,
        default=0,
        help="open requests per API key (per client address without auth); more get 429; "
        "0: no cap (default 0)",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=int,
        default=1 << 20,
        help="cost in tokens (prompt tokens x n + max_tokens x n) of the requests waiting for a "
        "place in the batch; more get 429, one request costing more alone 400; 0: no budget "
        "(default 1048576)",
    )
    g.add_argument(
        "--max-tokens-per-client",
        type=int,
        default=0,
        help="cost in tokens of one client's open requests (as --max-requests-per-client counts "
        "them); more get 429, one request costing more alone 400; 0: no budget (default 0)",
    )
    g.add_argument(
        "--max-n",
        type=int,
        default=16,
        help="most samples per prompt (n) a request may ask for; more get 400 (default 16)",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=64,
        help="most prompts in one /v1/completions list; more get 400 (default 64)",
    )
    t = p.add_argument_group("tool calling")
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when tools are sent), read by the '
        '--tool-call-parser; without it, tools default to "none" and "auto" is a 400',
    )
    t.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="the format the model writes tool calls in: a tool_parser plugin "
        "(hermes, llama3_json, or a third party's; pitstop plugins lists them); "
        'default none: tool_choice "auto" is refused',
    )
    r = p.add_argument_group("reinforcement learning (docs/rl.md)")
    r.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="allocate the weights and KV cache so that POST /sleep can free them; serve "
        "POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping, POST /reset_prefix_cache "
        "(behind the API key; default off: those routes answer 404)",
    )
    r.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="serve POST /update_weights_from_disk and POST /reset_prefix_cache (behind the "
        "API key; default off: 404)",
    )
    c = p.add_argument_group("chat requests")
    c.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run a chat_template sent in a request (vLLM's flag); it is rendered in a sandbox "
        "process bounded in time and memory. Without it such a request is a 400",
    )
    c.add_argument(
        "--chat-template-timeout",
        type=float,
        default=2.0,
        help="seconds one request chat_template may render before it is stopped (400) (default 2)",
    )
    c.add_argument(
        "--special-tokens-in-content",
        choices=("text", "tokens"),
        default="text",
        help="special-token text written in messages (<|im_start|>...): 'text' keeps it as "
        "text, so a message cannot forge another role (OpenAI's behaviour); 'tokens' reads it "
        "as the special tokens (vLLM's); a request may choose with the field of that name "
        "(default text)",
    )
    g.add_argument(
        "--max-response-bytes",
        type=int,
        default=32 << 20,
        help="bytes of one request's answer (every choice; JSON or all its stream chunks); a "
        "request that reaches it is ended with code response_too_large (default 32 MiB)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's own log level (default warning)",
    )
    add_cli_flags(p)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The server settings of the ``serve`` flags; an invalid value is a ConfigError."""
    from pitstop.errors import ConfigError
    from pitstop.server.security import bind_host, default_allowed_hosts, host_patterns
    from pitstop.server.settings import ServerSettings

    try:
        args.host = bind_host(args.host)  # cmd_serve listens on the checked address
        host_patterns(args.allowed_hosts or ())  # checked now, not at the first request
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    for flag, value, low in (
        ("--max-body-bytes", args.max_body_bytes, 1),
        ("--max-json-depth", args.max_json_depth, 2),
        ("--max-connections", args.max_connections, 1),
        ("--max-queued-requests", args.max_queued_requests, 1),
        ("--max-requests-per-client", args.max_requests_per_client, 0),
        ("--max-queued-tokens", args.max_queued_tokens, 0),
        ("--max-tokens-per-client", args.max_tokens_per_client, 0),
        ("--max-n", args.max_n, 1),
        ("--max-prompts-per-request", args.max_prompts_per_request, 1),
        ("--max-response-bytes", args.max_response_bytes, 1024),
    ):
        if value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}")
    if not args.drain_timeout >= 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not args.chat_template_timeout > 0:
        raise ConfigError(
            f"--chat-template-timeout must be > 0 seconds, got {args.chat_template_timeout}"
        )
    if not args.read_timeout > 0:
        raise ConfigError(f"--read-timeout must be > 0 seconds, got {args.read_timeout}")
    keys = args.api_key if args.api_key is not None else [os.environ.get("PITSTOP_API_KEY", "")]
    keys = [k for k in keys if k]
    for k in keys:
        if not k.isascii() or not k.isprintable() or " " in k:
            raise ConfigError(
                "an API key must be printable ASCII without spaces (it travels in an HTTP header)"
            )
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ConfigError(
            "--enable-auto-tool-choice needs --tool-call-parser NAME (hermes, llama3_json, or "
            "a plugin's): the format in which the model writes its calls"
        )
    if args.tool_call_parser:
        from pitstop.plugin_system.plugin_manager import get_plugin_manager

        get_plugin_manager().get("tool_parser", args.tool_call_parser)  # lists the names there are
    hosts = args.allowed_hosts
    names = list(dict.fromkeys(args.served_model_name or ()))
    if any(not n.strip() for n in names):
        raise ConfigError("--served-model-name takes non-empty names")
    return ServerSettings(
        api_keys=tuple(keys),
        max_body_bytes=args.max_body_bytes,
        served_model_name=names[0] if names else None,
        served_model_aliases=tuple(names[1:]),
        lora_modules=lora_modules(args.lora_modules or ()),
        drain_timeout_s=args.drain_timeout,
        allowed_hosts=tuple(hosts) if hosts else default_allowed_hosts(args.host),
        allowed_origins=tuple(args.allowed_origins or ()),
        max_json_depth=args.max_json_depth,
        read_timeout_s=args.read_timeout,
        max_connections=args.max_connections,
        max_queued_requests=args.max_queued_requests,
        max_requests_per_client=args.max_requests_per_client or None,
        max_queued_tokens=args.max_queued_tokens or None,
        max_tokens_per_client=args.max_tokens_per_client or None,
        max_n=args.max_n,
        max_prompts_per_request=args.max_prompts_per_request,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_timeout_s=args.chat_template_timeout,
        special_tokens_in_content=args.special_tokens_in_content,
        max_response_bytes=args.max_response_bytes,
        grammar_at_start=True,
        enable_sleep_mode=args.enable_sleep_mode,
        enable_weight_updates=args.enable_weight_updates,
    )


def model_from_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the model given as ``serve MODEL`` or ``serve --model MODEL`` (vLLM's
    spelling) in ``args.model``; two different models are a ConfigError."""
    from pitstop.errors import ConfigError

    positional, flag = getattr(args, "model_positional", None), getattr(args, "model", None)
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(
            f"two models given: {positional!r} (positional) and --model {flag!r}; give one"
        )
    args.model = flag or positional
    return args


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGINT/SIGTERM; exit 0 after a graceful shutdown."""
    try:
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as exc:
        raise SystemExit(f"pitstop serve needs {exc.name}: pip install 'pitstop[serve]'") from exc

    from pitstop.entrypoints.async_engine import AsyncLLM
    from pitstop.server.app import create_app

    settings = settings_from_args(args)
    config = config_from_cli(model_from_args(args))
    llm = AsyncLLM.from_config(config, enable_sleep_mode=settings.enable_sleep_mode)
    app = create_app(llm, settings)
    server = build_server(
        app, settings, host=args.host, port=args.port, log_level=args.uvicorn_log_level
    )
    log.info(
        "serving %s on http://%s:%d (auth %s; hosts %s; origins %s)",
        settings.served_model_name or config.model,
        args.host,
        args.port,
        f"on, {len(settings.keys)} key(s)" if settings.keys else "off",
        ", ".join(settings.allowed_hosts) if settings.allowed_hosts else "any",
        ", ".join(settings.allowed_origins) or "none",
    )
    server.run()
    if not llm.join(0.0):  # the app's shutdown already waited for it, if it could end
        # A step still runs (the drain already answered every client): do not wait for it.
        log.warning("stopped; the engine thread is still in a step, exiting without it")
    else:
        log.info("stopped")
    _exit_now(0)
    return 0  # not reached


def _exit_now(code: int) -> None:
    """End the process at once, once every client has its answer and the logs are flushed.

    The interpreter's own teardown (finalizing torch, the engine's tensors and threads)
    takes about 2 s on 2 cores, which would push the exit past the documented drain +
    step grace; nothing of the server's needs it (no atexit work of ours, files closed)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def build_server(
    app: Any, settings: ServerSettings, *, host: str, port: int, log_level: str = "warning"
) -> Any:
    """uvicorn's server for ``app``, with the connection guard and the documented shutdown.

    On SIGTERM/SIGINT the listener stays open while the server drains
    (:class:`~pitstop.server.limits.ServerState`: ``/health`` answers 503,
    open requests finish or are ended with a final chunk and ``[DONE]``);
    then uvicorn stops and ``run`` returns, so the process exits 0 (uvicorn
    would re-raise the signal and die of it). A second signal ends the
    drain at once. Signals are only caught when ``run`` is called from the
    main thread; elsewhere (tests) call :meth:`begin_drain` on the server.
    """
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from pitstop.server.guard import ConnectionLimits, guarded_protocol
    from pitstop.server.metrics import failure_reason

    state = app.state.server
    metrics = app.state.metrics
    limits = ConnectionLimits(
        read_timeout_s=settings.read_timeout_s,
        max_connections=settings.max_connections,
        retry_after_s=settings.retry_after_s,
        on_reject=lambda status, _code: metrics.observe_request_failure(failure_reason(status)),
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(AutoHTTPProtocol, limits),
        timeout_graceful_shutdown=3,  # the drain has already ended every request
        lifespan="on",
    )

    class DrainingServer(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(config)
            self.limits = limits
            self._loop: asyncio.AbstractEventLoop | None = None
            self._signals = 0

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            state.on_drained.append(self._drained)
            await super().serve(sockets)

        def _drained(self) -> None:
            self.should_exit = True

        def begin_drain(self, grace_s: float | None = None) -> None:
            """Start the drain (thread-safe); a second call ends it at once."""
            self._signals += 1
            grace = settings.drain_timeout_s if grace_s is None else grace_s
            if self._signals > 1:
                grace = 0.0
            loop = self._loop
            if loop is None or loop.is_closed():
                self.should_exit = True
                return
            # Not from the signal handler itself: the handler interrupts the loop thread
            # anywhere, so the drain starts as a callback of the loop.
            loop.call_soon_threadsafe(state.begin_drain, grace)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            log.info("signal %d: %s", sig, "draining" if not self._signals else "ending now")
            self.begin_drain()

    return DrainingServer()


def lora_modules(values: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``--lora-modules`` values (``NAME=PATH`` or vLLM's JSON ``{"name", "path"}``) as
    (name, path) pairs; a malformed one, or a name given twice, is a ConfigError."""
    import json

    from pitstop.errors import ConfigError

    pairs: list[tuple[str, str]] = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                name, path = str(item["name"]), str(item["path"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"--lora-modules {value!r}: {exc}") from exc
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ConfigError(f"--lora-modules takes NAME=PATH (or JSON), got {value!r}")
        if not name.strip() or not path.strip():
            raise ConfigError(f"--lora-modules {value!r}: the name and the path must be non-empty")
        if name in dict(pairs):
            raise ConfigError(f"--lora-modules names {name!r} twice")
        pairs.append((name, path))
    return tuple(pairs)
