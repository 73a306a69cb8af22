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
adaptation rule (:mod:`pitstop.speculation.spec_adaptation`) decides per step whether to
speculate, so that steps it keeps plain stay overlapped.

The engine resolves every strategy once, when it is built, and then calls
the chosen objects directly; observer hooks fire at most once per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager
from typing import Any

import attrs
import torch

from pitstop.config import EngineConfig, resolve_max_model_len
from pitstop.errors import ConfigError, WorkerDiedError
from pitstop.ground.metrics import EngineStats, StepStats
from pitstop.ground.poison import FreshPageTracker
from pitstop.ground.step import SeqInput, StepInput
from pitstop.loading.kv_cache_dtype import resolve_kv_cache_dtype
from pitstop.loading.tokenizer import Tokenizer
from pitstop.loading.weights import load_model_source
from pitstop.loop.engine_intake import RequestIntake
from pitstop.loop.engine_results import InFlightStep, StepResults
from pitstop.loop.gc_heap import freeze_startup_heap, reclaim_frozen, thaw_heap
from pitstop.loop.memory import check_fits, check_max_model_len_fits
from pitstop.loop.request_table import RequestTable
from pitstop.plugin_system.executor import ExecutorContext
from pitstop.plugin_system.grammar import GrammarBackend
from pitstop.plugin_system.plugin_manager import PluginManager, get_plugin_manager
from pitstop.plugin_system.protocols import AllocatorBase
from pitstop.plugin_system.sampler import RowInputs
from pitstop.plugin_system.settings import resolve
from pitstop.requests.outputs import RequestOutput
from pitstop.requests.sampling_params import SamplingParams
from pitstop.requests.sequence import Sequence, SequenceStatus
from pitstop.runner.memory_plan import kv_bytes_per_page, pages_asked, resolve_device, resolve_dtype
from pitstop.runner.model_runner import ModelRunner
from pitstop.runner.verify_graphs import capture_verify_graphs
from pitstop.speculation.spec_adaptation import SpeculationPolicy
from pitstop.speculation.speculative import ProposerContext, draft_room

