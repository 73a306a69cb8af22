"""The kernel set of one tensor-parallel rank: the chosen kernel set plus three collectives.

A model that supports tensor parallelism (the Llama family) looks for these
ops once, when it is built, and uses them where a sharded layer needs the
other ranks:

- ``all_reduce(x)`` after each row-parallel projection (``o_proj``,
  ``down_proj``);
- ``embed(table, ids)``, the vocabulary-parallel embedding;
- ``gather_logits(local)``, the vocabulary-parallel output head's parts put
  side by side.

At ``tensor_parallel_size = 1`` no rank wraps its kernel set: the model finds
none of the three and runs exactly as before.
"""

from __future__ import annotations

from typing import Any

import torch

from pitstop.plugins.executors.tensor_parallel.group import TensorParallelGroup


class TensorParallelKernels:
    """Delegates every op to ``inner`` and adds the collectives of ``group``."""

    def __init__(self, inner: Any, group: TensorParallelGroup) -> None:
        self.inner, self.group = inner, group
        self.name = getattr(inner, "name", type(inner).__name__)

    def __getattr__(self, name: str) -> Any:
        # only reached for what this class does not define: the inner set's ops and flags
        return getattr(self.inner, name)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel projection's partial output over the ranks."""
        return self.group.all_reduce(x)

    def embed(self, table: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``input_ids`` from every rank's part of the vocabulary."""
        return self.group.embed(table, input_ids)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's logits columns joined with every other rank's: ``[N, vocab]``."""
        return self.group.gather_logits(local)

    def describe(self) -> dict[str, str]:
        """The inner set's ops, and the collectives with their backend."""
        describe = getattr(self.inner, "describe", None)
        ops = dict(describe()) if describe is not None else {}
        backend = "nccl" if self.group.device.type == "cuda" else "gloo"
        ops["tensor_parallel"] = f"{self.group.size} ranks over {backend}"
        return ops
