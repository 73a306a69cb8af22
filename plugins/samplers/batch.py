"""The standard sampler's batches: per-request sampling parameters as the tensors it reads.

Its :meth:`~pitstop.plugins.samplers.standard.StandardSampler.make_batch` is
:func:`make_sampling_batch` (the rows' parameters and generators, in the
order of the logits' rows: one :class:`torch.Generator` per seeded request,
made by the runner with :func:`pitstop.plugin_system.sampler.make_generator`
and kept for the request's whole life, so that its draws continue where the
previous step stopped), and its
:meth:`~pitstop.plugins.samplers.standard.StandardSampler.add_step_inputs` is
:func:`make_step_inputs` (the rows' :class:`~pitstop.plugin_system.sampler.RowInputs`
as this step's tensors, the penalized sequences' tokens kept in
:class:`TokenHistories`). A third-party sampler may build its batches with
these functions too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from pitstop.ground.transfer import to_device
from pitstop.plugin_system.sampler import RowInputs
from pitstop.plugins.samplers.bad_words import blocked_now
from pitstop.requests.sampling_params import SamplingParams


@attrs.frozen
class SamplingBatch:
    """Per-row sampling settings of one step's logits, as tensors on the device."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; -1 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    generators: list[torch.Generator | None]  # per-row seeded generator
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    want_logprobs: bool = False
    # whether any row is greedy (its argmax then taken beside the draws); True when unknown
    any_greedy: bool = True
    # The largest top_k over the rows, known on the host so that a sampler never reads it back
    # from the device (that read would stall the overlapped loop); -1: some row keeps every token.
    max_top_k: int = -1
    # logprobs=k: most alternatives any row asks for (0: the chosen only; -1: the whole vocabulary)
    max_logprobs: int = 0
    # Logits processors, applied before greedy/temperature (None: no row uses them).
    needs_penalties: bool = False
    presence_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    # Per step (make_step_inputs):
    history: torch.Tensor | None = None  # [B, L] int64 prompt + output ids, padded with V
    prompt_lens: torch.Tensor | None = None  # [B] int64: history[:, :len] is the prompt
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids masked this step
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 allowed tokens (grammar)
    allowed: torch.Tensor | None = None  # [B, V] bool: allowed_token_ids (True where allowed)
    # logits_processors: per row (row, callables, prompt ids, output ids), run on the host's
    # view of the step after every other processor (pitstop.plugins.samplers.processors)
    user_processors: tuple[tuple[int, tuple[Any, ...], tuple[int, ...], tuple[int, ...]], ...] = ()


def is_greedy(params: SamplingParams) -> bool:
    """Whether ``params`` reduce to argmax (:attr:`SamplingParams.greedy`)."""
    return params.greedy


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
        ids = () if r is None else r.blocked_token_ids
        if r is not None and r.prepared:  # bad_words: the tokens that would complete one
            ids += tuple(blocked_now(r.prepared, r.output_ids))
        if ids:
            blocked_rows += [i] * len(ids)
            blocked_ids += ids
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
        any_greedy=any(t == 0.0 for t in temperature),
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
