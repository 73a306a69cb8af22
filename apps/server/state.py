"""What every route reads: the engine, the settings and the server's bookkeeping, in one object.

:func:`~pitstop.server.app.create_app` builds one :class:`AppState` and puts
it on ``app.state.app_state``; the routes receive it through the
:func:`~pitstop.server.deps.app_state` dependency instead of closing over
variables.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import attrs

from pitstop.entrypoints.async_engine import AsyncLLM
from pitstop.entrypoints.lora_request import LoRARequest
from pitstop.errors import ConfigError, PluginError
from pitstop.plugin_system.protocols import ToolParser
from pitstop.server.limits import ServerState
from pitstop.server.metrics import ServerMetrics
from pitstop.server.protocol import APIError, clip, now
from pitstop.server.settings import ServerSettings
from pitstop.server.template_sandbox import TemplateSandbox


@attrs.define(kw_only=True)
class AppState:
    """One server's engine, settings, names, metrics and admission state."""

    llm: AsyncLLM
    settings: ServerSettings
    model_name: str  # the name the server answers to and reports
    model_names: tuple[str, ...]  # the names a request may give: model_name, then its aliases
    adapters: dict[str, Any]  # --lora-modules: adapter name -> its LoRARequest
    adapter_ids: Iterator[int]  # the next adapters' lora_int_id (never reused)
    metrics: ServerMetrics
    server: ServerState
    keys: tuple[bytes, ...]  # the accepted API keys' bytes (empty: no authentication)
    vocab_size: int
    tool_parser: ToolParser | None
    started: int  # when the server started (a model card's ``created``)
    # request chat templates (--trust-request-chat-template): the sandbox, and the one slot
    # that lets one render run at a time (pitstop.server.template_sandbox)
    template_sandbox: TemplateSandbox | None = None
    template_slot: asyncio.Semaphore = attrs.field(factory=lambda: asyncio.Semaphore(1))

    @classmethod
    def build(cls, llm: AsyncLLM, settings: ServerSettings) -> AppState:
        """The state of a server of ``llm``; a tool-call setting that cannot work is a PluginError."""
        model_name = settings.served_model_name or llm.config.model
        if settings.lora_modules and llm.config.adapter is None:
            raise ConfigError("--lora-modules needs --enable-lora (an adapter plugin)")
        return cls(
            llm=llm,
            settings=settings,
            model_name=model_name,
            model_names=tuple(dict.fromkeys((model_name, *settings.served_model_aliases))),
            adapters={
                name: LoRARequest(name, i + 1, path)
                for i, (name, path) in enumerate(settings.lora_modules)
            },
            adapter_ids=itertools.count(len(settings.lora_modules) + 1),
            metrics=ServerMetrics(llm, model_name),
            server=ServerState(
                llm,
                max_queued_requests=settings.max_queued_requests,
                max_requests_per_client=settings.max_requests_per_client,
                retry_after_s=settings.retry_after_s,
                step_grace_s=settings.step_grace_s,
                max_queued_tokens=settings.max_queued_tokens,
                max_tokens_per_client=settings.max_tokens_per_client,
            ),
            keys=tuple(k.encode("utf-8") for k in settings.keys),
            vocab_size=llm.engine.model_config.vocab_size,
            tool_parser=_tool_parser(llm, settings),
            started=now(),
            template_sandbox=TemplateSandbox(
                timeout_s=settings.chat_template_timeout_s,
                memory_bytes=settings.chat_template_memory_bytes,
            )
            if settings.trust_request_chat_template
            else None,
        )

    @property
    def max_model_len(self) -> int | None:
        """The engine's ``max_model_len`` setting."""
        return self.llm.config.max_model_len

    def check_model(self, name: str | None, *, required: bool = True) -> None:
        """The request's ``model``: exactly one of the served names (``/v1/models`` lists
        them), else 404 ``model_not_found``; missing or empty on a generation route, 400
        (OpenAI and vLLM answer alike)."""
        if not name and required:
            raise APIError(
                400,
                f"model is required; this server serves {self.model_name!r}: send "
                f'"model": "{self.model_name}"',
                param="model",
                code="model_required",
            )
        if name and name not in self.model_names and name not in self.adapters:
            served = ", ".join(repr(n) for n in (*self.model_names, *self.adapters))
            raise APIError(
                404,
                f"the model {clip(name)} does not exist; this server serves {served} "
                "(GET /v1/models lists them)",
                param="model",
                code="model_not_found",
            )

    def answer_name(self, name: str | None) -> str:
        """The model name an answer carries: the adapter's when the request named one."""
        return name if name and name in self.adapters else self.model_name

    def check_chat_template(self, template: str | None, kwargs: dict[str, Any] | None) -> None:
        """Refuse a request's own chat template (400) unless the server trusts them."""
        given = "chat_template" if template is not None else None
        if given is None and kwargs and "chat_template" in kwargs:
            given = "chat_template_kwargs.chat_template"
        if given is None or self.template_sandbox is not None:
            return
        raise APIError(
            400,
            f"{given}: this server does not run chat templates sent in requests (a template "
            "is a program); leave it out to use the model's own template, or start the "
            "server with --trust-request-chat-template",
            param=given.split(".", 1)[0],
            code="chat_template_not_trusted",
        )

    def tokenizer_or_400(self) -> Any:
        """The engine's tokenizer; a 400 when the model has none."""
        tok = self.llm.engine.tokenizer
        if tok is None:
            raise APIError(
                400, f"the model {self.model_name!r} has no tokenizer", code="no_tokenizer"
            )
        return tok

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """A served model name's card, as ``GET /v1/models`` lists it (default: the first);
        an adapter's has its path as ``root`` and the model as ``parent`` (as vLLM's)."""
        adapter = self.adapters.get(name or "")
        if adapter is not None:
            return {
                "id": name,
                "object": "model",
                "created": self.started,
                "owned_by": "pitstop",
                "root": adapter.lora_path,
                "parent": self.model_name,
                "max_model_len": self.max_model_len,
            }
        return {
            "id": name or self.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "pitstop",
            "root": self.llm.config.model,
            "max_model_len": self.max_model_len,
        }


def _tool_parser(llm: AsyncLLM, settings: ServerSettings) -> ToolParser | None:
    """The tool-call parser the settings name, or None; auto tool choice needs one."""
    if settings.tool_call_parser is not None:
        return llm.engine.plugins.create(
            "tool_parser", settings.tool_call_parser, llm.engine.tokenizer
        )
    if settings.enable_auto_tool_choice:
        raise PluginError(
            "--enable-auto-tool-choice needs --tool-call-parser NAME (the format the model "
            "writes its calls in: " + ", ".join(llm.engine.plugins.names("tool_parser")) + ")"
        )
    return None
