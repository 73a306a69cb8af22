"""The engine's live requests: :class:`RequestTable` owns every unfinished request,
its samples (by the sequence id the runner knows), the ids it hands out, and the
sequence ids the runner is told of at the next launch (gone, or block tables rebuilt).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from pitstop.plugin_system.protocols import Scheduler
from pitstop.requests.outputs import RequestOutput
from pitstop.requests.request_state import RequestState, SampleState
from pitstop.requests.sequence import Sequence


class RequestTable:
    """The live requests and their samples; what the engine adds, looks up, stops and drops.

    ``release(seq)`` is called for each sample of a request as it is dropped
    (e.g. the proposer's per-sequence state); ``on_finished(output)``, when
    given, for each request finished (the ``on_request_finished`` observers).
    """

    def __init__(
        self,
        release: Callable[[Sequence], None] | None = None,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self._requests: dict[str, RequestState] = {}
        self._samples: dict[int, SampleState] = {}  # by sequence id: each one's record
        self._request_ids = itertools.count()
        # Sequence ids count from 0 in every engine, so an engine behaves the same whatever ran
        # before it in the process (ids are keys of the runner's per-sequence state).
        self._seq_ids = itertools.count()
        self._gone: list[int] = []  # finished since the last launch (the runner forgets them)
        self._reset: list[int] = []  # block tables rebuilt since the last launch
        self._release = release
        self._on_finished = on_finished

    # ------------------------------------------------------------------ ids
    def new_request_id(self) -> str:
        """A request id of this engine's own (``req-0``, ``req-1``, ...)."""
        return f"req-{next(self._request_ids)}"

    def new_seq_id(self) -> int:
        """The next sequence id (from 0 in every engine)."""
        return next(self._seq_ids)

    # ------------------------------------------------------------------ look-ups
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, request_id: str) -> RequestState | None:
        """The live request ``request_id``, or None."""
        return self._requests.get(request_id)

    def sample(self, seq_id: int) -> SampleState | None:
        """The live sample whose sequence has id ``seq_id``, or None."""
        return self._samples.get(seq_id)

    def request_of(self, seq_id: int) -> RequestState | None:
        """The live request the sequence ``seq_id`` belongs to, or None."""
        sample = self._samples.get(seq_id)
        return None if sample is None else self._requests.get(sample.request_id)

    def samples(self) -> Iterator[SampleState]:
        """Every live sample, in the order they were added."""
        return iter(self._samples.values())

    def live_sequences(self) -> dict[int, Sequence]:
        """The live sequences by id (a new dict: the caller may keep it)."""
        return {seq_id: sample.seq for seq_id, sample in self._samples.items()}

    # ------------------------------------------------------------------ changes
    def add(self, req: RequestState) -> None:
        """Make ``req`` and its samples live (its id must be new: see ``in``)."""
        assert req.request_id not in self._requests
        for sample in req.samples:
            self._samples[sample.seq.seq_id] = sample
        self._requests[req.request_id] = req

    def stop(self, req: RequestState, scheduler: Scheduler) -> None:
        """Abort every unfinished sample of ``req`` (out of ``scheduler``); the runner forgets them."""
        for sample in req.samples:
            seq = sample.seq
            if seq.is_finished:
                continue
            if scheduler.abort(seq.request_id) is None or not seq.is_finished:
                seq.abort()
            self._gone.append(seq.seq_id)
        req.held_back = []

    def finish(self, req: RequestState, error: str | None = None) -> RequestOutput:
        """Drop a finished request (every sample stopped) and return its final output."""
        self.drop(req)
        output = req.output(error=error)
        if self._on_finished is not None:
            self._on_finished(output)
        return output

    def drop(self, req: RequestState) -> None:
        """Forget ``req`` and its samples (each released); nothing is emitted."""
        self._requests.pop(req.request_id, None)
        for sample in req.samples:
            self._samples.pop(sample.seq.seq_id, None)
            if self._release is not None:
                self._release(sample.seq)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Sequences finished: the runner drops their state at the next launch."""
        self._gone.extend(seq_ids)

    def reset(self, seq_ids: Iterable[int]) -> None:
        """Sequences whose block tables changed (preempted, drafts rejected)."""
        self._reset.extend(seq_ids)

    def take_runner_changes(self) -> tuple[list[int], list[int]]:
        """The (forgotten, reset) sequence ids since the last call, for the next launch."""
        gone, reset = self._gone, self._reset
        self._gone, self._reset = [], []
        return gone, reset
