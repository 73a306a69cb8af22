"""`LLMEngine`: the step loop. Plan, launch, apply the previous step's results, emit.

One call of :meth:`LLMEngine.step`:

1. **plan**: the scheduler picks the sequences of step N+1 and their token
   counts (with one step of lag: it sees step N's sampled tokens as pending);
2. **launch**: the runner queues step N+1 on the device and returns at once;
   each scheduled sequence counts its chunk as computed, and one that
   samples gets a pending token;
3. **apply** step N's results (the one copy of its sampled ids, waited for
   on an event): resolve the pending tokens, check stop conditions,
   detokenize, finish and free; a token computed for a sequence that had
   already finished is discarded;
4. **emit** the outputs of step N.

With ``overlap`` off the same code applies step N+1 right after launching
it: the serial loop. A speculative step runs serially too: the engine first
applies the step in flight (the proposer reads the tokens on the host),
then proposes, plans, launches the verification and applies it; the
adaptation rule (:mod:`pitstop.spec_adaptation`) decides per step whether to
speculate, so that steps it keeps plain stay overlapped.

The engine resolves every strategy once, when it is built, and then calls
the chosen objects directly; observer hooks fire at most once per step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import attrs
import torch

from pitstop.bad_words import bad_word_token_ids, blocked_now
from pitstop.config import EngineConfig, resolve_max_model_len
from pitstop.errors import ConfigError, InvalidRequestError, WorkerDiedError
from pitstop.kv_cache_dtype import resolve_kv_cache_dtype
from pitstop.memory import check_fits, check_max_model_len_fits
from pitstop.metrics import EngineStats, StepStats
from pitstop.outputs import RequestOutput
from pitstop.plugin_manager import PluginManager, get_plugin_manager
from pitstop.poison import FreshPageTracker, PoisonedReadError
from pitstop.protocols import AllocatorBase, SamplerBase, ScheduledSequence, StepPlan
from pitstop.request_state import RequestState, SampleState, accept_token, token_logprobs
from pitstop.request_validation import validate_request
from pitstop.runner import ModelRunner
from pitstop.runner_launched import LaunchedStep
from pitstop.runner_memory import kv_bytes_per_page, pages_asked, resolve_device, resolve_dtype
from pitstop.sampling import RowInputs
from pitstop.sampling_params import SamplingParams
from pitstop.sequence import Sequence, SequenceStatus, Timestamps
from pitstop.spec_adaptation import SpeculationPolicy
from pitstop.spec_graphs import capture_verify_graphs
from pitstop.speculative import ProposerContext, draft_room
from pitstop.step import SeqInput, SeqResult, StepInput, StepOutput
from pitstop.structured import GrammarCompiler
from pitstop.tokenizer import IncrementalDetokenizer, Tokenizer
from pitstop.validation import SEED_MODULUS, check_encoded_prompt
from pitstop.weights import load_model_source

# observer(step inputs, the engine's sequence of each or None, logits rows): see observe_logits
EngineLogitsObserver = Callable[[Seq[SeqInput], list[Sequence | None], Any], None]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class _Launched:
    """A step on its way: its plan, its sequences in input order, and the runner's handle."""

    plan: StepPlan
    scheduled: list[ScheduledSequence]
    inputs: list[SeqInput]
    handle: LaunchedStep
    start: float

    @property
    def verifies(self) -> bool:
        """Whether some sequence verifies drafts (applied before the next launch)."""
        return any(inp.num_logits > 1 for inp in self.inputs)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether a sequence of this step needs its sampled token on the host before the
        next step is planned (a grammar's next mask, bad words, logits processors)."""
        return any(i.row_inputs is not None and i.row_inputs.needs_host_tokens for i in self.inputs)


class LLMEngine:
    """Owns the chosen strategies, the runner and every live request."""

    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None) -> None:
        self.plugins = plugins or get_plugin_manager()
        self.device = resolve_device(config.device)
        if config.kernels == "auto":
            fused = self.device.type == "cuda" and "fused" in self.plugins.names("kernels")
            config = attrs.evolve(config, kernels="fused" if fused else "reference")
        resolved = self.plugins.resolve(config)  # every name and setting, before any weight loads
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if self.device.type == "cpu":
            log.info("CPU threads: %d (set with --threads)", torch.get_num_threads())
        source = load_model_source(config.model, tokenizer=config.tokenizer, plugins=self.plugins)
        mc = source.model_config
        self.plugins.get("model", mc.architecture)
        max_model_len = resolve_max_model_len(config, mc)
        config = attrs.evolve(config, max_model_len=max_model_len)
        self.config = config
        self.model_config = mc
        self.tokenizer: Tokenizer | None = source.tokenizer
        per_rank = mc  # the part of the model one device holds
        if config.tensor_parallel_size > 1:
            from pitstop.parallel.sharding import shard_model_config

            per_rank = shard_model_config(mc, config.tensor_parallel_size)
        kv_pages = (
            pages_asked(config, per_rank, self.device, self.dtype) or 0
        )  # 0: sized after the weights
        cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        page_bytes = kv_bytes_per_page(per_rank, config.page_size, cache_dtype)
        check_fits(
            per_rank, self.dtype, self.device, kv_pages * page_bytes, what=source.description
        )
        check_max_model_len_fits(  # before the rotary tables and the cache are allocated
            max_model_len,
            per_rank,
            self.dtype,
            self.device,
            kv_pages=kv_pages,
            page_size=config.page_size,
            kv_page_bytes=page_bytes,
        )
        if config.tensor_parallel_size > 1:  # rank 0 of N: workers start here (pitstop.parallel)
            from pitstop.parallel import start_tensor_parallel

            self.runner = start_tensor_parallel(
                config, mc, self.plugins, self.device, self.dtype, source.weights
            )
        else:
            self.runner = ModelRunner(config, mc, self.plugins, self.device, self.dtype)
        self.runner.load_weights(source.weights)
        num_pages = self.runner.plan_num_pages()
        self.runner.init_kv_cache(num_pages)
        self.runner.maybe_capture_graphs(
            capture_verify_graphs if config.speculative is not None else None
        )
        if num_pages * config.page_size < config.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_pages * config.page_size} tokens, less than one sequence of "
                f"max_model_len={config.max_model_len}; give it more memory (kv_cache_gib, max_num_pages, "
                f"gpu_memory_utilization) or lower max_model_len"
            )
        self.allocator = self.plugins.create(
            "allocator", config.allocator, config, num_pages, settings=resolved.of("allocator")
        )
        self._fresh_pages: list[int] = []  # handed out since the last launch (poison_memory)
        if config.poison_memory:
            self.allocator = FreshPageTracker(self.allocator, self._fresh_pages.extend)
        self.scheduler = self.plugins.create(
            "scheduler", config.scheduler, config, self.allocator, settings=resolved.of("scheduler")
        )
        self.proposer = None
        if config.speculative is not None:
            context = ProposerContext(
                plugins=self.plugins,
                device=self.device,
                dtype=self.dtype,
                vocab_size=mc.vocab_size,
                page_size=config.page_size,
                num_pages=num_pages,
                tokenizer=self.tokenizer,
            )
            self.proposer = self.plugins.create(
                "proposer", config.speculative, config, context, settings=resolved.of("proposer")
            )
        per_page = self.runner.bytes_per_page()
        log.info(
            "%s KV cache: %s, %d tokens/page, %s pages, %s tokens, %.2f GiB",
            config.allocator,
            str(self.runner.kv_cache_dtype).removeprefix("torch."),
            config.page_size,
            f"{num_pages:,}",
            f"{num_pages * config.page_size:,}",
            num_pages * per_page / 2**30,
        )
        log.info(
            "model: %s; device %s, %s; kernels %s; scheduler %s; speculative %s",
            source.description,
            self.device,
            self.dtype,
            config.kernels,
            config.scheduler,
            config.speculative or "off",
        )
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.stats = EngineStats()
        self._requests: dict[str, RequestState] = {}
        self._samples: dict[int, SampleState] = {}  # by sequence id: each one's record
        self._grammars: GrammarCompiler | None = None  # built at the first structured request
        self._ids = itertools.count()
        # Sequence ids count from 0 in every engine, so an engine behaves the same whatever ran
        # before it in the process (ids are keys of the runner's per-sequence state).
        self._seq_ids = itertools.count()
        self._finished_seq_ids: list[int] = []  # gone since the last launch (runner forgets them)
        self._reset_seq_ids: list[int] = []  # block tables rebuilt since the last launch
        self._in_flight: _Launched | None = None
        self._failed_outputs: list[RequestOutput] = []  # requests a failed step stopped
        self.overlap = {"on": True, "off": False}.get(config.overlap, self.device.type == "cuda")
        self.spec_policy = (
            SpeculationPolicy(config, self.stats) if self.proposer is not None else None
        )
        self._step_observers = self.plugins.has_observers("on_step_finished")
        self._request_observers = self.plugins.has_observers("on_request_finished")

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (nothing to do at tensor_parallel_size=1)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Seq[int] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (text or token ids); returns its id. Bad input raises InvalidRequestError.

        ``arrival_time`` (``time.perf_counter`` seconds) backdates the request's
        arrival, for benchmark clients whose request was due before the engine
        loop got to it.
        """
        params = params or SamplingParams()
        validate_request(prompt, params, prompt_token_ids, vocab_size=self.model_config.vocab_size)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
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
            ids = [int(t) for t in prompt_token_ids]
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
        samples = self._new_samples(request_id, ids, params, arrival_time)
        req = RequestState(request_id, prompt, ids, params, samples)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        for sample in samples:
            self._samples[sample.seq.seq_id] = sample
        self._requests[request_id] = req
        seqs = [sample.seq for sample in samples]
        if len(seqs) > 1 and AllocatorBase.of(self.allocator, "shares_prefix_pages"):
            # the other samples wait until the first computed the prompt, then share its pages
            seqs, req.held_back = seqs[:1], seqs[1:]
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

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
        ) and not SamplerBase.of(self.runner.sampler, "supports_logits_processors"):
            raise InvalidRequestError(
                f"the {self.config.sampler!r} sampler does not apply penalties, logit_bias, "
                "min_tokens, structured outputs, allowed_token_ids, bad_words, "
                "logits_processors or logprobs other than 0; use sampler 'standard' or "
                "leave them unset"
            )
        if params.prompt_logprobs is not None and AllocatorBase.of(
            self.allocator, "caches_prefixes"
        ):
            raise InvalidRequestError(
                f"prompt_logprobs needs every prompt token computed, and the {self.config.allocator} "
                "allocator serves cached ones without computing them; use allocator paged or "
                "preallocated"
            )
        if self.proposer is None:
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
        self, request_id: str, ids: list[int], params: SamplingParams, arrival: float | None
    ) -> list[SampleState]:
        """The ``n`` samples of a request: a sequence each (seed + i for sample i), grammar, text."""
        max_len = self.config.max_model_len
        assert max_len is not None
        grammars = None
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured_outputs needs the model's tokenizer; this model has none"
                )
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size)
            grammars = [
                self._grammars.new_state(params.structured_outputs) for _ in range(params.n)
            ]
        bad_words = ()
        if params.bad_words:
            bad_words = bad_word_token_ids(self.tokenizer, params.bad_words)
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
                seq_id=next(self._seq_ids),
                max_num_tokens=max_len
                if params.max_tokens is None
                else len(ids) + params.max_tokens,
                timestamps=Timestamps() if arrival is None else Timestamps(arrival=arrival),
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
                    bad_words=bad_words,
                    uses_processors=uses_processors,
                )
            )
        return samples

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, wherever it is, and free what it holds; returns its final output."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._stop_samples(req)
        self.stats.requests_aborted += 1
        return self._finish(req)

    def _stop_samples(self, req: RequestState) -> None:
        """Abort every unfinished sample of ``req`` and free what it holds."""
        for sample in req.samples:
            seq = sample.seq
            if seq.is_finished:
                continue
            if self.scheduler.abort(seq.request_id) is None or not seq.is_finished:
                seq.abort()
            self._finished_seq_ids.append(seq.seq_id)
        req.held_back = []

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    def live_sequences(self) -> dict[int, Sequence]:
        """The sequences of the unfinished requests, by the sequence id the runner knows (read only)."""
        return {seq_id: sample.seq for seq_id, sample in self._samples.items()}

    def observe_logits(self, observer: EngineLogitsObserver | None) -> None:
        """Hand the target model's logits of every step to ``observer`` (None: stop).

        ``observer(inputs, sequences, logits)`` is called after the step's logits
        are computed, before sampling: ``inputs`` are the step's
        :class:`~pitstop.step.SeqInput` s, ``sequences`` the engine's
        :class:`Sequence` of each (None for one already finished), and ``logits``
        holds each sampling input's ``num_logits`` rows in input order. Read only:
        the observer must not change the tensors or sequences.
        """
        if observer is None:
            self.runner.logits_observer = None
            return

        def relay(inputs: Seq[SeqInput], logits: Any) -> None:
            live = self.live_sequences()
            observer(inputs, [live.get(inp.seq_id) for inp in inputs], logits)

        self.runner.logits_observer = relay

    @property
    def num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self._requests)

    # ------------------------------------------------------------------ the step
    PREEMPTION_WARN_EVERY = 50

    def _warn_preemptions(self, count: int) -> None:
        """Count preemptions; warn at the first and then every ``PREEMPTION_WARN_EVERY``."""
        before = self.stats.preemptions
        self.stats.preemptions += count
        if before == 0 or before // self.PREEMPTION_WARN_EVERY != (
            self.stats.preemptions // self.PREEMPTION_WARN_EVERY
        ):
            log.warning(
                "%d sequence(s) preempted for lack of KV pages (%d since start): their tokens "
                "will be recomputed. Give the cache more room (gpu_memory_utilization, "
                "kv_cache_gib) or run fewer sequences at once (max_batch_size)",
                count,
                self.stats.preemptions,
            )

    def step(self, *, stream: bool = True) -> list[RequestOutput]:
        """Run one step; return the outputs of the step whose results were applied.

        With ``stream`` (the default) every request that produced a token or
        finished gets an output; without it only the finished ones do (what
        ``LLM.generate`` needs: one output per request, at its end). Under
        ``overlap`` the outputs are those of the previous step (see the
        module docstring).
        """
        outputs, self._in_flight = self._advance(self._in_flight, stream)
        if self._failed_outputs:
            outputs.extend(self._failed_outputs)
            self._failed_outputs = []
        return outputs

    def _advance(
        self, in_flight: _Launched | None, stream: bool
    ) -> tuple[list[RequestOutput], _Launched | None]:
        """One turn of the loop: the step in flight comes in, the step left in flight goes out.

        The launched step is a value passed from one turn to the next (``step``
        keeps it between calls): launch the next step, then apply the one that
        came in; under ``overlap`` the new one stays in flight.
        """
        outputs: list[RequestOutput] = []
        speculating = self._speculating()
        if in_flight is not None and (speculating or in_flight.needs_host_tokens):
            # the proposer, a grammar's next mask or a processor reading the output tokens
            # needs the token still on the device
            outputs = self._apply(in_flight, stream)
            in_flight = None
        launched = self._plan_and_launch(speculating, busy=in_flight is not None)
        if in_flight is not None:
            outputs += self._apply(in_flight, stream)
        if launched is None:
            return outputs, None
        if self.overlap and not launched.verifies:
            return outputs, launched
        outputs.extend(self._apply(launched, stream))
        return outputs, None

    def _speculating(self) -> set[int]:
        """The sequences that ask for drafts in the next step (the adaptation rule); may be empty."""
        if self.spec_policy is None:
            return set()
        decoding = (  # prompt work never needs drafts (nor the in-flight step drained for them)
            sample.seq
            for sample in self._samples.values()
            if sample.seq.status is SequenceStatus.RUNNING and sample.seq.num_uncomputed_tokens == 1
        )
        return self.spec_policy.plan_step(self.scheduler.num_running, decoding)

    def _plan_and_launch(
        self, speculating: set[int] | None = None, *, busy: bool = False
    ) -> _Launched | None:
        """Plan the next step and queue it on the device; None when there is nothing to run.

        ``speculating``: the sequences that ask the proposer for drafts first;
        ``busy``: a step is in flight (its sequences may have no work planned).
        """
        start = time.perf_counter()
        proposed = self._propose(speculating) if speculating else []
        plan = self.scheduler.schedule()
        if plan.preempted:
            self._warn_preemptions(len(plan.preempted))
            self._reset_seq_ids.extend(seq.seq_id for seq in plan.preempted)
        if plan.is_empty:
            if self._requests and not self.scheduler.has_work() and not busy:
                raise RuntimeError("requests are live but the scheduler holds none of them")
            self._clear_drafts(proposed)
            return None
        scheduled = sorted(plan.scheduled, key=lambda s: s.num_new_tokens == 1)  # prefills first
        inputs = []
        for s in scheduled:
            seq = s.seq
            begin = seq.num_computed_tokens
            end = begin + s.num_new_tokens
            seq.mark_scheduled(start)
            # A sequence verifying k drafts computes [last token] + drafts: k past its end.
            num_drafts = max(0, end - seq.num_tokens)
            assert num_drafts == 0 or num_drafts == len(seq.draft_token_ids)
            sample = end >= seq.num_tokens
            inputs.append(
                SeqInput(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids[begin:end] + seq.draft_token_ids[:num_drafts],
                    start_pos=begin,
                    block_table=self.allocator.block_table(seq),
                    sample=sample,
                    params=seq.sampling_params,
                    num_logits=1 + num_drafts,
                    draft_probs=seq.draft_probs if num_drafts else None,
                    draft_ids=seq.draft_device_ids if num_drafts else None,
                    row_inputs=self._row_inputs(seq)
                    if sample and self._uses_processors(seq)
                    else None,
                    **self._prompt_targets(seq, begin, end),
                )
            )
        self._clear_drafts(proposed)  # the inputs hold what verification reads of them
        step = StepInput(
            inputs, self._finished_seq_ids, self._reset_seq_ids, poison_pages=self._fresh_pages[:]
        )
        self._finished_seq_ids, self._reset_seq_ids = [], []
        self._fresh_pages.clear()
        try:
            handle = self.runner.launch(step)
        except WorkerDiedError:
            raise  # a lost tensor-parallel rank fails the engine, not one request
        except Exception as exc:  # one request's bad value must not fail its neighbours
            handle = self._isolate_failure(scheduled, inputs, exc)
        for s, inp in zip(scheduled, inputs, strict=True):
            seq = s.seq
            if not seq.is_finished and inp.num_logits == 1:
                # a verification's computed count is set when it is applied
                seq.launch(s.num_new_tokens, samples=inp.sample)
        return _Launched(plan, scheduled, inputs, handle, start)

    def _uses_processors(self, seq: Sequence) -> bool:
        """Whether ``seq``'s request uses penalties, min_tokens, a grammar or host tokens."""
        sample = self._samples.get(seq.seq_id)
        return sample is not None and sample.uses_processors

    @staticmethod
    def _clear_drafts(proposed: list[Sequence]) -> None:
        """Drop the drafts of this step's proposals once its inputs are built (or none will be)."""
        for seq in proposed:
            seq.clear_drafts()

    def _prompt_targets(self, seq: Sequence, begin: int, end: int) -> dict[str, Any]:
        """For ``prompt_logprobs``: the prompt tokens the chunk ``[begin, end)`` of ``seq`` predicts."""
        k = seq.sampling_params.prompt_logprobs
        last = seq.num_prompt_tokens - 1  # position last predicts the first output token
        if k is None or begin >= last or self._samples[seq.seq_id].index != 0:
            return {}
        return {
            "prompt_targets": seq.prompt_token_ids[begin + 1 : min(end, last) + 1],
            "prompt_logprobs": k,
        }

    def _row_inputs(self, seq: Sequence) -> RowInputs | None:
        """What the sampler's penalties, min_tokens and grammar read for ``seq`` this step."""
        params = seq.sampling_params
        sample = self._samples[seq.seq_id]
        blocked: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            blocked = eos + params.stop_token_ids
        reads_tokens = params.needs_host_tokens
        output_ids: tuple[int, ...] = ()
        if reads_tokens:  # the step before was applied (_Launched.needs_host_tokens): none pending
            output_ids = tuple(seq.output_token_ids)
            blocked += tuple(blocked_now(sample.bad_words, output_ids))
        if not (
            params.needs_penalties
            or blocked
            or sample.grammar is not None
            or params.allowed_token_ids is not None
            or reads_tokens
        ):
            return None
        return RowInputs(
            history=seq.token_ids if params.needs_penalties else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            blocked_token_ids=blocked,
            grammar=sample.grammar,
            allowed_token_ids=params.allowed_token_ids,
            logits_processors=params.logits_processors,
            prompt_ids=tuple(seq.prompt_token_ids) if params.logits_processors else (),
            output_ids=output_ids,
            reads_tokens=reads_tokens,
        )

    def _apply_tokens(self, seq: Sequence, inp: SeqInput, res: SeqResult) -> RequestState:
        """One sequence's tokens from a step: resolve, stop checks, text; returns its request.

        The request's output is built once per step by the caller, after all of its
        samples' tokens are in (building it per sample cost O(n^2) for ``n`` samples).
        """
        num_drafts = inp.num_logits - 1
        sample = self._samples[seq.seq_id]
        req = self._request_of(sample)
        params = seq.sampling_params
        tokens = res.token_ids
        decode = self._decode_one
        for j, token in enumerate(tokens):  # accepted drafts, then the corrected or bonus token
            if num_drafts:
                seq.append_token(token)
            else:
                seq.resolve_token(token)
            if sample.logprobs is not None and res.logprobs is not None:
                lp = res.logprobs[j]
                top = res.top_logprobs[j] if res.top_logprobs else []
                if params.logprobs != -1:  # -1: the whole vocabulary
                    top = top[: params.logprobs]
                rank = res.ranks[j] if res.ranks else None
                sample.logprobs.append(token_logprobs(token, lp, rank, top, decode))
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + lp
            accept_token(
                sample,
                token,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.config.max_model_len or 0,
            )
            if seq.is_finished:
                break
        if num_drafts:
            self._after_verify(seq, inp.start_pos, num_drafts, len(tokens) - 1)
        self.stats.generation_tokens += len(sample.new_ids)
        if req.held_back and sample.index == 0:  # the prompt is computed now: share its pages
            share = AllocatorBase.of(self.allocator, "share_prompt")
            for sibling in req.held_back:
                share(sibling, seq)
                self.scheduler.add(sibling)
            req.held_back = []
        return req

    def _add_prompt_logprobs(self, seq: Sequence, inp: SeqInput, res: SeqResult) -> None:
        """Record a chunk's prompt log-probabilities; a prompt the cache skipped fails the request."""
        req = self._request_of(self._samples[seq.seq_id])
        assert req.prompt_logprobs is not None and res.prompt_logprobs is not None
        if inp.start_pos + 1 > len(req.prompt_logprobs):
            self._fail_request(
                seq,
                InvalidRequestError(
                    f"prompt_logprobs: prompt tokens before position {inp.start_pos} were served "
                    f"from the {self.config.allocator!r} allocator's cache and never computed; "
                    "use allocator paged or preallocated for prompt_logprobs"
                ),
            )
            return
        req.add_prompt_logprobs(inp.start_pos, res.prompt_logprobs, self._decode_one)

    def _request_of(self, sample: SampleState) -> RequestState:
        """The request a sample belongs to."""
        return self._requests[sample.request_id]

    def _decode_one(self, token: int) -> str | None:
        """One token's text, for log-probabilities (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _isolate_failure(
        self, scheduled: list[ScheduledSequence], inputs: list[SeqInput], exc: Exception
    ) -> LaunchedStep:
        """A launch failed: run each sequence of the step alone; fail only those that fail alone.

        Each sequence reruns as a step of its own (synchronously, with the
        previous step's samples restored before each, so pending tokens read
        the right values). A sequence that fails alone is finished with reason
        ``"error"`` and its pages freed; the others get their results as if
        the step had run whole. A step of one sequence is not rerun.
        """
        log.warning("a step of %d sequence(s) failed (%s); isolating the cause", len(inputs), exc)
        self.stats.step_failures += 1
        saved = self.runner.save_samples()
        results: list[SeqResult] = []
        kept: list[tuple[int, int]] = []  # (seq_id, sampled token) of the sequences that ran
        for s, inp in zip(scheduled, inputs, strict=True):
            error: Exception | None = exc if len(inputs) == 1 else None
            if error is None:
                self.runner.restore_samples(saved)
                try:
                    alone_output = self.runner.launch(StepInput([inp])).result()
                    result = alone_output.results[0]
                    if inp.seq_id in alone_output.poisoned_seq_ids:
                        raise PoisonedReadError(inp.seq_id)
                except Exception as alone:
                    error = alone
            if error is not None:
                self._fail_request(s.seq, error)
                results.append(SeqResult([]))
                continue
            results.append(result)
            if inp.sample and inp.num_logits == 1:
                kept.append((inp.seq_id, result.token_ids[0]))
        self.runner.adopt_samples(kept)
        return LaunchedStep(inputs, ready=StepOutput(results))

    def _fail_request(self, seq: Sequence, error: Exception) -> None:
        """Finish ``seq``'s request with reason ``"error"``: pages freed, output emitted next.

        Every sample of the request stops (the request failed); ``seq`` gets
        reason ``"error"``, its siblings ``"abort"``.
        """
        sample = self._samples.get(seq.seq_id)
        req = self._requests.get(sample.request_id) if sample is not None else None
        if req is None:
            return
        log.error("request %s failed and was stopped: %s", req.request_id, error)
        self._stop_samples(req)
        seq.fail()
        self.stats.requests_failed += 1
        output = self._finish(req, error=f"{type(error).__name__}: {error}")
        self._failed_outputs.append(output)

    def _apply(self, launched: _Launched, stream: bool) -> list[RequestOutput]:
        """Apply a launched step's results: tokens, stop conditions, outputs, finishes, stats."""
        result = launched.handle.result()
        outputs: list[RequestOutput] = []
        finished: list[Sequence] = []
        touched: dict[str, RequestState] = {}  # requests with new tokens, in order
        prefill_seqs = prefill_tokens = decode_tokens = 0
        for s, inp, res in zip(launched.scheduled, launched.inputs, result.results, strict=True):
            seq = s.seq
            num_drafts = inp.num_logits - 1
            if num_drafts or (
                inp.sample and s.num_new_tokens == 1 and inp.start_pos >= seq.num_prompt_tokens
            ):
                decode_tokens += s.num_new_tokens
            else:
                prefill_seqs += 1
                prefill_tokens += s.num_new_tokens
            if seq.is_finished:
                continue  # finished (or aborted) since this step was launched: discard its token
            if seq.seq_id in result.poisoned_seq_ids:
                self._fail_request(seq, PoisonedReadError(seq.seq_id))
                continue
            if not num_drafts and seq.status is SequenceStatus.RUNNING:
                self.allocator.on_tokens_computed(seq)
            if res.prompt_logprobs is not None:
                self._add_prompt_logprobs(seq, inp, res)
                if seq.is_finished:
                    continue
            if not inp.sample:
                continue
            try:
                req = self._apply_tokens(seq, inp, res)
            except Exception as exc:  # e.g. a detokenizer error: this request only
                self._fail_request(seq, exc)
                continue
            if seq.is_finished:
                finished.append(seq)
            touched[req.request_id] = req
        for rid, req in touched.items():  # one output per request and step, in order
            if rid not in self._requests:
                continue  # failed meanwhile: its output is already queued
            if req.finished:
                outputs.append(self._finish(req))
            elif stream:
                outputs.append(req.output())
        self.stats.prompt_tokens += prefill_tokens
        self.stats.requests_finished += sum(1 for out in outputs if out.finished)
        self._finished_seq_ids.extend(seq.seq_id for seq in finished)
        self.scheduler.on_step_done(launched.plan, finished)
        alloc = self.allocator.stats()
        self.stats.steps += 1
        self.stats.utilization_sum += alloc.utilization
        if self._step_observers:
            self.plugins.hook.on_step_finished(
                engine=self,
                stats=StepStats(
                    step=self.stats.steps,
                    num_seqs=len(launched.scheduled),
                    num_prefill_seqs=prefill_seqs,
                    num_prefill_tokens=prefill_tokens,
                    num_decode_tokens=decode_tokens,
                    num_preempted=len(launched.plan.preempted),
                    num_finished=len(finished),
                    num_waiting=self.scheduler.num_waiting,
                    num_running=self.scheduler.num_running,
                    duration_s=time.perf_counter() - launched.start,
                    allocator=alloc,
                ),
            )
        return outputs

    # ------------------------------------------------------------------ speculation
    def _propose(self, speculating: set[int]) -> list[Sequence]:
        """Ask the proposer for drafts for the decoding sequences in ``speculating``; return those asked."""
        assert self.proposer is not None and self.config.max_model_len is not None
        assert self.spec_policy is not None
        k = self.config.num_speculative_tokens
        seqs = [
            sample.seq
            for sample in self._samples.values()
            if sample.seq.status is SequenceStatus.RUNNING
            and sample.seq.num_uncomputed_tokens == 1
            and draft_room(sample.seq, k, self.config.max_model_len) > 0
            and sample.seq.seq_id in speculating
        ]
        if not seqs:
            return []
        self.stats.spec_steps += 1
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, k), strict=True):
            room = draft_room(seq, k, self.config.max_model_len)
            seq.set_drafts(proposal.token_ids[:room], proposal.probs, proposal.device_token_ids)
            if not seq.draft_token_ids:
                self.spec_policy.record(seq, 0, 0)
        return seqs

    def _after_verify(
        self, seq: Sequence, start_pos: int, num_drafts: int, num_accepted: int
    ) -> None:
        """Keep the KV of the verified tokens only; give back the slots of the rejected drafts.

        The step computed KV for the last token (at ``start_pos``) and the drafts.
        Valid now: the last token and the accepted drafts (``start_pos + 1 +
        num_accepted`` tokens, or every token when a stop cut the step short);
        the token emitted after them is uncomputed. A running sequence then
        holds exactly ``num_computed_tokens == num_tokens - 1`` slots, as after
        a plain decode step.
        """
        seq.verified(start_pos + 1 + num_accepted)
        held = self.allocator.num_held_tokens(seq)
        if held > seq.num_computed_tokens:
            self.allocator.truncate(seq, held - seq.num_computed_tokens)
            self._reset_seq_ids.append(seq.seq_id)
        self.allocator.on_tokens_computed(seq)
        self.stats.spec_verifications += 1
        self.stats.spec_proposed_tokens += num_drafts
        self.stats.spec_accepted_tokens += num_accepted
        assert self.proposer is not None and self.spec_policy is not None
        self.proposer.on_accepted(seq, num_accepted)
        self.spec_policy.record(seq, num_drafts, num_accepted)

    def _finish(self, req: RequestState, error: str | None = None) -> RequestOutput:
        """Forget a finished request (every sample stopped) and return its final output."""
        self._requests.pop(req.request_id, None)
        for sample in req.samples:
            self._samples.pop(sample.seq.seq_id, None)
            if self.proposer is not None:
                self.proposer.release(sample.seq)  # e.g. the draft model's own KV pages
            if self.spec_policy is not None:
                self.spec_policy.release(sample.seq)
        output = req.output(error=error)
        if self._request_observers:
            self.plugins.hook.on_request_finished(engine=self, output=output)
        return output
