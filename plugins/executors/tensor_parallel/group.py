"""The process group of a tensor-parallel engine and every collective it runs.

Two groups span the same ranks:

- the **data** group (NCCL on CUDA, gloo on CPU) carries the model's
  collectives: the all-reduce after each row-parallel projection, the
  vocabulary-parallel embedding's sum and the gather of the logits, and the
  broadcast of rank 0's sampled tokens. Inside a step the ranks run in
  lockstep, so its timeout (:data:`COLLECTIVE_TIMEOUT`) is short;
- the **control** group (always gloo, on the host) carries what rank 0 tells
  the workers: which runner call to make with which plain-data arguments
  (:class:`~pitstop.ground.step.StepInput`), as one pickled broadcast. Workers
  wait there while the engine idles, so its timeout is long; a rank that
  dies closes its sockets and the others' next collective fails at once.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from pitstop.ground.model_config import ModelConfig

log = logging.getLogger(__name__)

# Ranks are in lockstep inside a step; a collective that waits this long has lost a rank.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
# Workers wait for the engine's next call this long (an idle server is not an error).
IDLE_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelGroup:
    """This process's rank in a tensor-parallel engine, and the collectives between the ranks."""

    def __init__(
        self, rank: int, size: int, device: torch.device, model_config: ModelConfig
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.model_config = model_config  # the whole model's shape
        self.control = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_TIMEOUT)
        # Rank 0, during a launch: True until its runner is past the step's last collective but
        # the samples' broadcast (which it then always makes). A failure while it is True left
        # the workers inside a collective: the ranks are out of step.
        self.step_open = False

    # ------------------------------------------------------------------ the model's collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (row-parallel outputs); returns ``x``."""
        dist.all_reduce(x)
        return x

    def embed(self, table: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding: this rank's rows of ``table`` for the ids it holds,
        zeros for the others, summed over the ranks (exact: one rank adds a non-zero)."""
        rows = table.shape[0]
        local = input_ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        x = table[local.clamp(0, rows - 1)]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary part of the logits ``[N, rows]``, side by side: ``[N, vocab]``."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[:, : self.model_config.vocab_size]

    def share_samples(self, tokens: torch.Tensor) -> None:
        """Rank 0's sampled token ids into ``tokens`` on every rank (pending inputs of the next step)."""
        dist.broadcast(tokens, src=0)

    # ------------------------------------------------------------------ rank 0 -> workers
    def send_call(self, name: str, args: tuple[Any, ...]) -> None:
        """Rank 0: tell every worker to make runner call ``name(*args)``."""
        dist.broadcast_object_list([(name, args)], src=0, group=self.control)

    def receive_call(self) -> tuple[str, tuple[Any, ...]]:
        """A worker: the next runner call rank 0 makes (waits while the engine idles)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank has (KV pages every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def barrier(self) -> None:
        """Wait on the host until every rank is here (before the first collective on the device)."""
        dist.barrier(group=self.control)

    def close(self) -> None:
        """Leave the process group (this process can start another tensor-parallel engine)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - an aborted group (a rank died) may not tear down
                log.warning("leaving the tensor-parallel process group failed: %s", exc)
