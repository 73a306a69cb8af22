"""Tensor parallelism: one rank per GPU (NCCL), or CPU processes (gloo); the ``mp`` executor.

The parts a rank's runner uses:

- :mod:`~pitstop.plugins.executors.tensor_parallel.sharding`: which part of each weight a
  rank holds, and the errors for sizes a model does not split into;
- :mod:`~pitstop.plugins.executors.tensor_parallel.group`: the process groups and every
  collective;
- :mod:`~pitstop.plugins.executors.tensor_parallel.kernels`: a rank's kernel set (the
  chosen one plus the collectives);
- :mod:`~pitstop.plugins.executors.tensor_parallel.peers`: how a step ends among the ranks;
- :mod:`~pitstop.plugins.executors.tensor_parallel.rank`: all of these as the runner's
  :class:`~pitstop.runner.peers.RankParallel`.

The processes: :mod:`~pitstop.plugins.executors.tensor_parallel.launch` starts them
(spawned, or ``torchrun``'s ranks); rank 0's runner sends each runner call to every rank
(:mod:`~pitstop.plugins.executors.tensor_parallel.rank0`), the workers make it on their
own runner (:mod:`~pitstop.plugins.executors.tensor_parallel.worker`), and
:mod:`~pitstop.plugins.executors.tensor_parallel.watch` watches them.
:mod:`~pitstop.plugins.executors.tensor_parallel.executor` registers it all as the ``mp``
executor; nothing else here is imported at ``tensor_parallel_size = 1``. See
docs/distributed.md.
"""
