"""``continuous``: finished sequences leave and waiting ones join after every step.

Knobs: ``max_batch_size`` (most sequences running, and in one step),
``max_prefill_batch`` (most prompts prefilled in one step),
``max_num_batched_tokens`` (most tokens computed in one step),
``prefill_priority`` and ``admission`` (see :mod:`.base`).

- ``prefill_priority="high"`` (nano-vllm): if any waiting prompt fits, the
  step prefills prompts only; otherwise it decodes every running sequence. A
  step is all prefill or all decode.
- ``prefill_priority="low"``: every running sequence decodes first; waiting
  prompts fill the room that is left in the same step (a mixed step). No
  prompt is admitted in a step that had to preempt.

A prompt is always prefilled whole (``chunked`` splits it). A prompt longer
than ``max_num_batched_tokens`` would otherwise never run, so it is admitted
when it is at the head of the admission order and the step is otherwise
empty: it runs *alone*, in a step of its own (with ``"low"``, the decodes
wait that one step). Set ``max_num_batched_tokens >= max_model_len`` to never
see such a step. At most ``min(max_batch_size, max_num_batched_tokens)``
sequences run at once, so the decodes of every running sequence always fit
one step's budget.

The token budget is checked against a prompt's full length before it is
admitted (how much of it is cached is known only once it is admitted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

import pitstop
from pitstop.plugin_system.settings import setting
from pitstop.plugins.schedulers.base import AdmissionSettings, BaseScheduler, StepBuilder

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.plugin_system.protocols import Allocator


@attrs.frozen
class ContinuousSettings(AdmissionSettings):
    """The settings of the ``continuous`` scheduler."""

    prefill_priority: str = setting(
        "high",
        type=str,
        choices=("high", "low"),
        alias="prefill_priority",
        help="high: waiting prompts run before decodes; low: decodes first",
    )


class ContinuousScheduler(BaseScheduler):
    """Continuous batching: sequences join and leave after every step."""

    name = "continuous"
    settings_class = ContinuousSettings

    def __init__(
        self,
        config: EngineConfig,
        allocator: Allocator,
        *,
        settings: ContinuousSettings,
    ) -> None:
        super().__init__(config, allocator, settings=settings)
        self._set_token_budget(self.settings.max_num_batched_tokens)
        self.prefill_first = self.settings.prefill_priority == "high"

    def _fill(self, step: StepBuilder) -> None:
        """Prompts and decodes in the order ``prefill_priority`` says (see the module docstring)."""
        if self.prefill_first:
            self._admit_prompts(step)
            if not step.scheduled:
                self._schedule_running(self.running, step)
        else:
            head = next(self.admission_order(), None)
            if head is not None and head.num_tokens > self.token_budget:
                self._admit_prompts(step)  # an oversized head runs alone, or waits
            if not step.scheduled:
                self._schedule_running(self.running, step)
                if not step.preempted:
                    self._admit_prompts(step)

    def _admit_prompts(self, step: StepBuilder) -> None:
        """Admit waiting prompts in admission order while they fit; stop at the first that does not."""
        for seq in self.admission_order():
            if not self._room_for_prompt(step):
                return
            oversized = seq.num_tokens > step.tokens_left
            if oversized and (step.scheduled or step.tokens_left < step.token_budget):
                return  # only an otherwise empty step takes a prompt longer than the budget
            if not self.allocator.can_allocate(seq):
                return
            self._admit(seq)
            step.add(seq, seq.num_uncomputed_tokens)
            if oversized:
                return


def create_continuous(
    config: EngineConfig, allocator: Allocator, *, settings: ContinuousSettings
) -> ContinuousScheduler:
    """Continuous batching: finished sequences leave and waiting ones join after every step."""
    return ContinuousScheduler(config, allocator, settings=settings)


@pitstop.hookimpl
def register_schedulers(register) -> None:
    ContinuousScheduler.register_with(register, create_continuous)
