"""The engine's request intake: a request checked, tokenized and queued as its
samples' sequences; a combination the chosen strategies cannot serve refused
before it is queued; a request aborted.

:class:`RequestIntake` is built by :class:`~pitstop.loop.engine.LLMEngine` from its
request table, allocator, scheduler and sampler; it adds to and stops requests in
that table (:class:`~pitstop.loop.request_table.RequestTable`), and owns the grammar
backend, built at the first structured request.

A request whose adapter would bring the adapters in flight over what one step can run
(the adapter plugin's ``max_per_step``, LoRA's ``max_loras``) waits here, in the table but
not yet queued, until requests finish and free a place (:meth:`RequestIntake.admit_waiting`,
before each step), as vLLM's scheduler holds such requests back; requests of adapters
already in flight, and of the base model, do not wait behind it. Likewise a request whose
adapter is still being copied to the device (the plugin's optional ``ready``) waits, its
place kept, until the copy has finished, so that no running batch waits for the copy;
with nothing else in flight it goes at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence as Seq
from typing import Any

import attrs

from pitstop.config import EngineConfig
from pitstop.errors import InvalidRequestError
from pitstop.ground.metrics import EngineStats
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.tokenizer import Tokenizer
from pitstop.loop.request_table import RequestTable
from pitstop.plugin_system.adapter import Adapters
from pitstop.plugin_system.grammar import GrammarBackend
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.plugin_system.protocols import (
    Allocator,
    AllocatorBase,
    Sampler,
    SamplerBase,
    Scheduler,
)
from pitstop.requests.detokenizer import IncrementalDetokenizer
from pitstop.requests.outputs import RequestOutput
from pitstop.requests.request_state import RequestState, SampleState
from pitstop.requests.sampling_params import SamplingParams
from pitstop.requests.sequence import Sequence, Timestamps
from pitstop.requests.validation import SEED_MODULUS, check_encoded_prompt, validate_request

log = logging.getLogger(__name__)


class RequestIntake:
    """Adding requests to ``requests`` (queued on ``scheduler``) and aborting them.

    ``sampler`` is the runner's (whether it applies logits processors);
    ``speculative``: whether the engine speculates (what it then refuses).
    """

    def __init__(
        self,
        requests: RequestTable,
        allocator: Allocator,
        scheduler: Scheduler,
        sampler: Sampler,
        *,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        plugins: PluginManager,
        stats: EngineStats,
        speculative: bool = False,
        adapters: Adapters | None = None,
    ) -> None:
        self.requests = requests
        self.allocator = allocator
        self.scheduler = scheduler
        self.sampler = sampler
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.plugins = plugins
        self.stats = stats
        self.speculative = speculative
        self.adapters = adapters  # the adapter plugin (None: adapters are refused)
        # the most adapters one step runs (LoRA's max_loras); None: no limit
        self._adapter_limit: int | None = getattr(adapters, "max_per_step", None)
        self.grammars: GrammarBackend | None = None
        """The grammar backend, built at the first structured request (or grammar_compiler())."""
        self._grammars_lock = threading.Lock()  # grammar_compiler() runs on other threads
        # request id -> its sequences, waiting (oldest first) for its adapter to get a place
        self._waiting: dict[str, list[Sequence]] = {}

    def grammar_compiler(self) -> GrammarBackend:
        """The structured-output compiler of this engine's tokenizer: the grammar backend
        ``config.grammar`` names, built on first use (llguidance's takes seconds: it reads
        the whole vocabulary). Thread-safe, so a server can build it at start-up and check a
        request's constraint on its own threads before the request is queued; the engine
        then finds both ready. InvalidRequestError without a tokenizer or (llguidance)
        without its package."""
        if self.grammars is not None:
            return self.grammars
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs needs the model's tokenizer; this model has none"
            )
        with self._grammars_lock:
            if self.grammars is None:
                self.grammars = self.plugins.create(
                    "grammar",
                    self.config.grammar,
                    self.config,
                    self.tokenizer,
                    self.model_config.vocab_size,
                )
        return self.grammars

    def add(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Seq[int] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> str:
        """Queue a request (text or token ids); returns its id. Bad input raises InvalidRequestError.

        ``arrival_time`` (``time.perf_counter`` seconds) backdates the request's
        arrival, for benchmark clients whose request was due before the engine
        loop got to it.
        """
        params = (params or SamplingParams()).clone()  # the caller may assign to its own later
        checked = validate_request(
            prompt, params, prompt_token_ids, vocab_size=self.model_config.vocab_size
        )
        if request_id is None:
            request_id = self.requests.new_request_id()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use; pick another")
        if prompt_token_ids is None:
            assert prompt is not None
            if self.tokenizer is None:
                raise InvalidRequestError(
                    f"model {self.config.model!r} has no tokenizer; pass prompt_token_ids instead of text"
                )
            ids = self.tokenizer.encode(prompt)
            check_encoded_prompt(prompt, ids, self.model_config.vocab_size)
        else:
            assert checked is not None
            ids = checked
        max_len = self.config.max_model_len
        assert max_len is not None
        keep = params.truncate_prompt_tokens
        if keep is not None:  # the prompt's last tokens (-1: the last max_model_len)
            ids = ids[-(max_len if keep == -1 else keep) :]
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but max_model_len is {max_len}, which leaves no room "
                f"for output; shorten the prompt or raise max_model_len"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{len(ids) + params.max_tokens} tokens, more than max_model_len={max_len}; "
                f"ask for at most max_tokens={max_len - len(ids)}, or max_tokens=None (up to "
                "max_model_len), or shorten the prompt"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer; use stop_token_ids with this model"
            )
        self._check_combination(params)
        self._check_adapter(lora_request)
        samples = self._new_samples(request_id, ids, params, arrival_time, lora_request)
        req = RequestState(request_id, prompt, ids, params, samples)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        waits = lora_request is not None and self._must_wait(lora_request)
        self.requests.add(req)
        seqs = [sample.seq for sample in samples]
        if len(seqs) > 1 and AllocatorBase.of(self.allocator, "shares_prefix_pages"):
            # the other samples wait until the first computed the prompt, then share its pages
            seqs, req.held_back = seqs[:1], seqs[1:]
        if waits:
            self._waiting[request_id] = seqs  # queued by admit_waiting once a place frees
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        return request_id

    def _queued_sequences(self) -> list[Sequence]:
        """The live sequences the scheduler holds (waiting or running), not those waiting here."""
        waiting = {seq.seq_id for seqs in self._waiting.values() for seq in seqs}
        live = self.requests.live_sequences().values()
        return [seq for seq in live if seq.seq_id not in waiting]

    def _adapters_in_flight(self) -> set[int]:
        """The adapter ids of the queued (waiting or running) requests' sequences."""
        return {seq.adapter_id for seq in self._queued_sequences()} - {0}

    def _adapter_ready(self, lora_request: Any, busy: set[int]) -> bool:
        """Whether a step can run ``lora_request``'s adapter without waiting for its copy to
        the device: the adapter plugin's ``ready`` (which starts the copy, beside the running
        steps, into a slot none of ``busy``'s adapters holds), True for a plugin without one.
        With nothing queued there is no batch to hold up: True (the request's first step
        waits for the copy on the device)."""
        ready = getattr(self.adapters, "ready", None)
        if ready is None:
            return True
        try:
            return bool(ready(lora_request, busy)) or not self._queued_sequences()
        except Exception:  # noqa: BLE001 - left to the step that runs it, which loads it itself
            log.exception("placing adapter %r ahead of its step failed", lora_request.lora_name)
            return True

    def _fits(self, adapter_id: int, in_flight: set[int]) -> bool:
        """Whether a request of ``adapter_id`` may join ``in_flight``: its adapter is there,
        or fewer than the limit are."""
        limit = self._adapter_limit
        return limit is None or adapter_id in in_flight or len(in_flight) < limit

    def _must_wait(self, lora_request: Any) -> bool:
        """Whether a new request of ``lora_request``'s adapter waits here: it has no place
        (it would not fit, or a new adapter would pass requests already waiting), or its
        adapter is not on the device yet (:meth:`_adapter_ready`)."""
        adapter_id = lora_request.lora_int_id
        in_flight = self._adapters_in_flight()
        has_room = (
            self._adapter_limit is None
            or adapter_id in in_flight
            or (not self._waiting and self._fits(adapter_id, in_flight))
        )
        return not (has_room and self._adapter_ready(lora_request, in_flight))

    def admit_waiting(self) -> None:
        """Queue the requests that wait for a place for their adapter, oldest first, while
        the adapters in flight leave room and once each one's adapter is on the device (a
        request whose copy runs keeps its place meanwhile); the engine calls it before each
        step."""
        if not self._waiting:
            return
        in_flight = self._adapters_in_flight()
        for request_id, seqs in list(self._waiting.items()):
            adapter_id = seqs[0].adapter_id
            if not self._fits(adapter_id, in_flight):
                continue
            in_flight.add(adapter_id)
            if not self._adapter_ready(seqs[0].lora_request, in_flight):
                continue
            del self._waiting[request_id]
            for seq in seqs:
                self.scheduler.add(seq)

    @property
    def num_waiting_for_adapter(self) -> int:
        """Requests not yet queued because their adapter waits for a place."""
        return len(self._waiting)

    def _check_adapter(self, lora_request: Any) -> None:
        """Refuse an adapter this engine cannot serve; the adapter plugin reads it (or refuses it)."""
        if lora_request is None:
            return
        if self.adapters is None:
            raise InvalidRequestError(
                "this request names an adapter (lora_request) but the engine serves none: "
                "build it with enable_lora=True (adapter='lora')"
            )
        self.adapters.check(lora_request)

    def _check_combination(self, params: SamplingParams) -> None:
        """Refuse what this engine's configuration cannot honour (instead of ignoring it)."""
        if (
            params.needs_penalties
            or params.logit_bias
            or params.min_tokens
            or params.structured_outputs is not None
            or params.logprobs
            or params.allowed_token_ids is not None
            or params.needs_host_tokens
        ) and not SamplerBase.of(self.sampler, "supports_logits_processors"):
            raise InvalidRequestError(
                f"the {self.config.sampler!r} sampler does not apply penalties, logit_bias, "
                "min_tokens, structured outputs, allowed_token_ids, bad_words, "
                "logits_processors or logprobs other than 0; use sampler 'standard' or "
                "leave them unset"
            )
        if params.prompt_logprobs is not None and not SamplerBase.of(
            self.sampler, "prompt_logprobs"
        ):
            raise InvalidRequestError(
                f"the {self.config.sampler!r} sampler does not compute prompt_logprobs; use "
                "sampler 'standard' or leave it unset"
            )
        if params.prompt_logprobs is not None and AllocatorBase.of(
            self.allocator, "caches_prefixes"
        ):
            raise InvalidRequestError(
                f"prompt_logprobs needs every prompt token computed, and the {self.config.allocator} "
                "allocator serves cached ones without computing them; use allocator paged or "
                "preallocated"
            )
        if not self.speculative:
            return
        used = [
            name
            for name, on in (
                ("structured_outputs", params.structured_outputs is not None),
                ("presence/frequency/repetition penalties", params.needs_penalties),
                ("logit_bias", bool(params.logit_bias)),
                ("min_tokens", params.min_tokens > 0),
                ("logprobs > 0", bool(params.logprobs)),
                ("prompt_logprobs", params.prompt_logprobs is not None),
                ("allowed_token_ids", params.allowed_token_ids is not None),
                ("bad_words", bool(params.bad_words)),
                ("logits_processors", bool(params.logits_processors)),
            )
            if on
        ]
        if used:
            raise InvalidRequestError(
                f"{used[0]} is not supported with speculative decoding (speculative="
                f"{self.config.speculative!r}); leave it unset or run without --speculative"
            )

    def _new_samples(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        arrival: float | None,
        lora_request: Any = None,
    ) -> list[SampleState]:
        """The ``n`` samples of a request: a sequence each (seed + i for sample i), grammar,
        text; each runs with ``lora_request``'s adapter (None: the base model)."""
        max_len = self.config.max_model_len
        assert max_len is not None
        grammars = None
        if params.structured_outputs is not None:
            backend = self.grammar_compiler()
            grammars = [backend.new_state(params.structured_outputs) for _ in range(params.n)]
        # what the sampler keeps of the request for its rows (the standard one: bad_words)
        prepared = SamplerBase.of(self.sampler, "prepare_request")(params, self.tokenizer)
        uses_processors = (
            params.needs_penalties
            or params.min_tokens > 0
            or params.structured_outputs is not None
            or params.allowed_token_ids is not None
            or params.needs_host_tokens
        )
        samples = []
        for i in range(params.n):
            p = params
            if i and params.seed is not None:
                p = attrs.evolve(params, seed=(params.seed + i) % SEED_MODULUS)
            seq = Sequence(
                request_id if params.n == 1 else f"{request_id}#{i}",
                ids,
                p,
                seq_id=self.requests.new_seq_id(),
                max_num_tokens=max_len
                if params.max_tokens is None
                else len(ids) + params.max_tokens,
                timestamps=Timestamps() if arrival is None else Timestamps(arrival=arrival),
                lora_request=lora_request,
            )
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens
                )
            samples.append(
                SampleState(
                    i,
                    seq,
                    detok,
                    request_id=request_id,
                    grammar=grammars[i] if grammars else None,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                    prepared=prepared,
                    uses_processors=uses_processors,
                )
            )
        return samples

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, wherever it is, and free what it holds; returns its final output."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._waiting.pop(request_id, None)
        self.requests.stop(req, self.scheduler)
        self.stats.requests_aborted += 1
        return self.requests.finish(req)
