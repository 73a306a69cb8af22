"""Applying a launched step's results: each sequence's sampled (or verified)
tokens, stop conditions, prompt log-probabilities, a failure kept to its own
request, and the outputs and statistics of the step.

:class:`StepResults` is built by :class:`~pitstop.loop.engine.LLMEngine` from its
request table, allocator and scheduler, and called with each step to apply;
:class:`InFlightStep` is the step the engine's loop carries from its launch to the
application of its results.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import attrs

from pitstop.config import EngineConfig
from pitstop.errors import InvalidRequestError
from pitstop.ground.metrics import EngineStats, StepStats
from pitstop.ground.poison import PoisonedReadError
from pitstop.ground.step import SeqInput, SeqResult, StepInput, StepOutput
from pitstop.loading.tokenizer import Tokenizer
from pitstop.loop.request_table import RequestTable
from pitstop.plugin_system.protocols import (
    Allocator,
    AllocatorBase,
    Proposer,
    ScheduledSequence,
    Scheduler,
    StepPlan,
)
from pitstop.requests.outputs import RequestOutput
from pitstop.requests.request_state import RequestState, accept_token, token_logprobs
from pitstop.requests.sequence import Sequence, SequenceStatus
from pitstop.runner.launched import LaunchedStep
from pitstop.speculation.spec_adaptation import SpeculationPolicy

# the engine's logger: these messages are the engine's
log = logging.getLogger("pitstop.loop.engine")


@attrs.define(eq=False)
class InFlightStep:
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


class StepResults:
    """Turning a step's results into tokens, finishes and outputs.

    Built from the engine's request table, allocator and scheduler (and what
    the stop checks and statistics read); ``on_step``, when given, is called
    with each applied step's :class:`StepStats` (the ``on_step_finished``
    observers). ``eos_token_ids`` is the engine's set of end-of-sequence ids.
    """

    def __init__(
        self,
        requests: RequestTable,
        allocator: Allocator,
        scheduler: Scheduler,
        *,
        config: EngineConfig,
        stats: EngineStats,
        tokenizer: Tokenizer | None,
        eos_token_ids: frozenset[int],
        proposer: Proposer | None = None,
        spec_policy: SpeculationPolicy | None = None,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        self.requests = requests
        self.allocator = allocator
        self.scheduler = scheduler
        self.config = config
        self.stats = stats
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.proposer = proposer
        self.spec_policy = spec_policy
        self.on_step = on_step
        self._failed_outputs: list[RequestOutput] = []  # requests a failed step stopped

    def take_failed(self) -> list[RequestOutput]:
        """The final outputs of the requests failed since the last call (each once)."""
        failed, self._failed_outputs = self._failed_outputs, []
        return failed

    def _apply_tokens(self, seq: Sequence, inp: SeqInput, res: SeqResult) -> RequestState:
        """One sequence's tokens from a step: resolve, stop checks, text; returns its request.

        The request's output is built once per step by the caller, after all of its
        samples' tokens are in (building it per sample cost O(n^2) for ``n`` samples).
        """
        num_drafts = inp.num_logits - 1
        sample = self.requests.sample(seq.seq_id)
        req = self.requests.request_of(seq.seq_id)
        assert sample is not None and req is not None
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
        req = self.requests.request_of(seq.seq_id)
        assert req is not None
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

    def _decode_one(self, token: int) -> str | None:
        """One token's text, for log-probabilities (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def isolate_failure(
        self,
        runner: Any,
        scheduled: list[ScheduledSequence],
        inputs: list[SeqInput],
        exc: Exception,
    ) -> LaunchedStep:
        """A launch failed: run each sequence of the step alone; fail only those that fail alone.

        Each sequence reruns as a step of its own (synchronously, with the
        previous step's samples restored before each, so pending tokens read
        the right values). A sequence that fails alone is finished with reason
        ``"error"`` and its pages freed; the others get their results as if
        the step had run whole. A step of one sequence is not rerun.
        ``runner`` is the engine's (its ``launch`` failed).
        """
        log.warning("a step of %d sequence(s) failed (%s); isolating the cause", len(inputs), exc)
        self.stats.step_failures += 1
        saved = runner.save_samples()
        results: list[SeqResult] = []
        kept: list[tuple[int, int]] = []  # (seq_id, sampled token) of the sequences that ran
        for s, inp in zip(scheduled, inputs, strict=True):
            error: Exception | None = exc if len(inputs) == 1 else None
            if error is None:
                runner.restore_samples(saved)
                try:
                    alone_output = runner.launch(StepInput([inp])).result()
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
        runner.adopt_samples(kept)
        return LaunchedStep(inputs, ready=StepOutput(results))

    def _fail_request(self, seq: Sequence, error: Exception) -> None:
        """Finish ``seq``'s request with reason ``"error"``: pages freed, output emitted next.

        Every sample of the request stops (the request failed); ``seq`` gets
        reason ``"error"``, its siblings ``"abort"``.
        """
        req = self.requests.request_of(seq.seq_id)
        if req is None:
            return
        log.error("request %s failed and was stopped: %s", req.request_id, error)
        self.requests.stop(req, self.scheduler)
        seq.fail()
        self.stats.requests_failed += 1
        output = self.requests.finish(req, error=f"{type(error).__name__}: {error}")
        self._failed_outputs.append(output)

    def _apply_sequence(
        self, seq: Sequence, inp: SeqInput, res: SeqResult, result: StepOutput
    ) -> RequestState | None:
        """Apply one sequence's share of a step; its request when it sampled tokens, None when
        there is nothing to emit (finished or aborted meanwhile, failed, or not sampling)."""
        if seq.is_finished:
            return None  # finished (or aborted) since this step was launched: discard its token
        if seq.seq_id in result.poisoned_seq_ids:
            self._fail_request(seq, PoisonedReadError(seq.seq_id))
            return None
        if inp.num_logits == 1 and seq.status is SequenceStatus.RUNNING:
            self.allocator.on_tokens_computed(seq)
        if res.prompt_logprobs is not None:
            self._add_prompt_logprobs(seq, inp, res)
            if seq.is_finished:
                return None
        if not inp.sample:
            return None
        try:
            return self._apply_tokens(seq, inp, res)
        except Exception as exc:  # e.g. a detokenizer error: this request only
            self._fail_request(seq, exc)
            return None

    def apply(self, launched: InFlightStep, stream: bool) -> list[RequestOutput]:
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
            req = self._apply_sequence(seq, inp, res, result)
            if req is None:
                continue
            if seq.is_finished:
                finished.append(seq)
            touched[req.request_id] = req
        for rid, req in touched.items():  # one output per request and step, in order
            if rid not in self.requests:
                continue  # failed meanwhile: its output is already queued
            if req.finished:
                outputs.append(self.requests.finish(req))
            elif stream:
                outputs.append(req.output())
        self.stats.prompt_tokens += prefill_tokens
        self.stats.requests_finished += sum(1 for out in outputs if out.finished)
        self.requests.forget(seq.seq_id for seq in finished)
        self.scheduler.on_step_done(launched.plan, finished)
        alloc = self.allocator.stats()
        self.stats.steps += 1
        self.stats.utilization_sum += alloc.utilization
        if self.on_step is not None:
            self.on_step(
                StepStats(
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
            self.requests.reset([seq.seq_id])
        self.allocator.on_tokens_computed(seq)
        self.stats.spec_verifications += 1
        self.stats.spec_proposed_tokens += num_drafts
        self.stats.spec_accepted_tokens += num_accepted
        assert self.proposer is not None and self.spec_policy is not None
        self.proposer.on_accepted(seq, num_accepted)
        self.spec_policy.record(seq, num_drafts, num_accepted)
