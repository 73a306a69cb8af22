"""`Rollout`: sleep, wake, weight updates and the transfer group over one engine.

``LLM`` and the server both call it. Every call that changes memory or weights first
checks that no request is unfinished (a request in flight would read freed memory or a
half-new model) and applies the step still in flight; after new weights or a wake the
prefix cache is reset, since its pages hold K and V computed by the old weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from pitstop.entrypoints.rollout.checkpoint_files import (
    iter_tensors,
    read_specs,
    safetensors_files,
)
from pitstop.entrypoints.rollout.device_memory import DeviceMemory, StorageMemory
from pitstop.entrypoints.rollout.errors import EngineBusyError, WeightUpdateError
from pitstop.entrypoints.rollout.sleep import SleepState
from pitstop.entrypoints.rollout.transfer import WeightTransferGroup
from pitstop.entrypoints.rollout.weight_update import (
    WeightMap,
    check_finite,
    update_in_place,
    write_batch,
)
from pitstop.errors import ConfigError
from pitstop.loop.engine import LLMEngine

log = logging.getLogger(__name__)


class Rollout:
    """The rollout controls of one engine. ``memory``: how sleep releases device memory
    (None: sleep mode off, ``sleep`` refused; weight updates work either way)."""

    def __init__(self, engine: LLMEngine, memory: DeviceMemory | None = None) -> None:
        self.engine = engine
        self.memory = memory
        self._map: WeightMap | None = None
        self._group: WeightTransferGroup | None = None
        model = getattr(engine.runner, "model", None)  # none in rank 0's runner under TP
        shapes_of = getattr(model, "shapes_of", None)
        names = list(shapes_of(model.cfg)) if shapes_of is not None else []
        self.sleep_state = SleepState(
            engine.runner,
            memory or StorageMemory(engine.device),
            self._recapture,
            names,
            reserve_host=memory is not None and engine.device.type == "cuda",
        )

    # ------------------------------------------------------------------ checks
    def _check_single_process(self, what: str) -> None:
        if self.engine.config.tensor_parallel_size > 1:
            raise ConfigError(f"{what} runs on one rank only; use tensor_parallel_size=1")

    def _quiesce(self, what: str) -> None:
        """Refuse while requests are unfinished; land the step still in flight."""
        engine = self.engine
        if engine.has_unfinished_requests():
            ids = sorted({s.request_id for s in engine.live_sequences().values()})
            raise EngineBusyError(
                f"{what} refused: {len(ids)} request(s) unfinished ({ids[:5]}); let them "
                "finish or abort them first"
            )
        engine.drain()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    def check_can_generate(self) -> None:
        """Raise :class:`~.errors.EngineSleepingError` while asleep or missing weights."""
        self.sleep_state.check_can_generate()

    # ------------------------------------------------------------------ sleep
    def sleep(self, level: int = 1) -> None:
        """Release the weights (kept on the host at level 1) and the KV cache."""
        if self.memory is None:
            raise ConfigError(
                "sleep mode is off; build the engine with LLM(..., enable_sleep_mode=True) "
                "(pitstop serve --enable-sleep-mode)"
            )
        self._check_single_process("sleep mode")
        self._quiesce("sleep")
        self.reset_prefix_cache()  # its pages are about to lose their contents
        self.sleep_state.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore ``tags`` (None: everything released); reset the prefix cache."""
        self._quiesce("wake_up")
        self.sleep_state.wake_up(tags)
        self.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are released."""
        return self.sleep_state.is_sleeping

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (True; an allocator without a prefix cache has
        nothing to forget)."""
        reset = getattr(self.engine.allocator, "reset_prefix_cache", None)
        return True if reset is None else bool(reset())

    def _recapture(self) -> None:
        """Capture the CUDA graphs again (after a wake that moved the memory)."""
        from pitstop.runner.verify_graphs import capture_verify_graphs

        speculative = self.engine.config.speculative is not None
        self.engine.runner.maybe_capture_graphs(capture_verify_graphs if speculative else None)
        log.info("CUDA graphs captured again after wake_up")

    # ------------------------------------------------------------------ weights
    def weight_map(self) -> WeightMap:
        """The model's name -> parameter map (built once)."""
        if self._map is None:
            self._check_single_process("updating weights")
            model = self.engine.runner.model
            ignored = self.engine.plugins.architecture(model.cfg.architecture).ignored_tensor
            self._map = WeightMap(
                model, ignored or (lambda name: False), lambda: self.sleep_state.missing
            )
        return self._map

    def _before_update(self) -> WeightMap:
        self._quiesce("updating weights")
        self.sleep_state.check_weights_awake()
        return self.weight_map()

    def _after_update(self, written: list[str]) -> None:
        self.sleep_state.written(written)
        self.reset_prefix_cache()
        folds = self._map.folds if self._map is not None else None
        if folds is not None and folds.gain_names().intersection(written):
            # a fused layer's adapters hold A times the old gain: load them again with the new
            forget = getattr(self.engine.runner.adapters, "forget_slots", None)
            if forget is not None:
                forget()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(hf_name, tensor)`` pairs into the model, all or none; returns how many."""
        weights = self._before_update()
        written = update_in_place(
            weights, named_tensors, check_values=self.engine.config.check_weights
        )
        self._after_update(written)
        return len(written)

    def update_weights_from_disk(self, path: str | Path) -> int:
        """Update from a Hugging Face folder (or one safetensors file), all or nothing:
        every header is checked first; with ``check_weights`` (the default) a first pass
        reads every tensor for NaN and infinities; then the tensors are read and copied
        one at a time (each cast to the model's dtype, as at load)."""
        weights = self._before_update()
        specs = read_specs(safetensors_files(path))
        places = weights.check([spec for _, spec in specs], cast=True)
        if self.engine.config.check_weights:
            for name, tensor in iter_tensors(specs):
                check_finite([(f"{path}: {name}", tensor)])
        written = write_batch(
            weights, [spec for _, spec in specs], places, (t for _, t in iter_tensors(specs))
        )
        self._after_update(written)
        return len(written)

    # ------------------------------------------------------------------ transfer group
    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join the trainer's weight-transfer group as rank ``rank_offset``."""
        self._check_single_process("the weight-transfer group")
        if self._group is not None:
            raise WeightUpdateError(
                f"already in the weight-transfer group {self._group.group_name!r}; call "
                "destroy_weight_update_group() first"
            )
        self._group = WeightTransferGroup(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Sequence[int]]
    ) -> int:
        """Receive one broadcast per name from the trainer into staging tensors, check the
        batch, then copy it in (all or none)."""
        if self._group is None:
            raise WeightUpdateError(
                "no weight-transfer group; call init_weight_update_group(...) first"
            )
        weights = self._before_update()
        staged = self._group.receive(names, dtypes, shapes)  # every broadcast, even if refused
        written = update_in_place(weights, staged, check_values=self.engine.config.check_weights)
        del staged
        self._after_update(written)
        return len(written)

    def destroy_weight_update_group(self) -> None:
        """Leave the weight-transfer group (a no-op without one)."""
        if self._group is not None:
            self._group.destroy()
            self._group = None
