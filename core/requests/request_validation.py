"""The checks of a whole request that need the model (its vocabulary): one call in ``add_request``.

The field-level checkers live in :mod:`pitstop.requests.validation`, which imports
nothing of pitstop's but its errors; this module joins them with
:class:`~pitstop.requests.sampling_params.SamplingParams` (so neither imports the other
in a cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pitstop.errors import fail_request as _fail
from pitstop.requests.sampling_params import SamplingParams
from pitstop.requests.validation import check_text, check_token_ids


def validate_request(
    prompt: Any,
    params: SamplingParams,
    prompt_token_ids: Sequence[int] | None,
    *,
    vocab_size: int,
) -> None:
    """Every check of a request that needs the model: call it first in ``add_request``.

    Raises :class:`InvalidRequestError` when ``params`` is not a
    :class:`SamplingParams`, the prompt is neither a non-empty UTF-8 string
    nor a non-empty list of token ids inside the vocabulary, or a
    ``stop_token_ids`` entry is outside the vocabulary. Length checks against
    ``max_model_len`` stay with the engine, which knows the tokenized length.
    """
    if not isinstance(params, SamplingParams):
        _fail(
            f"sampling params must be a SamplingParams, got {type(params).__name__}; "
            "build one with SamplingParams(max_tokens=..., ...)"
        )
    if prompt_token_ids is None:
        if prompt is None:
            _fail("prompt: give a prompt (text) or prompt_token_ids")
        check_text("prompt", prompt)
        if not prompt:
            _fail("prompt is empty; give at least one token of text")
    else:
        ids = check_token_ids("prompt_token_ids", prompt_token_ids, vocab_size)
        if not ids:
            _fail("prompt_token_ids is empty; give at least one token")
    if params.stop_token_ids:
        check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if params.logit_bias:
        check_token_ids("logit_bias", [t for t, _ in params.logit_bias], vocab_size)
    if params.allowed_token_ids is not None:
        check_token_ids("allowed_token_ids", params.allowed_token_ids, vocab_size)
