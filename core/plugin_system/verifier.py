"""What a draft verifier (the ``verifier`` kind) provides: how speculative drafts are kept.

A step that verifies drafts runs the target model over ``[last token] + k
drafts`` of each speculating sequence and takes logits at all k + 1
positions. The verifier turns those logits into what each sequence emits:
its accepted drafts, then one more token. It is built once, when the engine
starts with a proposer (``factory(config, sampler, device)``, picked by
``EngineConfig.speculative_verifier``; ``rejection`` is shipped: the
rejection sampling of Leviathan et al. and Chen et al., which keeps the
target model's distribution exactly, as vLLM's rejection sampler does). It
reads the sampler's processed distribution through
:meth:`~pitstop.plugin_system.protocols.Sampler.probabilities`.

The runner calls it with every sampling sequence of the step (a sequence
with no drafts is the k = 0 case: one token drawn from the target) and
copies the packed result to the host in one copy for the whole step
(:class:`DeviceVerified`), so a verifier must not read anything back.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import torch

if TYPE_CHECKING:
    from pitstop.ground.step import SeqInput


@attrs.frozen
class Verified:
    """What verification emitted for each sequence: its accepted drafts, then one more token."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]] | None = None


@attrs.frozen
class DeviceVerified:
    """Verification's results still on the device, packed for one copy to the host.

    ``packed[i, 0]`` is sequence ``i``'s accepted-draft count ``a`` and
    ``packed[i, 1 : a + 2]`` its emitted tokens; ``logprobs[i, : a + 1]`` their
    log-probabilities (None unless asked for).
    """

    packed: torch.Tensor  # [S, kmax + 2] int64
    logprobs: torch.Tensor | None  # [S, kmax + 1] float32

    def unpack(self, packed: list[list[int]], logprobs: list[list[float]] | None) -> Verified:
        """Turn the host copies of :attr:`packed` and :attr:`logprobs` into per-sequence lists."""
        accepted = [row[0] for row in packed]
        tokens = [row[1 : a + 2] for row, a in zip(packed, accepted, strict=True)]
        lps = None
        if logprobs is not None:
            lps = [row[: a + 1] for row, a in zip(logprobs, accepted, strict=True)]
        return Verified(tokens, accepted, lps)

    def to_host(self) -> Verified:
        """Copy to the host (one synchronization) and unpack."""
        lps = self.logprobs.tolist() if self.logprobs is not None else None
        return self.unpack(self.packed.tolist(), lps)


@runtime_checkable
class Verifier(Protocol):
    """Decides which drafts a step keeps and draws each sequence's next token."""

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Seq[SeqInput],
        generators: Seq[torch.Generator | None],
    ) -> DeviceVerified:
        """``logits`` has ``seq.num_logits`` rows per sequence of ``seqs`` (the sampling ones,
        in order); ``seq.params`` are its sampling parameters, ``seq.draft_probs`` its drafts'
        distributions (None: point masses) and ``generators[i]`` a seeded sequence's own
        generator (None: the verifier's shared randomness). Nothing is read back."""
        ...
