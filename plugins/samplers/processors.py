"""The built-in logits processors: what a sampler applies to a step's logits before it draws.

The sampler builds each step's :class:`~pitstop.plugins.samplers.batch.SamplingBatch`
(:func:`pitstop.plugins.samplers.batch.make_sampling_batch` and ``make_step_inputs``: the
per-row tensors of penalties, ``logit_bias``, blocked tokens, allowed tokens, a grammar's
bitmask and the requests' own callables); the sampler applies them. In order: the
structured-output bitmask and ``allowed_token_ids`` (disallowed tokens to -inf),
``logit_bias`` (added), the blocked tokens (EOS and stop tokens before ``min_tokens``,
``bad_words``: to -inf), the repetition penalty, the frequency and presence penalties, then
the requests' own ``logits_processors``, each batched over the rows that use it. The
engine never calls them: a sampler that applies them calls
:func:`apply_logits_processors` first and says so with ``supports_logits_processors =
True`` (the ``standard`` sampler does; a third-party sampler may import this module, one of
pitstop's plugin APIs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pitstop.entrypoints.sampling_params import processor_arity
from pitstop.errors import InvalidRequestError
from pitstop.plugins.samplers.batch import SamplingBatch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[B, V]`` with every token whose bit is 0 in ``bitmask`` set to -inf.

    ``bitmask`` is a grammar backend's ``[B, ceil(V / 32)]`` int32 words (bit ``j``
    of word ``w`` allows token ``32 * w + j``). Runs on the logits' device, for the
    whole batch at once: the words are expanded into bits with one shift-and-mask.
    """
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def _mask_bitmask(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    assert batch.token_bitmask is not None
    return apply_bitmask(raw, batch.token_bitmask)


def _mask_allowed(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    assert batch.allowed is not None
    return raw.masked_fill(~batch.allowed, float("-inf"))


def _add_logit_bias(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    assert batch.logit_bias is not None
    rows, ids, values = batch.logit_bias
    return raw.index_put((rows, ids), values, accumulate=True)


def _mask_blocked(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    assert batch.blocked is not None
    return raw.index_put(batch.blocked, torch.tensor(float("-inf"), device=raw.device))


def _run_user_processors(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return run_user_processors(raw, batch.user_processors)


def _apply_penalties(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, from the rows' token history."""
    assert batch.history is not None and batch.prompt_lens is not None
    assert batch.presence_penalty is not None and batch.frequency_penalty is not None
    assert batch.repetition_penalty is not None
    rows, vocab = raw.shape
    history = batch.history  # padded with `vocab`: one extra column, dropped below
    position = torch.arange(history.shape[1], device=raw.device).unsqueeze(0)
    is_output = position >= batch.prompt_lens.unsqueeze(1)
    output_ids = torch.where(is_output, history, torch.full_like(history, vocab))
    counts = torch.zeros(rows, vocab + 1, device=raw.device, dtype=raw.dtype)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=raw.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(rows, vocab + 1, device=raw.device, dtype=torch.bool)
    seen.scatter_(1, history, True)
    seen = seen[:, :vocab]
    penalty = batch.repetition_penalty.unsqueeze(1)
    repeated = torch.where(raw > 0, raw / penalty, raw * penalty)
    raw = torch.where(seen, repeated, raw)
    raw = raw - batch.frequency_penalty.unsqueeze(1) * counts
    return raw - batch.presence_penalty.unsqueeze(1) * (counts > 0).to(raw.dtype)


# The logits processors in the order they run: (whether a batch uses it, what it does).
# One table, so that :func:`uses_logits_processors` (the greedy sampler's fast path asks it)
# and :func:`apply_logits_processors` cannot disagree about a processor added here.
_PROCESSORS: tuple[
    tuple[
        Callable[[SamplingBatch], bool],
        Callable[[torch.Tensor, SamplingBatch], torch.Tensor],
    ],
    ...,
] = (
    (lambda b: b.token_bitmask is not None, _mask_bitmask),
    (lambda b: b.allowed is not None, _mask_allowed),
    (lambda b: b.logit_bias is not None, _add_logit_bias),
    (lambda b: b.blocked is not None, _mask_blocked),
    (lambda b: b.needs_penalties and b.history is not None, _apply_penalties),
    (lambda b: bool(b.user_processors), _run_user_processors),
)


def uses_logits_processors(batch: SamplingBatch) -> bool:
    """Whether :func:`apply_logits_processors` would change any row of ``batch``'s logits."""
    return any(used(batch) for used, _ in _PROCESSORS)


def apply_logits_processors(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits processors of ``batch`` over float32 logits ``[B, V]``, on their device.

    In order: the structured-output bitmask and ``allowed_token_ids``
    (disallowed tokens to -inf), ``logit_bias`` (added), the blocked tokens
    (EOS and stop tokens before ``min_tokens``, ``bad_words``: to -inf), the
    repetition penalty, the frequency and presence penalties, then the
    requests' own ``logits_processors``. Rows that use none are returned
    unchanged. A sampler plugin calls this first and sets
    ``supports_logits_processors = True``.
    """
    for used, apply in _PROCESSORS:
        if used(batch):
            raw = apply(raw, batch)
    return raw


def run_user_processors(
    raw: torch.Tensor,
    rows: Sequence[tuple[int, tuple[Any, ...], tuple[int, ...], tuple[int, ...]]],
) -> torch.Tensor:
    """The requests' own ``logits_processors`` over their rows of ``raw`` ``[B, V]``.

    Each callable gets its row's token ids as lists and the row's logits (a
    copy: ``[V]``) and returns the new row, ``fn(output_ids, logits)`` or
    ``fn(prompt_ids, output_ids, logits)``; the new rows go back into the
    batch in one ``index_copy``. A result of another shape or a non-tensor
    is an :class:`InvalidRequestError` (that request fails, its neighbours run).
    """
    index: list[int] = []
    new_rows: list[torch.Tensor] = []
    for i, fns, prompt_ids, output_ids in rows:
        row = raw[i].clone()
        for fn in fns:
            args = (list(output_ids), row)
            if processor_arity(fn) == 3:
                args = (list(prompt_ids), *args)
            out = fn(*args)
            if not isinstance(out, torch.Tensor) or out.shape != row.shape:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise InvalidRequestError(
                    f"logits_processors: {getattr(fn, '__qualname__', fn)} returned {shape}; "
                    f"return the row's logits, a tensor of shape {tuple(row.shape)}"
                )
            row = out.to(device=raw.device, dtype=raw.dtype)
        index.append(i)
        new_rows.append(row)
    at = torch.tensor(index, device=raw.device)
    return raw.index_copy(0, at, torch.stack(new_rows))