# observer(step inputs, the engine's sequence of each or None, logits rows): see observe_logits
EngineLogitsObserver = Callable[[Seq[SeqInput], list[Sequence | None], Any], None]

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns the chosen strategies and the runner, and composes the loop's parts: the
    request table (:attr:`requests`), the intake (:attr:`intake`) and the step results
    (:attr:`results`)."""

    def __init__(
        self,
        config: EngineConfig,
        plugins: PluginManager | None = None,
        *,
        memory_region: Callable[[str], AbstractContextManager[object]] | None = None,
    ) -> None:
        """``memory_region``: handed to the :class:`ModelRunner` (sleep mode allocates the
        weights and the KV cache in releasable regions; None: plain allocations)."""
        if config.freeze_gc:  # what engines dropped without close() left, before memory is sized
            reclaim_frozen()
        self.plugins = plugins or get_plugin_manager()
        self.device = resolve_device(config.device)
        if config.kernels == "auto":  # the kernel set declared for this device type
            config = attrs.evolve(config, kernels=self.plugins.auto_kernels(self.device.type))
        resolved = resolve(config, self.plugins)  # every name and setting, before any weight loads
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
        # over several ranks (tensor_parallel_size > 1) an executor plugin runs them
        executor = None
        per_rank = mc  # the part of the model one device holds
        if config.tensor_parallel_size > 1:
            executor = self.plugins.create(
                "executor",
                config.distributed_executor_backend,
                config,
                settings=resolved.of("executor"),
            )
            per_rank = executor.rank_model_config(mc)
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
        if executor is not None:  # rank 0 of N: the other ranks start here
            self.runner = executor.start(
                ExecutorContext(
                    config, mc, self.plugins, self.device, self.dtype, source.weights, resolved
                )
            )
        else:
            self.runner = ModelRunner(
                config,
                mc,
                self.plugins,
                self.device,
                self.dtype,
                resolved=resolved,
                memory_region=memory_region,
            )
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
        AllocatorBase.of(self.allocator, "bind_kv_cache")(self.runner.kv_cache)
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
            self.runner.sampling.verifier = self.plugins.create(
                "verifier",
                config.speculative_verifier,
                config,
                self.runner.sampler,
                self.device,
                settings=resolved.of("verifier"),
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
        self.stats = EngineStats()
        self.overlap = {"on": True, "off": False}.get(config.overlap, self.device.type == "cuda")
        self.spec_policy = (
            SpeculationPolicy(config, self.stats) if self.proposer is not None else None
        )
        request_observed = self.plugins.has_observers("on_request_finished")
        self.requests = RequestTable(
            release=self._release_sequence,
            on_finished=self._request_finished if request_observed else None,
        )
        """The live requests and their samples (owned here; the parts below are handed it)."""
        self.intake = RequestIntake(
            self.requests,
            self.allocator,
            self.scheduler,
            self.runner.sampler,
            config=config,
            model_config=mc,
            tokenizer=self.tokenizer,
            plugins=self.plugins,
            stats=self.stats,
            speculative=self.proposer is not None,
            adapters=getattr(self.runner, "adapters", None),
        )
        """Requests checked, tokenized and queued; aborts."""
        step_observed = self.plugins.has_observers("on_step_finished")
        self.results = StepResults(
            self.requests,
            self.allocator,
            self.scheduler,
            config=config,
            stats=self.stats,
            tokenizer=self.tokenizer,
            eos_token_ids=frozenset(eos),
            proposer=self.proposer,
            spec_policy=self.spec_policy,
            on_step=self._step_finished if step_observed else None,
        )
        """A launched step's results applied: tokens, stops, failures, outputs."""
        self._step_in_flight: InFlightStep | None = None
        """The loop's one state between two calls of :meth:`step`: the step it launched and
        has not applied yet (under ``overlap``). Only :meth:`step` reads and writes it; the
        rest of the loop gets the step as an argument."""
        if config.freeze_gc:  # last: everything start-up made lives as long as the engine
            freeze_startup_heap()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and thaw the heap frozen at start-up."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        if self.config.freeze_gc:
            thaw_heap()

    # ------------------------------------------------------------------ requests
    def add_request(
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

        ``lora_request``: the adapter it runs with (vLLM's LoRARequest; needs an adapter
        plugin, ``enable_lora=True``).

        ``arrival_time`` (``time.perf_counter`` seconds) backdates the request's
        arrival, for benchmark clients whose request was due before the engine
        loop got to it (see :meth:`RequestIntake.add <pitstop.loop.engine_intake.RequestIntake.add>`).
        """
        return self.intake.add(
            prompt,
            params,
            prompt_token_ids=prompt_token_ids,
            request_id=request_id,
            arrival_time=arrival_time,
            lora_request=lora_request,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, wherever it is, and free what it holds; returns its final output."""
        return self.intake.abort(request_id)

    def grammar_compiler(self) -> GrammarBackend:
        """The structured-output compiler of this engine's tokenizer, built on first use
        (thread-safe: see :meth:`RequestIntake.grammar_compiler
        <pitstop.loop.engine_intake.RequestIntake.grammar_compiler>`)."""
        return self.intake.grammar_compiler()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that end a sequence (the model's and the tokenizer's)."""
        return self.results.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.results.eos_token_ids = frozenset(ids)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return len(self.requests) > 0

    def live_sequences(self) -> dict[int, Sequence]:
        """The sequences of the unfinished requests, by the sequence id the runner knows (read only)."""
        return self.requests.live_sequences()

    def _release_sequence(self, seq: Sequence) -> None:
        """A finished request's sample dropped: the proposer and the adaptation rule forget it."""
        if self.proposer is not None:
            self.proposer.release(seq)  # e.g. the draft model's own KV pages
        if self.spec_policy is not None:
            self.spec_policy.release(seq)

    def _request_finished(self, output: RequestOutput) -> None:
        """Tell the ``on_request_finished`` observers."""
        self.plugins.hook.on_request_finished(engine=self, output=output)

    def _step_finished(self, stats: StepStats) -> None:
        """Tell the ``on_step_finished`` observers."""
        self.plugins.hook.on_step_finished(engine=self, stats=stats)

    def observe_logits(self, observer: EngineLogitsObserver | None) -> None:
        """Hand the target model's logits of every step to ``observer`` (None: stop).

        ``observer(inputs, sequences, logits)`` is called after the step's logits
        are computed, before sampling: ``inputs`` are the step's
        :class:`~pitstop.ground.step.SeqInput` s, ``sequences`` the engine's
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
        return len(self.requests)

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
        self.intake.admit_waiting()  # requests whose adapter waited for a place
        outputs, self._step_in_flight = self._advance(self._step_in_flight, stream)
        outputs.extend(self.results.take_failed())
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Apply the step still in flight, if any, and return its outputs (under ``overlap``
        a launched step can outlive its requests); after it nothing this engine launched is
        left to apply. Call it with no request unfinished (it steps until the flight lands)."""
        outputs: list[RequestOutput] = []
        while self._step_in_flight is not None:
            outputs += self.step()
        return outputs

    def _advance(
        self, in_flight: InFlightStep | None, stream: bool
    ) -> tuple[list[RequestOutput], InFlightStep | None]:
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
            outputs = self.results.apply(in_flight, stream)
            in_flight = None
        launched = self._plan_and_launch(speculating, busy=in_flight is not None)
        if in_flight is not None:
            outputs += self.results.apply(in_flight, stream)
        if launched is None:
            return outputs, None
        if self.overlap and not launched.verifies:
            return outputs, launched
        outputs.extend(self.results.apply(launched, stream))
        return outputs, None

    def _speculating(self) -> set[int]:
        """The sequences that ask for drafts in the next step (the adaptation rule); may be empty."""
        if self.spec_policy is None:
            return set()
        decoding = (  # prompt work never needs drafts (nor the in-flight step drained for them)
            sample.seq
            for sample in self.requests.samples()
            if sample.seq.status is SequenceStatus.RUNNING and sample.seq.num_uncomputed_tokens == 1
        )
        return self.spec_policy.plan_step(self.scheduler.num_running, decoding)

    def _plan_and_launch(
        self, speculating: set[int] | None = None, *, busy: bool = False
    ) -> InFlightStep | None:
        """Plan the next step and queue it on the device; None when there is nothing to run.

        ``speculating``: the sequences that ask the proposer for drafts first;
        ``busy``: a step is in flight (its sequences may have no work planned).
        """
        start = time.perf_counter()
        proposed = self._propose(speculating) if speculating else []
        plan = self.scheduler.schedule()
        if plan.preempted:
            self._warn_preemptions(len(plan.preempted))
            self.requests.reset(seq.seq_id for seq in plan.preempted)
        if plan.is_empty:
            if self.requests and not self.scheduler.has_work() and not busy:
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
                    adapter=seq.lora_request,
                )
            )
        self._clear_drafts(proposed)  # the inputs hold what verification reads of them
        gone, reset = self.requests.take_runner_changes()
        step = StepInput(inputs, gone, reset, poison_pages=self._fresh_pages[:])
        self._fresh_pages.clear()
        AllocatorBase.of(self.allocator, "before_launch")()
        try:
            handle = self.runner.launch(step)
        except WorkerDiedError:
            raise  # a lost tensor-parallel rank fails the engine, not one request
        except Exception as exc:  # one request's bad value must not fail its neighbours
            handle = self.results.isolate_failure(self.runner, scheduled, inputs, exc)
        for s, inp in zip(scheduled, inputs, strict=True):
            seq = s.seq
            if not seq.is_finished and inp.num_logits == 1:
                # a verification's computed count is set when it is applied
                seq.launch(s.num_new_tokens, samples=inp.sample)
        return InFlightStep(plan, scheduled, inputs, handle, start)

    def _uses_processors(self, seq: Sequence) -> bool:
        """Whether ``seq``'s request uses penalties, min_tokens, a grammar or host tokens."""
        sample = self.requests.sample(seq.seq_id)
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
        if k is None or begin >= last:
            return {}
        sample = self.requests.sample(seq.seq_id)
        assert sample is not None
        if sample.index != 0:
            return {}
        return {
            "prompt_targets": seq.prompt_token_ids[begin + 1 : min(end, last) + 1],
            "prompt_logprobs": k,
        }

    def _row_inputs(self, seq: Sequence) -> RowInputs | None:
        """What the sampler's penalties, min_tokens and grammar read for ``seq`` this step."""
        params = seq.sampling_params
        sample = self.requests.sample(seq.seq_id)
        assert sample is not None
        blocked: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            blocked = eos + params.stop_token_ids
        reads_tokens = params.needs_host_tokens
        output_ids: tuple[int, ...] = ()
        if (
            reads_tokens
        ):  # the step before was applied (InFlightStep.needs_host_tokens): none pending
            output_ids = tuple(seq.output_token_ids)
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
            prepared=sample.prepared,
        )

    # ------------------------------------------------------------------ speculation
    def _propose(self, speculating: set[int]) -> list[Sequence]:
        """Ask the proposer for drafts for the decoding sequences in ``speculating``; return those asked."""
        assert self.proposer is not None and self.config.max_model_len is not None
        assert self.spec_policy is not None
        k = self.config.num_speculative_tokens
        seqs = [
            sample.seq
            for sample in self.requests.samples()
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
