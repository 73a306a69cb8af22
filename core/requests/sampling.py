"""Turning per-request sampling parameters into the tensors a sampler reads.

The engine keeps one :class:`torch.Generator` per seeded request (made with
:func:`make_generator` when the request arrives, and kept for its whole life so
that its draws continue where the previous step stopped), and each step calls
:func:`make_sampling_batch` with the rows' parameters and generators in the
order of the logits' rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from pitstop.requests.sampling_batch import SamplingBatch
from pitstop.requests.sampling_params import (  # noqa: F401  (SAMPLING_EPS re-exported)
    SAMPLING_EPS,
    SamplingParams,
)

if TYPE_CHECKING:
    from pitstop.plugin_system.grammar import GrammarMatcher


def is_greedy(params: SamplingParams) -> bool:
    """Whether ``params`` reduce to argmax (:attr:`SamplingParams.greedy`)."""
    return params.greedy


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: one per seeded request, kept across steps."""
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


@attrs.frozen
class RowInputs:
    """What one row's logits processors read this step, besides its fixed :class:`SamplingParams`.

    ``history`` is the sequence's live token list (prompt, then output; a
    last token still on the device is :data:`~pitstop.requests.sequence.PENDING_TOKEN`),
    given only when a penalty is set and read during the launch only.
    ``blocked_token_ids`` are masked this step (EOS and stop tokens before
    ``min_tokens``, ``bad_words``); ``grammar`` is the structured-output
    matcher; ``allowed_token_ids`` the only tokens the row may sample.
    ``logits_processors`` are the request's own callables, given
    ``prompt_ids`` and the known ``output_ids`` (the engine applies the step
    in flight first, so that none is pending).
    """

    history: list[int] | None = None
    num_prompt_tokens: int = 0
    blocked_token_ids: tuple[int, ...] = ()
    grammar: GrammarMatcher | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    logits_processors: tuple[Any, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    reads_tokens: bool = False  # bad_words or logits_processors read the known output tokens

    @property
    def needs_host_tokens(self) -> bool:
        """Whether this row's processors read its last token on the host (grammar, bad words,
        logits processors): the step before must be applied before this one is planned."""
        return self.grammar is not None or self.reads_tokens


class TokenHistories:
    """Every penalized sequence's known tokens in a growing numpy array, by sequence id.

    A step copies only the tokens that arrived since the last one (a token,
    once known, never changes; preemption keeps tokens), so building the
    step's ``[rows, length]`` history costs one memcpy per row instead of
    converting whole Python lists. The runner forgets finished sequences.
    """

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop the histories of sequences that are gone."""
        for seq_id in seq_ids:
            self._arrays.pop(seq_id, None)

    def row(self, seq_id: int, tokens: list[int]) -> np.ndarray:
        """``tokens`` (a live token list, maybe ending in one pending -1) as an int64 array."""
        pending = bool(tokens) and tokens[-1] < 0
        known = len(tokens) - pending
        array, have = self._arrays.get(seq_id, (np.empty(0, dtype=np.int64), 0))
        if have > known:  # cannot happen while tokens only grow; start over if it does
            have = 0
        if known + 1 > len(array):
            grown = np.empty(max(64, 2 * (known + 1)), dtype=np.int64)
            grown[:have] = array[:have]
            array = grown
        if known > have:
            array[have:known] = tokens[have:known]
        self._arrays[seq_id] = (array, known)
        if pending:
            array[known] = -1  # scratch slot after the known tokens: read from the device later
        return array[: known + pending]


def to_device(
    values: list | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied from pinned memory without blocking the host."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def make_step_inputs(
    batch: SamplingBatch,
    rows: Sequence[RowInputs | None],
    pending_rows: Sequence[int],
    last_sampled: torch.Tensor,
    vocab_size: int,
    *,
    seq_ids: Sequence[int] | None = None,
    histories: TokenHistories | None = None,
) -> SamplingBatch:
    """``batch`` plus this step's per-row tensors: token history, blocked tokens, grammar bitmask.

    ``pending_rows[i]`` is the row of ``last_sampled`` (the previous launched
    step's samples, on the device) that holds row ``i``'s pending token, if
    its last token is pending. History is padded with ``vocab_size`` (a
    column the sampler drops); a pending token is read on the device, so
    nothing here waits for the previous step. ``histories`` (kept by the
    runner, keyed by ``seq_ids``) makes each step copy only new tokens.
    """
    device = last_sampled.device
    history = prompt_lens = None
    if batch.needs_penalties:
        histories = histories if histories is not None else TokenHistories()
        keys = seq_ids if seq_ids is not None else range(len(rows))
        arrays = [
            histories.row(key, r.history) if r is not None and r.history else None
            for key, r in zip(keys, rows, strict=True)
        ]
        width = max((len(a) for a in arrays if a is not None), default=1)
        padded = np.full((len(rows), width), vocab_size, dtype=np.int64)
        for i, array in enumerate(arrays):
            if array is not None:
                padded[i, : len(array)] = array
        history = to_device(torch.from_numpy(padded), torch.int64, device)
        pending = last_sampled[to_device(list(pending_rows), torch.int64, device)]
        history = torch.where(history < 0, pending.unsqueeze(1), history)
        lens = [r.num_prompt_tokens if r is not None else 0 for r in rows]
        prompt_lens = to_device(lens, torch.int64, device)
    blocked_rows: list[int] = []
    blocked_ids: list[int] = []
    states = []
    for i, r in enumerate(rows):
        states.append(r.grammar if r is not None else None)
        if r is not None and r.blocked_token_ids:
            blocked_rows += [i] * len(r.blocked_token_ids)
            blocked_ids += r.blocked_token_ids
    blocked = None
    if blocked_rows:
        blocked = (
            to_device(blocked_rows, torch.int64, device),
            to_device(blocked_ids, torch.int64, device),
        )
    bitmask = None
    first = next((g for g in states if g is not None), None)
    if first is not None:
        bitmask = to_device(first.backend.bitmask(states), torch.int32, device)
    allowed = None
    if any(r is not None and r.allowed_token_ids is not None for r in rows):
        mask = torch.ones(len(rows), vocab_size, dtype=torch.bool)
        for i, r in enumerate(rows):
            if r is not None and r.allowed_token_ids is not None:
                mask[i] = False
                mask[i, list(r.allowed_token_ids)] = True
        allowed = to_device(mask, torch.bool, device)
    user = tuple(
        (i, r.logits_processors, r.prompt_ids, r.output_ids)
        for i, r in enumerate(rows)
        if r is not None and r.logits_processors
    )
    return attrs.evolve(
        batch,
        history=history,
        prompt_lens=prompt_lens,
        blocked=blocked,
        token_bitmask=bitmask,
        allowed=allowed,
        user_processors=user,
    )


def make_sampling_batch(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    device: torch.device | str,
) -> SamplingBatch:
    """Build the per-row tensors and flags of one step's :class:`SamplingBatch`.

    Row ``i`` uses ``params[i]`` and ``generators[i]`` (None: the sampler's own
    shared generator). Greedy rows (temperature < 1e-5, or top_k 1) get
    temperature 0 and their filters switched off, so the ``needs_*`` flags
    only say whether some *sampled* row uses that filter.
    """
    if len(params) != len(generators):
        raise ValueError(
            f"{len(params)} sampling params but {len(generators)} generators; pass one per row"
        )
    device = torch.device(device)
    penalties = any(p.needs_penalties for p in params)
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for i, p in enumerate(params):
        for token, value in p.logit_bias:
            bias_rows.append(i)
            bias_ids.append(token)
            bias_values.append(value)
    temperature: list[float] = []
    top_k: list[int] = []
    top_p: list[float] = []
    min_p: list[float] = []
    for p in params:
        if is_greedy(p):
            temperature.append(0.0)
            top_k.append(-1)
            top_p.append(1.0)
            min_p.append(0.0)
        else:
            temperature.append(float(p.temperature))
            top_k.append(int(p.top_k))
            top_p.append(float(p.top_p))
            min_p.append(float(p.min_p))

    return SamplingBatch(
        temperature=to_device(temperature, torch.float32, device),
        top_k=to_device(top_k, torch.int64, device),
        top_p=to_device(top_p, torch.float32, device),
        min_p=to_device(min_p, torch.float32, device),
        generators=list(generators),
        all_greedy=all(t == 0.0 for t in temperature),
        needs_top_k=any(k != -1 for k in top_k),
        needs_top_p=any(v < 1.0 for v in top_p),
        needs_min_p=any(v > 0.0 for v in min_p),
        want_logprobs=any(p.logprobs is not None for p in params),
        max_logprobs=-1
        if any(p.logprobs == -1 for p in params)
        else max((p.logprobs or 0 for p in params), default=0),
        needs_penalties=penalties,
        presence_penalty=to_device([p.presence_penalty for p in params], torch.float32, device)
        if penalties
        else None,
        frequency_penalty=to_device([p.frequency_penalty for p in params], torch.float32, device)
        if penalties
        else None,
        repetition_penalty=to_device([p.repetition_penalty for p in params], torch.float32, device)
        if penalties
        else None,
        logit_bias=(
            to_device(bias_rows, torch.int64, device),
            to_device(bias_ids, torch.int64, device),
            to_device(bias_values, torch.float32, device),
        )
        if bias_rows
        else None,
        # -1 when some row keeps every token (its k becomes the vocabulary size)
        max_top_k=-1 if any(k < 1 for k in top_k) else max(top_k, default=-1),
    )
