"""What ``sleep(level)`` releases and ``wake_up(tags)`` restores, on one runner.

- level 1: the weights are copied to host memory (on CUDA into one pinned buffer,
  reserved when the engine is built with sleep mode, since pinning is the slow part),
  then their device memory is released; the KV cache is released
  (its contents are discarded: no request runs while asleep).
- level 2: the weights and the KV cache are released, nothing is kept. As in vLLM,
  ``wake_up`` then gives the weights their memory back with undefined values: the
  caller writes new ones (``update_weights``, ``update_weights_from_disk``) before
  generating; :attr:`SleepState.missing` names what is still unwritten.

``wake_up(["weights"])`` first, then the update, then ``wake_up(["kv_cache"])`` is the
order that needs the least memory at once (vLLM's advice too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from pitstop.entrypoints.rollout.device_memory import TAGS, DeviceMemory, unique_storages
from pitstop.entrypoints.rollout.errors import EngineSleepingError
from pitstop.ground.poison import poison_

log = logging.getLogger(__name__)

ALIGN = 256  # bytes: every tensor's place in the host copy starts aligned for any dtype


class HostCopy:
    """One host buffer holding a copy of every tensor given (pinned: copies run at the
    link's rate and do not block other work)."""

    def __init__(self, tensors: Sequence[torch.Tensor], *, pin: bool) -> None:
        self.offsets: list[int] = []
        total = 0
        for t in tensors:
            self.offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self.pinned = pin

    def _view(self, i: int, t: torch.Tensor) -> torch.Tensor:
        start = self.offsets[i]
        return self.buffer[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)

    def save(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` (the same list the buffer was laid out for) into the buffer."""
        for i, t in enumerate(tensors):
            self._view(i, t).copy_(t, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()

    def load(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the buffer back into ``tensors``."""
        for i, t in enumerate(tensors):
            t.copy_(self._view(i, t), non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()


class SleepState:
    """The released parts of one runner's memory, and how to bring them back.

    ``recapture()``: capture the CUDA graphs again (called after a wake when the memory
    does not keep addresses; the graphs are dropped at sleep, which frees their pools too).
    ``weight_names``: every Hugging Face name of the model (what level 2 leaves unwritten).
    ``reserve_host``: pin the host buffer of level 1 now (CUDA engines in sleep mode).
    """

    def __init__(
        self,
        runner,
        memory: DeviceMemory,
        recapture: Callable[[], None],
        weight_names: Sequence[str],
        *,
        reserve_host: bool = False,
    ) -> None:
        self.runner = runner
        self.memory = memory
        self.recapture = recapture
        self.weight_names = list(weight_names)
        self.released: set[str] = set()
        self.missing: set[str] = set()  # HF names discarded by level 2 and not written since
        self.level = 0
        self._host: HostCopy | None = None
        if reserve_host:
            # pinning the host copy costs about 0.5 s a GB (8 s for an 8B model on the H200):
            # paid here, at start, so that sleep(level=1) takes only the copy's time
            self._host = HostCopy(self._weights(), pin=True)
        self._host_valid = False
        self._graphs_dropped = False

    @property
    def is_sleeping(self) -> bool:
        """Whether any part (weights, KV cache) is released."""
        return bool(self.released)

    def _weights(self) -> list[torch.Tensor]:
        """The weights' memory: one byte tensor over each distinct storage under the
        parameters, so a parameter that is a view of a larger tensor (a LoRA-stacked
        projection's weight, whose storage holds the adapters' columns beside it) is saved
        and restored whole. Storages released to 0 bytes are left out (call after restore)."""
        storages = unique_storages(p.data for p in self.runner.model.parameters())
        return [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s) for s in storages]

    def _kv(self) -> list[torch.Tensor]:
        return [] if self.runner.kv_cache is None else [self.runner.kv_cache]

    def sleep(self, level: int) -> None:
        """Release the weights (kept on the host at level 1) and the KV cache."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        self._drop_graphs()
        if "weights" not in self.released:
            weights = self._weights()
            if level == 1:
                if self._host is None:
                    self._host = HostCopy(weights, pin=self.runner.device.type == "cuda")
                self._host.save(weights)
                self._host_valid = True
            else:
                self.missing = set(self.weight_names)
            self.memory.release("weights", weights)
            self.released.add("weights")
        elif level == 2 and self._host_valid:  # a deeper sleep discards the host copy too
            self._host_valid = False
            self.missing = set(self.weight_names)
        if "kv_cache" not in self.released:
            self.memory.release("kv_cache", self._kv())
            self.released.add("kv_cache")
        if level == 2:
            self._host_valid = False
            if self._host is not None and not self._host.pinned:
                self._host = None  # a CPU engine's copy is its RSS; the pinned one is reserved
        self.level = max(self.level, level)
        log.info("asleep (level %d): weights and KV cache released (%s)", level, self.memory.name)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore ``tags`` (None: all released): the weights first (their host copy
        written back after level 1), then the KV cache (zeroed, or poisoned under
        ``poison_memory``); the CUDA graphs are captured again once both are back."""
        wanted = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in wanted if t not in TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown} unknown; give a subset of {list(TAGS)}")
        if "weights" in wanted and "weights" in self.released:
            self.memory.restore("weights", self._weights())
            if self._host_valid and self._host is not None:
                self._host.load(self._weights())
                self._host_valid = False
                if not self._host.pinned:  # a CPU engine's copy would double its RSS
                    self._host = None
            else:  # level 2: adapters kept in the weights' memory must load again
                adapters = getattr(self.runner, "adapters", None)
                forget = getattr(adapters, "forget_slots", None)
                if forget is not None:
                    forget()
            self.released.discard("weights")
        if "kv_cache" in wanted and "kv_cache" in self.released:
            self.memory.restore("kv_cache", self._kv())
            for kv in self._kv():
                if self.runner.poison:
                    poison_(kv)
                else:
                    kv.view(torch.uint8).zero_()
            self.released.discard("kv_cache")
        if not self.released:
            self.level = 0
            if self._graphs_dropped:
                self.recapture()
                self._graphs_dropped = False

    def _drop_graphs(self) -> None:
        """Forget the CUDA graphs when restored memory will have new addresses."""
        if self.memory.keeps_addresses or self._graphs_dropped:
            return
        runner = self.runner
        if any(g is not None for g in (runner.graphs, runner.mixed_graphs, runner.verify_graphs)):
            runner.graphs = runner.mixed_graphs = runner.verify_graphs = None
            self._graphs_dropped = True

    def check_can_generate(self) -> None:
        """Raise :class:`EngineSleepingError` naming the fix while the engine cannot generate."""
        if self.released:
            raise EngineSleepingError(
                f"the engine is asleep ({' and '.join(sorted(self.released))} released by "
                f"sleep(level={self.level})); call wake_up() before generating"
            )
        if self.missing:
            raise EngineSleepingError(
                f"sleep(level=2) discarded the weights and {len(self.missing)} tensor(s) have not "
                f"been written since, e.g. {sorted(self.missing)[:3]}; call update_weights(...) or "
                "update_weights_from_disk(path) with every tensor before generating"
            )

    def written(self, names: Sequence[str]) -> None:
        """Note that ``names`` hold new values (no longer missing after level 2)."""
        self.missing.difference_update(names)

    def check_weights_awake(self) -> None:
        """Weight updates write device memory: refuse while the weights are released."""
        if "weights" in self.released:
            raise EngineSleepingError(
                "the weights are released (asleep); call wake_up(tags=['weights']) before "
                "updating them"
            )
