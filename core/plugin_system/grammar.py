"""What a grammar backend (the ``grammar`` kind) provides: structured outputs' compiler.

A backend is built once per engine, at the first request that asks for
structured outputs (``factory(config, tokenizer, vocab_size)``, picked by
``EngineConfig.grammar``; llguidance is shipped). It turns a request's
:class:`pitstop.StructuredOutputs` (its ``structured_outputs``, built by the entry
points: :mod:`pitstop.entrypoints.structured`) into one
:class:`GrammarMatcher` per sample, which follows that sample's accepted
tokens, and fills one step's allowed-token bitmask for every constrained row
at once. The sampler applies the bitmask to the logits
(``apply_bitmask`` of :mod:`pitstop.plugins.samplers.processors`, the built-in processors): bit ``j`` of word ``w`` of
a row allows token ``32 * w + j``.

Every error a backend raises for a request's constraint (it does not compile,
it matches nothing, a token it refuses) is an
:class:`~pitstop.errors.InvalidRequestError` naming the request field, so that
only that request fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the engine reads a backend through these members
    import torch


@runtime_checkable
class GrammarMatcher(Protocol):
    """One constrained sample's matcher: it follows the accepted tokens and says what may follow."""

    backend: GrammarBackend  # the backend that made it (its bitmask() fills this matcher's row)

    def accept(self, token_id: int) -> None:
        """Advance over a sampled token; InvalidRequestError when the grammar refuses it."""
        ...

    @property
    def is_finished(self) -> bool:
        """Whether the constraint is complete and allows nothing more (the sample stops)."""
        ...


@runtime_checkable
class GrammarBackend(Protocol):
    """Compiles constraints over one tokenizer and fills a step's allowed-token bitmask.

    Called from the engine's thread and, through ``check``, from a server's
    worker threads: ``new_state`` and ``check`` must be thread-safe.
    """

    def new_state(self, spec: Any) -> GrammarMatcher:
        """A fresh matcher for ``spec`` (compiled once per distinct constraint, if the backend
        caches); a constraint it cannot compile raises InvalidRequestError naming its field."""
        ...

    def check(self, spec: Any) -> None:
        """Compile ``spec`` before its request is queued, and raise InvalidRequestError for one
        that does not compile or matches no text at all (the server answers 400)."""
        ...

    def bitmask(self, states: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """The ``[len(states), ceil(vocab_size / 32)]`` int32 allowed-token bitmask of one
        step, on the host: row ``i`` is ``states[i]``'s next tokens, every bit set where
        ``states[i]`` is None (an unconstrained row); ids the tokenizer lacks stay 0."""
        ...
