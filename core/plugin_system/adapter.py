"""The adapter kind: fine-tuned adapters (LoRA) served on the base weights, per request.

The config's ``adapter`` setting names an adapter plugin (``lora``; vLLM's
``enable_lora=True`` selects it). The runner builds it once, beside the model:

1. ``factory(config, context: AdapterContext, *, settings=...) -> Adapters``, before any weight loads;
2. :meth:`Adapters.attach` is handed the model, before its weights load: it wraps the
   projections it adapts (and may turn off what it cannot adapt, such as fused layers);
3. at ``add_request``, :meth:`Adapters.check` is handed the request's adapter (vLLM's
   :class:`~pitstop.entrypoints.lora_request.LoRARequest`): it reads it (into a host cache) or raises
   :class:`~pitstop.errors.InvalidRequestError` naming the problem, which fails that request
   alone;
4. before every forward, :meth:`Adapters.prepare` is handed the step's sequences (each
   :class:`~pitstop.ground.step.SeqInput` carries its ``adapter``, None for the base model):
   it places each adapter in a device slot and writes each row's slot where the wrapped
   projections read it.

An adapter plugin may define ``forget_slots()``: called before any further step where the
device copies of the adapters no longer hold what they were loaded from: after sleep mode
gave back weight memory without a copy of it (level 2), so a plugin that keeps adapter
weights inside the weights' memory (``AdapterContext.weights_region``) reloads them, and
after a weight update wrote a norm gain that a fused layer folds into the projection after
it (the ``lora`` plugin multiplies that gain into the A it loads for the fused layer).

An adapter plugin may set ``max_per_step`` (an int): the most distinct adapters one step
can run (the ``lora`` plugin's ``max_loras``). A request whose adapter would bring the
queued requests' adapters over it then waits, unqueued, until requests finish and free a
place (as vLLM's scheduler holds it back); the scheduler never sees more adapters.

An adapter plugin may define ``ready(request, busy) -> bool``: whether a step can run the
request's adapter without waiting for it to reach the device, starting its copy (into a slot
that none of ``busy``'s adapter ids, those of the queued requests, holds) where it is not
there. The engine keeps a request whose adapter is not ready out of the scheduler, its place
kept, and asks again before each step, so that no running batch waits for a copy; a request
that arrives with nothing else queued goes at once.

The engine keys the prefix cache by ``Sequence.adapter_id`` (its request's
``lora_int_id``; 0 without one), so two adapters never share cached pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import torch

from pitstop.ground.model_config import ModelConfig

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.ground.step import SeqInput


@attrs.frozen
class AdapterContext:
    """What the runner has when it builds the adapter plugin."""

    config: EngineConfig
    model_config: ModelConfig  # the shape of the base model this runner holds (its rank's part)
    kernels: Any  # the runner's KernelSet
    device: torch.device
    dtype: torch.dtype
    # under tensor parallelism the executor's weight cutter (RankParallel.shard): the whole
    # model's shape as .model_config (adapters are checked against it) and .region(name,
    # shape), the part of a whole weight this rank holds; None: the runner holds the whole model
    shard: Any = None
    # a context inside which the device memory the plugin allocates counts as the model's
    # weights (released and restored with them by sleep mode); default: nothing special
    weights_region: Any = attrs.field(default=None)
    # the most tokens one step computes (the scheduler's step budget, which may exceed
    # max_num_batched_tokens through chunk_size): static per-row buffers are sized by it, as
    # CUDA graphs read them by address (0: max_num_batched_tokens)
    step_tokens: int = 0


@runtime_checkable
class Adapters(Protocol):
    """Serves adapters on one model: loads them, holds them in device slots, applies them."""

    def attach(self, model: torch.nn.Module) -> None:
        """Wrap ``model``'s projections so that they add each row's adapter (before its
        weights load). Raises :class:`~pitstop.errors.ConfigError` for a model it cannot adapt."""
        ...

    def check(self, request: Any) -> None:
        """Read ``request``'s adapter (or find it cached); raise
        :class:`~pitstop.errors.InvalidRequestError` naming what is wrong with it."""
        ...

    def prepare(self, seqs: Sequence[SeqInput]) -> None:
        """Before a forward over ``seqs``: slot each sequence's adapter and write the rows' slots."""
        ...
