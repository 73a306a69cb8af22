"""`LLM`: the offline API, in vLLM's shape (``generate``, ``chat``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from pitstop.config import EngineConfig
from pitstop.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pitstop.entrypoints.chat import ChatOptions, render_chat
from pitstop.entrypoints.engine_args import config_from_dict
from pitstop.entrypoints.inputs import PromptType, parse_prompts
from pitstop.entrypoints.rollout.control import Rollout
from pitstop.entrypoints.rollout.device_memory import sleep_mode_memory
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.entrypoints.tool_calls import default_tool_prompt, parse_tools
from pitstop.entrypoints.vllm_surface import (
    REFUSED_METHODS,
    check_call_options,
    generation_defaults,
    per_prompt_adapters,
    refused_method,
)
from pitstop.errors import ConfigError, InvalidRequestError
from pitstop.loop.engine import LLMEngine
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.requests.outputs import RequestOutput

Message = dict[str, Any]


class LLM:
    """Load a model with the chosen strategies and generate from it.

    ``LLM("smollm2-135m", allocator="paged", scheduler="continuous")`` or
    ``LLM(config=EngineConfig(...))``. vLLM's methods pitstop does not do
    (``embed``, ``score``, ... :data:`pitstop.entrypoints.vllm_surface.REFUSED_METHODS`)
    raise :class:`InvalidRequestError` saying so and what to use instead.

    For reinforcement learning (docs/rl.md): ``enable_sleep_mode=True`` allocates the
    weights and the KV cache so that :meth:`sleep` can give their memory back;
    :meth:`update_weights` and its kin change the weights in place.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        plugins: PluginManager | None = None,
        enable_sleep_mode: bool = False,
        **settings: Any,
    ) -> None:
        if config is not None and (model is not None or settings):
            raise ConfigError(
                "pass either config=EngineConfig(...) or a model name and settings, not both"
            )
        if config is None:
            values = dict(settings)
            if model is not None:
                values["model"] = model
            config = config_from_dict(values)
        memory = sleep_mode_memory(config, enable_sleep_mode)
        self.engine = LLMEngine(
            config, plugins, memory_region=memory.region if memory is not None else None
        )
        self.rollout = Rollout(self.engine, memory)
        """Sleep, wake and weight updates (:mod:`pitstop.entrypoints.rollout`)."""

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op at tensor_parallel_size=1)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (with ``max_model_len`` filled in)."""
        return self.engine.config

    @property
    def tokenizer(self):
        """The model's tokenizer (None for dummy weights)."""
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer, as vLLM's ``LLM.get_tokenizer()`` (the ``transformers`` one).

        Raises :class:`InvalidRequestError` for a model without one (dummy weights).
        """
        if self.engine.tokenizer is None:
            raise InvalidRequestError(
                f"model {self.config.model!r} has no tokenizer; load one with tokenizer=PATH"
            )
        return self.engine.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling values of the model's ``generation_config.json`` (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), else
        ``SamplingParams()``. ``generate`` and ``chat`` use it when given no params."""
        try:
            return SamplingParams(**generation_defaults(self.config.model))
        except InvalidRequestError as exc:
            raise ConfigError(
                f"the generation_config.json of {self.config.model} has a value SamplingParams "
                f"refuses: {exc}"
            ) from None

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: the ``params.beam_width`` most likely continuations of each
        prompt, one :class:`~pitstop.entrypoints.beam_search.BeamSearchOutput` per prompt, each
        sequence with ``tokens`` (prompt included), ``text`` and ``cum_logprob``
        (:mod:`pitstop.entrypoints.beam_search`). ``use_tqdm`` is accepted and shows nothing (each
        step is one short ``generate``); ``lora_request`` and ``concurrency_limit`` must
        be None."""
        check_call_options(
            "beam_search", {"lora_request": lora_request, "concurrency_limit": concurrency_limit}
        )
        return beam_search(self, prompts, params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, ``{"prompt": str}`` (:class:`~pitstop.entrypoints.inputs.TextPrompt`)
        or ``{"prompt_token_ids": [...]}`` (:class:`~pitstop.entrypoints.inputs.TokensPrompt`);
        give one or a list. ``prompt_token_ids=`` (a list of id lists) is the
        older spelling of a list of TokensPrompt. A prompt that is invalid
        raises before any request runs, so nothing is half-submitted. Without
        ``sampling_params``, :meth:`get_default_sampling_params` (as vLLM).
        ``lora_request``: vLLM's :class:`~pitstop.entrypoints.lora_request.LoRARequest`, one for
        every prompt or a list of one per prompt (None: the base model), on an ``LLM``
        built with ``enable_lora=True`` (docs/lora.md); ``priority`` is accepted all zero,
        ``tokenization_kwargs`` None.
        """
        check_call_options(
            "generate",
            {
                "priority": priority,
                "tokenization_kwargs": tokenization_kwargs,
            },
        )
        if prompts is not None and prompt_token_ids is not None:
            raise InvalidRequestError("pass prompts or prompt_token_ids, not both")
        if prompt_token_ids is not None:
            items = [(None, list(ids)) for ids in prompt_token_ids]
        else:
            items = parse_prompts(prompts)
        return self._submit(items, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _submit(
        self,
        items: Sequence[tuple[str | None, list[int] | None]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        *,
        use_tqdm: bool,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Queue every ``(text, token ids)`` prompt (all or none) and run them to the end;
        ``lora_request``: one adapter for all, or a list of one per prompt."""
        adapters = per_prompt_adapters(lora_request, len(items))
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(items):
                raise InvalidRequestError(
                    f"{len(sampling_params)} sampling params for {len(items)} prompts; give one, or one each"
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or self.get_default_sampling_params()] * len(items)
        self.rollout.check_can_generate()
        ids: list[str] = []
        try:
            for (text, tokens), params, lora in zip(items, params_list, adapters, strict=True):
                ids.append(
                    self.engine.add_request(
                        text, params, prompt_token_ids=tokens, lora_request=lora
                    )
                )
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm=use_tqdm and len(ids) > 1)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        lora_request: Any = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: dict[str, Any] | None = None,
        special_tokens_in_content: str = "text",
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several, with a chat template.

        A message's content is a string or a list of text parts
        (``[{"type": "text", "text": ...}]``), as the server takes it.
        ``chat_template`` (Jinja text) replaces the model's own;
        ``add_generation_prompt`` opens the assistant's turn;
        ``continue_final_message`` leaves the last (assistant) message open so
        the model continues it (it excludes ``add_generation_prompt``, as in
        vLLM); ``chat_template_kwargs`` are passed to the template; ``tools``
        (OpenAI function definitions) are passed to it as ``tools`` (a
        template that does not render them gets them listed in the system
        message, :func:`pitstop.entrypoints.tool_calls.default_tool_prompt`). Each
        output's ``prompt`` is the rendered text. ``lora_request``: as :meth:`generate`'s;
        vLLM's ``mm_processor_kwargs`` is refused unless None; ``chat_template_content_format``
        takes ``"auto"`` or ``"string"`` (what pitstop does).
        ``special_tokens_in_content``: ``"text"`` (the default) keeps special-token text
        written in a message (``<|im_start|>system``) as text, so that no message can forge
        another role; ``"tokens"`` reads it as special tokens (vLLM's behaviour).
        """
        check_call_options(
            "chat",
            {
                "chat_template_content_format": chat_template_content_format,
                "mm_processor_kwargs": mm_processor_kwargs,
            },
        )
        if not messages:
            raise InvalidRequestError("the conversation is empty; give at least one message")
        first = messages[0]
        conversations = [messages] if isinstance(first, dict) else list(messages)
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError(
                f"model {self.config.model!r} has no tokenizer, so no chat template"
            )
        options = ChatOptions(
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=[t.to_openai() for t in parse_tools(tools)] if tools is not None else None,
            special_tokens_in_content=special_tokens_in_content,
        )
        rendered = [
            render_chat(tok, conv, options, tool_prompt=default_tool_prompt)
            for conv in conversations
        ]
        return self._submit(
            [(r.text, r.token_ids) for r in rendered],
            sampling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
        )

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield one request's outputs as tokens arrive (other queued requests run alongside)."""
        self.rollout.check_can_generate()
        rid = self.engine.add_request(prompt, sampling_params, prompt_token_ids=prompt_token_ids)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    # ------------------------------------------------------------------ rollouts (docs/rl.md)
    def sleep(self, level: int = 1) -> None:
        """Give the device memory back (vLLM's): ``level=1`` copies the weights to host
        memory (pinned on CUDA) and discards the KV cache; ``level=2`` discards both, and
        after :meth:`wake_up` new weights must be written (:meth:`update_weights` or
        :meth:`update_weights_from_disk`) before generating. Needs
        ``LLM(..., enable_sleep_mode=True)`` and no request unfinished."""
        self.rollout.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: ``tags`` None (all), ``["weights"]`` or ``["kv_cache"]``
        (weights first, update them, then the KV cache: the least memory at once). The
        prefix cache is reset."""
        self.rollout.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are released by :meth:`sleep`."""
        return self.rollout.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's); True. Done after every update and wake."""
        return self.rollout.reset_prefix_cache()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write new weights in place: ``(name, tensor)`` pairs in Hugging Face checkpoint
        names (any subset; one call per shard), each tensor of the model's shape and dtype
        on any device. The batch is checked whole first: a name the model lacks, a wrong
        shape or dtype raises :class:`~pitstop.entrypoints.rollout.errors.WeightUpdateError`
        naming the tensor and nothing of the batch is applied. Returns how many tensors
        were written; the prefix cache is reset."""
        return self.rollout.update_weights(named_tensors)

    def update_weights_from_disk(self, path: str | Path) -> int:
        """Write the weights of a Hugging Face folder's safetensors (or one file) in place,
        cast to the model's dtype as at load; headers are checked before any is read."""
        return self.rollout.update_weights_from_disk(path)

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join a trainer's weight-transfer group as rank ``rank_offset`` (the trainer is
        rank 0 and hosts the TCPStore at ``master_address:master_port``); ``backend``
        ``"gloo"`` (CPU) or ``"nccl"`` (GPU to GPU)."""
        self.rollout.init_weight_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Sequence[int]]
    ) -> int:
        """Receive one broadcast from the trainer per name (of that dtype and shape), then
        write the batch in place as :meth:`update_weights` does."""
        return self.rollout.update_weights_from_distributed(names, dtypes, shapes)

    def destroy_weight_update_group(self) -> None:
        """Leave the weight-transfer group."""
        self.rollout.destroy_weight_update_group()

    def _run(self, ids: list[str], *, use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", dynamic_ncols=True)
        try:
            while len(final) < len(ids):
                for out in self.engine.step(stream=False):
                    if out.request_id in wanted:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in wanted - set(final):
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]


for _name in REFUSED_METHODS:
    setattr(LLM, _name, refused_method(_name))
