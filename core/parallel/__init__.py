"""Tensor parallelism over ``torch.distributed``: one rank per GPU (NCCL), or CPU processes (gloo).

- :mod:`pitstop.parallel.sharding`: which part of each weight a rank holds, and the errors
  for sizes a model does not split into;
- :mod:`pitstop.parallel.group`: the process groups and every collective;
- :mod:`pitstop.parallel.kernels`: a rank's kernel set (the chosen one plus the collectives);
- :mod:`pitstop.parallel.worker`: a worker's loop, making the runner calls rank 0 makes;
- :mod:`pitstop.parallel.launch`: spawning the workers, or joining ``torchrun``'s ranks;
- :mod:`pitstop.parallel.watch`: rank 0's watch over its spawned workers;
- :mod:`pitstop.parallel.rank0`: rank 0's runner, which sends each call to the workers.

Nothing here is imported or started at ``tensor_parallel_size = 1``. See docs/distributed.md.
"""

from pitstop.parallel.launch import start_tensor_parallel
from pitstop.parallel.rank0 import TensorParallelRunner

__all__ = ["TensorParallelRunner", "start_tensor_parallel"]
