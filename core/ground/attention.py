"""`AttentionMetadata`: what attention needs to know about one step, built once by the runner."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class AttentionMetadata:
    """The layout of one step's flat token batch over the paged KV cache.

    Sequences are laid out prefills first, then decodes. Sequence ``i`` owns
    query tokens ``cu_query_lens[i] : cu_query_lens[i+1]`` of the flat batch;
    its keys are the first ``context_lens[i]`` tokens of its cache (the cached
    prefix plus this step's tokens), whose pages are ``block_tables[i]``
    (padded with -1). Query token ``j`` of sequence ``i`` sits at position
    ``context_lens[i] - query_len + j`` and attends causally.
    """

    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: page * page_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_pages] int32, -1 padded
    context_lens: torch.Tensor  # [num_seqs] int32
    cu_query_lens: torch.Tensor  # [num_seqs + 1] int32
    num_prefills: int  # sequences computing more than one token (prompts, chunks, drafts)
    num_prefill_tokens: int
    num_decodes: int  # sequences computing exactly one token
    max_query_len: int
    max_context_len: int
    page_size: int
    # The same numbers on the host, so reference code need not synchronize.
    context_lens_list: list[int] = attrs.field(factory=list)
    query_lens_list: list[int] = attrs.field(factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the flat batch."""
        return int(self.positions.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        """Tokens that belong to decoding sequences (one each)."""
        return self.num_decodes

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return self.num_prefills + self.num_decodes
