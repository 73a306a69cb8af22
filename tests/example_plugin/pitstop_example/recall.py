"""The proposer ``recall``: draft what followed the same tokens last time, in any request.

It keeps one table from a context (the last ``recall.context`` tokens) to
the token that most recently followed it, learnt from every sequence's
prompt and output as they grow. A proposal walks the table from the
sequence's own last tokens: look up the context, append the token found,
shift the context by one, up to ``k`` times; the first context it has never
seen ends the draft. Drafts are point masses (no probabilities), so the
core's verification keeps each with the target's probability, and greedy
output is exactly what plain greedy decoding gives.

Where the built-in ``ngram`` looks only inside the sequence itself, the
table is shared (``recall.shared``, default true): the second request of a
template, a retried request, an agent's repeated tool call are drafted from
the first one's output. ``recall.max_contexts`` bounds the table (the
context seen least recently is forgotten first). With ``shared = false``
each sequence has a table of its own, dropped when it finishes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

import attrs

import pitstop
from pitstop.plugin_system.protocols import Proposal, ProposerBase
from pitstop.plugin_system.settings import read_settings, setting
from pitstop.requests.sequence import Sequence
from pitstop.speculation.speculative import ProposerContext, draft_room

Table = OrderedDict[tuple[int, ...], int]


@attrs.frozen
class RecallSettings:
    """The settings of the ``recall`` proposer: ``--recall.context``, ``[plugins.recall]``."""

    context: int = setting(
        2, type=int, minimum=1, help="tokens of context a continuation is remembered by"
    )
    max_contexts: int = setting(
        1_000_000,
        type=int,
        minimum=1,
        help="most contexts in a table (the one seen least recently is forgotten first)",
    )
    shared: bool = setting(
        True, type=bool, help="one table for every request (false: one per sequence)"
    )


class RecallProposer(ProposerBase):
    """Drafts from a table of the continuations seen after each context."""

    def __init__(self, settings: RecallSettings, max_model_len: int) -> None:
        self.context = settings.context
        self.max_contexts = settings.max_contexts
        self.shared = settings.shared
        self.max_model_len = max_model_len
        self._tables: dict[int | None, Table] = {}  # None: the shared table; else by seq_id
        self._learnt: dict[int, int] = {}  # seq_id -> how many of its tokens the table has seen

    def propose(self, seqs: Seq[Sequence], k: int) -> list[Proposal]:
        """Up to ``k`` drafts per sequence (fewer near its ``max_tokens`` or ``max_model_len``)."""
        out = []
        for seq in seqs:
            table = self._learn(seq)
            room = draft_room(seq, k, self.max_model_len)
            known = seq.num_tokens - seq.num_pending_tokens
            drafts: list[int] = []
            if room and known == seq.num_tokens and known >= self.context:
                key = tuple(seq.token_ids[known - self.context :])
                while len(drafts) < room and (token := table.get(key)) is not None:
                    drafts.append(token)
                    key = key[1:] + (token,)
            out.append(Proposal(drafts))
        return out

    def on_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Nothing to roll back: the table learns only tokens the target emitted."""

    def release(self, seq: Sequence) -> None:
        """Forget how far ``seq`` was learnt, and its own table when tables are not shared."""
        self._learnt.pop(seq.seq_id, None)
        if not self.shared:
            self._tables.pop(seq.seq_id, None)

    def _learn(self, seq: Sequence) -> Table:
        """Add ``seq``'s tokens since the last call to its table; return the table."""
        table = self._tables.setdefault(None if self.shared else seq.seq_id, OrderedDict())
        tokens = seq.token_ids
        known = seq.num_tokens - seq.num_pending_tokens
        n = self.context
        for end in range(max(self._learnt.get(seq.seq_id, 0), n), known):
            key = tuple(tokens[end - n : end])
            table[key] = tokens[end]
            table.move_to_end(key)
        self._learnt[seq.seq_id] = max(known, self._learnt.get(seq.seq_id, 0))
        while len(table) > self.max_contexts:
            table.popitem(last=False)
        return table


def make_recall(config: pitstop.EngineConfig, context: ProposerContext) -> RecallProposer:
    """Propose what followed the same tokens last time, in this or any earlier request."""
    del context  # no draft model, no tokenizer: the table is all it needs
    assert config.max_model_len is not None  # the engine sets it before proposers are built
    return RecallProposer(read_settings(config, "recall", RecallSettings), config.max_model_len)
