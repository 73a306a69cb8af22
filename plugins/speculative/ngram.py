"""``ngram``: prompt-lookup drafting, no second model.

For each sequence, find the most recent earlier occurrence of its last ``n``
tokens in its own prompt and output, for ``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min`` (a longer match wins over a more recent
shorter one), and propose the (up to) ``k`` tokens that followed it. No
match proposes nothing. Drafts are point masses (no probabilities): the core
keeps draft ``d`` with the target's probability ``p(d)``.

It helps where the output repeats its context (editing, summarizing with
quotes, code, extraction); elsewhere the drafts are rejected and the step
costs k more tokens of compute per sequence.

The search is vectorized with numpy: one comparison over the sequence for
the candidates that end with the last token, then a check of at most
``prompt_lookup_max`` tokens back from each candidate. Each sequence's
tokens are kept in a numpy array that grows by the tokens appended since the
last proposal (a sequence's tokens only ever grow), so a proposal never
converts the whole sequence again.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

import pitstop
from pitstop.errors import ConfigError
from pitstop.plugin_system.protocols import Proposal, ProposerBase
from pitstop.plugin_system.settings import setting
from pitstop.speculation.speculative import draft_room

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.requests.sequence import Sequence
    from pitstop.speculation.speculative import ProposerContext


def lookup(tokens: Seq[int] | np.ndarray, k: int, max_n: int, min_n: int = 1) -> list[int]:
    """The up-to-``k`` tokens that followed the latest earlier occurrence of the longest suffix n-gram.

    ``n`` runs from ``max_n`` down to ``min_n``; the occurrence must start
    before the suffix itself does (it may overlap it).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    if k <= 0 or size < min_n + 1:
        return []
    max_n = min(max_n, size - 1)
    # Candidate end positions j < size - 1 of an earlier n-gram: arr[j] equals the last token.
    ends = np.flatnonzero(arr[: size - 1] == arr[-1])
    if ends.size == 0:
        return []
    # How far back (up to max_n) each candidate agrees with the suffix.
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for m in range(1, max_n):
        back = ends - m
        ok = alive & (back >= 0)
        ok[ok] = arr[back[ok]] == arr[size - 1 - m]
        alive = ok
        length += alive
        if not alive.any():
            break
    for n in range(max_n, min_n - 1, -1):
        hits = ends[length >= n]
        if hits.size:
            j = int(hits[-1])  # the most recent
            return arr[j + 1 : j + 1 + k].tolist()
    return []


@attrs.frozen
class NgramSettings:
    """The settings of the ``ngram`` proposer (``ngram.max_n``, or vLLM's ``prompt_lookup_max``)."""

    max_n: int = setting(
        4, type=int, minimum=1, alias="prompt_lookup_max", help="longest n-gram matched"
    )
    min_n: int = setting(
        1, type=int, minimum=1, alias="prompt_lookup_min", help="shortest n-gram matched"
    )

    def __attrs_post_init__(self) -> None:
        if self.min_n > self.max_n:
            raise ConfigError(
                f"prompt_lookup_min ({self.min_n}) must not exceed prompt_lookup_max ({self.max_n})"
            )


class NgramProposer(ProposerBase):
    """Prompt lookup over each sequence's own tokens."""

    def __init__(self, config: EngineConfig, *, settings: NgramSettings) -> None:
        self.max_n = settings.max_n
        self.min_n = settings.min_n
        assert config.max_model_len is not None
        self.max_model_len = config.max_model_len
        self._tokens: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, tokens in it)

    def _token_array(self, seq: Sequence) -> np.ndarray:
        """``seq``'s tokens as a numpy array, copying only those appended since the last call."""
        buffer, known = self._tokens.get(seq.seq_id, (np.empty(0, dtype=np.int64), 0))
        n = seq.num_tokens
        if n < known:  # not the same sequence's tokens any more: start over
            known = 0
        if n > buffer.shape[0]:
            grown = np.empty(max(n, 2 * buffer.shape[0], 64), dtype=np.int64)
            grown[:known] = buffer[:known]
            buffer = grown
        buffer[known:n] = seq.token_ids[known:n]
        self._tokens[seq.seq_id] = (buffer, n)
        return buffer[:n]

    def propose(self, seqs: Seq[Sequence], k: int) -> list[Proposal]:
        """Up to ``k`` tokens per sequence (fewer near its ``max_tokens`` or ``max_model_len``)."""
        out = []
        for seq in seqs:
            room = draft_room(seq, k, self.max_model_len)
            ids = lookup(self._token_array(seq), room, self.max_n, self.min_n) if room else []
            out.append(Proposal(ids))
        return out

    def on_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Nothing to roll back: rejected drafts never enter a sequence's tokens."""

    def release(self, seq: Sequence) -> None:
        """Drop a finished sequence's token array."""
        self._tokens.pop(seq.seq_id, None)


def create_ngram(
    config: EngineConfig, context: ProposerContext, *, settings: NgramSettings
) -> NgramProposer:
    """Prompt-lookup drafting: propose what followed the last n-gram's previous occurrence."""
    del context
    return NgramProposer(config, settings=settings)


@pitstop.hookimpl
def register_proposers(register: Any) -> None:
    """Register the ``ngram`` proposer."""
    register("ngram", create_ngram, settings=NgramSettings)
