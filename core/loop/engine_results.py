"""Applying a launched step's results: each sequence's sampled (or verified)
tokens, stop conditions, prompt log-probabilities, a failure kept to its own
request, and the outputs and statistics of the step.

:class:`StepResults` is a part of :class:`~pitstop.loop.engine.LLMEngine` (which
inherits it); :class:`InFlightStep` is the step the engine's loop carries from
its launch to the application of its results.
"""

from __future__ import annotations

import logging
import time

import attrs

from pitstop.config import EngineConfig
from pitstop.errors import InvalidRequestError
from pitstop.ground.metrics import StepStats
from pitstop.ground.poison import PoisonedReadError
from pitstop.ground.step import SeqInput, SeqResult, StepInput, StepOutput
from pitstop.plugin_system.protocols import AllocatorBase, ScheduledSequence, StepPlan
from pitstop.requests.outputs import RequestOutput
from pitstop.requests.request_state import RequestState, SampleState, accept_token, token_logprobs
from pitstop.requests.sequence import Sequence, SequenceStatus
from pitstop.runner.launched import LaunchedStep

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
    """Turning a step's results into tokens, finishes and outputs (a part of
    :class:`~pitstop.loop.engine.LLMEngine`)."""

    # the engine's own, set in LLMEngine.__init__
    config: EngineConfig
    _requests: dict[str, RequestState]
    _samples: dict[int, SampleState]

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

    def _apply(self, launched: InFlightStep, stream: bool) -> list[RequestOutput]:
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
