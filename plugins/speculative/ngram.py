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
``prompt_lookup_max`` tokens back from each candidate.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

import pitstop
from pitstop.protocols import Proposal, ProposerBase
from pitstop.settings import engine_setting, read_settings
from pitstop.speculative import draft_room

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.sequence import Sequence
    from pitstop.speculative import ProposerContext


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
    """The settings of the ``ngram`` proposer (engine settings ``prompt_lookup_*``)."""

    max_n: int = engine_setting("prompt_lookup_max", help="longest n-gram matched")
    min_n: int = engine_setting("prompt_lookup_min", help="shortest n-gram matched")


class NgramProposer(ProposerBase):
    """Prompt lookup over each sequence's own tokens."""

    def __init__(self, config: EngineConfig) -> None:
        settings = read_settings(config, "ngram", NgramSettings)
        self.max_n = settings.max_n
        self.min_n = settings.min_n
        assert config.max_model_len is not None
        self.max_model_len = config.max_model_len

    def propose(self, seqs: Seq[Sequence], k: int) -> list[Proposal]:
        """Up to ``k`` tokens per sequence (fewer near its ``max_tokens`` or ``max_model_len``)."""
        out = []
        for seq in seqs:
            room = draft_room(seq, k, self.max_model_len)
            ids = lookup(seq.token_ids, room, self.max_n, self.min_n) if room else []
            out.append(Proposal(ids))
        return out

    def on_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Nothing to roll back: the proposer keeps no state."""


def create_ngram(config: EngineConfig, context: ProposerContext) -> NgramProposer:
    """Prompt-lookup drafting: propose what followed the last n-gram's previous occurrence."""
    del context
    return NgramProposer(config)


@pitstop.hookimpl
def register_proposers(register: Any) -> None:
    """Register the ``ngram`` proposer."""
    register("ngram", create_ngram, settings=NgramSettings)
