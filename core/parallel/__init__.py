"""Tensor parallelism's parts that a runner uses: one rank per GPU (NCCL), or CPU processes (gloo).

- :mod:`pitstop.parallel.sharding`: which part of each weight a rank holds, and the errors
  for sizes a model does not split into;
- :mod:`pitstop.parallel.group`: the process groups and every collective;
- :mod:`pitstop.parallel.kernels`: a rank's kernel set (the chosen one plus the collectives).

The processes, rank 0's runner and the workers' loop are :mod:`pitstop.executor`. Nothing here
is imported or started at ``tensor_parallel_size = 1``. See docs/distributed.md.
"""
