"""The HTTP layer's settings: what ``pitstop serve`` needs besides the engine."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class ServerSettings:
    """What the HTTP layer needs besides the engine (the flags of ``pitstop serve``)."""

    api_key: str | None = None  # every /v1 route then needs "Authorization: Bearer KEY"
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # more accepted keys
    max_body_bytes: int = 1 << 20
    served_model_name: str | None = None  # default: the engine's model setting
    served_model_aliases: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # more names
    # --lora-modules: (name, path) of each adapter served as a model name (needs --enable-lora)
    lora_modules: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=tuple)
    drain_timeout_s: float = 10.0  # on shutdown, how long running requests may finish before abort
    allowed_hosts: tuple[str, ...] | None = None  # None: no Host check ("*" too)
    allowed_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # "*": any
    max_json_depth: int = 32  # nesting of arrays and objects in a body
    read_timeout_s: float = 30.0  # to receive a whole request (headers and body)
    max_connections: int = 1024  # open TCP connections; more get 429
    max_queued_requests: int = 1024  # requests waiting for a place in the batch; more get 429
    max_requests_per_client: int | None = None  # open requests per API key (or address)
    # Costs in tokens (prompt tokens x n + max_tokens x n, limits.request_cost):
    max_queued_tokens: int | None = 1 << 20  # of the requests waiting; more get 429
    max_tokens_per_client: int | None = None  # of a client's open requests; more get 429
    max_n: int = 16  # samples per prompt (n); more get 400 (n=128 x 1 token stalled others)
    max_prompts_per_request: int = 64  # prompts in one completions list; more get 400
    retry_after_s: int = 1  # the Retry-After of a 429
    step_grace_s: float = 2.0  # after the drain, how long the engine may take to abort
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # a tool_parser plugin's name (hermes, llama3_json)
    # A request's chat_template runs only when trusted, and then in a sandbox process bounded by
    # these (apps/server/template_sandbox.py)
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = 2.0  # wall time of one render, the worker's start excluded
    chat_template_memory_bytes: int = 256 << 20  # the sandbox's memory beyond its imports
    max_logprobs: int = 20  # the most logprobs / top_logprobs / prompt_logprobs a request asks
    max_response_bytes: int = 32 << 20  # one request's answer (every choice, chunk or JSON)
    special_tokens_in_content: str = "text"  # "tokens": message text may write special tokens
    grammar_at_start: bool = False  # build the structured-output tokenizer before serving
    # the rollout endpoints (docs/rl.md), off unless asked for, as vLLM keeps them behind a flag:
    enable_sleep_mode: bool = False  # POST /sleep, /wake_up, GET /is_sleeping (+ engine regions)
    enable_weight_updates: bool = False  # POST /update_weights_from_disk

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: no authentication)."""
        return tuple(k for k in (self.api_key, *self.api_keys) if k)
