"""The weight-transfer group: a trainer process broadcasts tensors into the engine.

As in SGLang's and vLLM's RLHF examples, the trainer is rank 0 of a small process group
and the engine joins it at ``rank_offset``; each tensor is one broadcast from rank 0.
The group is built straight on a ``TCPStore`` (the trainer's side hosts it) and a gloo
or NCCL backend object, never through ``torch.distributed.init_process_group``: it
shares nothing with a default group either side may have (the trainer's own
data-parallel group, say). :func:`trainer_group` is the trainer's side.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pitstop.entrypoints.rollout.errors import WeightUpdateError

BACKENDS = ("gloo", "nccl")


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> the torch dtype."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"dtype {value!r} is not a torch dtype name (e.g. 'bfloat16')")
    return dtype


class WeightTransferGroup:
    """One side of the group: ``rank`` of ``world_size``, rank 0 the trainer."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> None:
        if backend not in BACKENDS:
            raise WeightUpdateError(f"backend {backend!r} unknown; use one of {BACKENDS}")
        if not 0 <= rank < world_size:
            raise WeightUpdateError(
                f"rank {rank} is outside a group of {world_size}; rank_offset must be "
                f"below world_size (the trainer is rank 0)"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            master_address,
            int(master_port),
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore(f"pitstop-weights/{group_name}", self.store)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.group_name = group_name
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else (torch.device("cpu"))
        )

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` from rank 0 (the trainer sends, the others receive into it)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()
        return tensor

    def receive(
        self, names: Sequence[str], dtypes: Sequence[torch.dtype | str], shapes: Sequence
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive one broadcast per name into fresh staging tensors of the declared dtype
        and shape, on this group's device (every one, so the trainer never waits on a
        tensor the engine skipped)."""
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightUpdateError(
                f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; give one "
                "dtype and one shape per name"
            )
        staged = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            buffer = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=self.device)
            staged.append((name, self.broadcast(buffer)))
        return staged

    def destroy(self) -> None:
        """Leave the group (the trainer's store closes with its side)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass
        self.pg = None
        self.store = None


def trainer_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> WeightTransferGroup:
    """The trainer's side (rank 0, hosting the store); call it while the engine calls
    ``init_weight_update_group`` with the same address, port, world size and name."""
    return WeightTransferGroup(
        master_address, master_port, 0, world_size, group_name, backend, timeout_s
    )
