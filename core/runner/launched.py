"""A launched step: the handle :meth:`ModelRunner.launch` returns, whose result waits for its tokens.

The handle is the in-flight step as a value: the engine keeps it while the
device computes and asks for its :class:`~pitstop.ground.step.StepOutput` after
launching the next step. Its sampled ids travel to pinned host memory by one
non-blocking copy, completed on an event: launching the next step never
waits for them.
"""

from __future__ import annotations

import attrs
import torch

from pitstop.ground.poison import poisoned_seq_ids
from pitstop.ground.step import NO_TOKENS, PromptLogprobs, SeqInput, SeqResult, StepOutput
from pitstop.plugin_system.verifier import DeviceVerified

# host copies of (top ids, top logprobs, ranks) when logprobs were asked
TopLogprobs = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]


class LaunchedStep:
    """A step whose work is queued on the device; :meth:`result` waits for its tokens.

    The sampled ids travel to a pinned host buffer by one non-blocking copy,
    completed on an event: launching the next step never waits for them.
    """

    def __init__(
        self,
        seqs: list[SeqInput],
        tokens: torch.Tensor | None = None,
        logprobs: torch.Tensor | None = None,
        event: torch.cuda.Event | None = None,
        ready: StepOutput | None = None,
        top: TopLogprobs | None = None,
        prompt: dict[int, PromptLogprobs] | None = None,
        nonfinite: torch.Tensor | None = None,
    ) -> None:
        self.seqs = seqs
        self._tokens, self._logprobs, self._event = tokens, logprobs, event
        self._nonfinite = nonfinite  # poison_memory: per logits row, NaN anywhere (host, pinned)
        self._top = top
        self._prompt = prompt or {}  # input index -> prompt log-probabilities (prompt_logprobs)
        self._ready = ready
        if ready is not None and self._prompt:
            self._ready = StepOutput(self._with_prompt(list(ready.results)))

    def _with_prompt(self, results: list[SeqResult]) -> list[SeqResult]:
        """``results`` with each input's prompt log-probabilities put in."""
        for i, prompt in self._prompt.items():
            results[i] = attrs.evolve(results[i], prompt_logprobs=prompt)
        return results

    def result(self) -> StepOutput:
        """Wait for the step's tokens; one result per input sequence."""
        if self._ready is not None:
            return self._ready
        if self._event is not None:
            self._event.synchronize()
        results = self._with_prompt(self._sampled_results())
        self._ready = StepOutput(results, poisoned_seq_ids(self.seqs, self._nonfinite))
        self._tokens = self._logprobs = self._event = self._top = self._nonfinite = None
        return self._ready

    def _sampled_results(self) -> list[SeqResult]:
        """One result per input: its sampled token (with log-probabilities), or none."""
        tokens = self._tokens.tolist() if self._tokens is not None else []
        logprobs = self._logprobs.tolist() if self._logprobs is not None else None
        top_ids = top_lps = ranks = None
        if self._top is not None:
            ids_t, lps_t, ranks_t = self._top
            ranks = ranks_t.tolist()
            if ids_t is not None and lps_t is not None:
                top_ids, top_lps = ids_t.tolist(), lps_t.tolist()
        results: list[SeqResult] = []
        row = 0
        for s in self.seqs:
            if not s.sample:
                results.append(NO_TOKENS)
                continue
            lp = [logprobs[row]] if logprobs is not None else None
            top = None
            if top_ids is not None and top_lps is not None:
                top = [list(zip(top_ids[row], top_lps[row], strict=True))]
            rank = [ranks[row]] if ranks is not None else None
            results.append(SeqResult([tokens[row]], lp, top, rank))
            row += 1
        return results


class LaunchedVerification(LaunchedStep):
    """A verification step on its way: its packed results travel to pinned host memory.

    One non-blocking copy, completed on an event; :meth:`result` waits for it
    (the step's one host-device synchronization) and unpacks.
    """

    def __init__(
        self, seqs: list[SeqInput], verified: DeviceVerified, nonfinite: torch.Tensor | None = None
    ) -> None:
        super().__init__(seqs, nonfinite=nonfinite)
        self._verified = verified
        cuda = verified.packed.device.type == "cuda"
        self._packed = verified.packed.to("cpu", non_blocking=cuda)
        self._lps = None
        if verified.logprobs is not None:
            self._lps = verified.logprobs.to("cpu", non_blocking=cuda)
        self._done: torch.cuda.Event | None = None
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> StepOutput:
        """Wait for the copy; the accepted drafts and one more token per sampling sequence."""
        if self._ready is not None:
            return self._ready
        if self._done is not None:
            self._done.synchronize()
        lps = self._lps.tolist() if self._lps is not None else None
        v = self._verified.unpack(self._packed.tolist(), lps)
        emitted = iter(range(len(v.token_ids)))
        results = []
        for s in self.seqs:
            if not s.sample:
                results.append(NO_TOKENS)
                continue
            i = next(emitted)
            results.append(SeqResult(v.token_ids[i], v.logprobs[i] if v.logprobs else None))
        self._ready = StepOutput(results, poisoned_seq_ids(self.seqs, self._nonfinite))
        return self._ready


def ready_step(seqs: list[SeqInput], results: list[SeqResult] | None = None) -> LaunchedStep:
    """A handle whose results are known already (``results``; default: no tokens for any)."""
    return LaunchedStep(
        seqs, ready=StepOutput(results if results is not None else [NO_TOKENS] * len(seqs))
    )


def to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A non-blocking copy of ``tensor`` into pinned host memory (complete at the step's event)."""
    if tensor is None or tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
