"""The ``recall`` proposer's own tests: what it learns, what it proposes, what it forgets."""

from __future__ import annotations

from pitstop_example.recall import RecallProposer, RecallSettings

from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.requests.sequence import Sequence


def _seq(tokens: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_tokens=max_tokens))


def _proposer(**settings: object) -> RecallProposer:
    return RecallProposer(RecallSettings(**settings), max_model_len=256)


def test_it_walks_the_continuations_of_its_own_tokens() -> None:
    proposer = _proposer(context=2)
    seq = _seq([1, 2, 3, 4, 5, 9, 1, 2])
    assert proposer.propose([seq], 4)[0].token_ids == [3, 4, 5, 9]
    assert proposer.propose([_seq([7, 8])], 4)[0].token_ids == []  # a context never seen


def test_the_table_is_shared_across_requests() -> None:
    proposer = _proposer(context=2)
    first = _seq([10, 11, 12, 13, 14])
    proposer.propose([first], 4)
    proposer.release(first)
    assert proposer.propose([_seq([5, 10, 11])], 3)[0].token_ids == [12, 13, 14]
    alone = _proposer(context=2, shared=False)
    alone.propose([first], 4)
    alone.release(first)
    assert alone.propose([_seq([5, 10, 11])], 3)[0].token_ids == []


def test_the_latest_continuation_wins_and_old_contexts_are_forgotten() -> None:
    proposer = _proposer(context=1, max_contexts=3)
    proposer.propose([_seq([1, 2, 1, 3])], 2)  # 1 -> 2, 2 -> 1, then 1 -> 3
    assert proposer.propose([_seq([1])], 1)[0].token_ids == [3]
    proposer.propose([_seq([4, 5, 6, 7])], 1)  # three new contexts push the old ones out
    assert proposer.propose([_seq([1])], 1)[0].token_ids == []


def test_never_past_max_tokens() -> None:
    proposer = _proposer(context=1)
    seq = _seq([1, 2, 3, 4, 1], max_tokens=3)
    assert proposer.propose([seq], 8)[0].token_ids == [2, 3]  # room for 3 - 1 drafts
