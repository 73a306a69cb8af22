"""Speculative decoding in the core: what a proposer is given, and how many drafts fit.

A step that verifies drafts runs the target model over ``[last token] + k
drafts`` of a sequence and takes logits at all k + 1 positions. The engine
asks the proposer (a plugin of the ``proposer`` kind) for the drafts, and
the runner hands the logits to the verifier (a plugin of the ``verifier``
kind, :mod:`pitstop.plugin_system.verifier`; ``rejection`` is shipped), which
keeps the drafts the target model agrees with and draws one more token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from pitstop.plugin_system.plugin_manager import PluginManager
    from pitstop.requests.sequence import Sequence


@attrs.frozen
class ProposerContext:
    """What the engine hands a proposer's factory, besides the config."""

    plugins: PluginManager  # to build a draft model's kernels, sampler, allocator
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # the target model's vocabulary (a draft must share its tokenizer)
    page_size: int
    num_pages: int  # pages of the target's KV cache (a draft cache may follow it)
    tokenizer: Any = None  # the target's tokenizer (pitstop.loading.tokenizer.Tokenizer) or None


def draft_room(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts ``seq`` may verify this step: at most ``k``, and never past its limits.

    A step that verifies ``n`` drafts may emit ``n + 1`` tokens, so ``n`` stays
    below the tokens left before ``max_tokens`` and before ``max_model_len``.
    """
    limit = seq.sampling_params.max_tokens
    left_context = max_model_len - seq.num_tokens
    left_output = left_context if limit is None else limit - seq.num_output_tokens
    return max(0, min(k, left_output - 1, left_context - 1))
