"""Tensor parallelism as an executor between the step loop and the runners, behind the runner's
calls: rank 0's runner sends each call to every rank (:mod:`pitstop.executor.rank0`), the
workers make it on their own runner (:mod:`pitstop.executor.worker`), started by
:func:`pitstop.executor.launch.start_tensor_parallel` (spawned, or ``torchrun``'s ranks) and
watched by :mod:`pitstop.executor.watch`. Not imported at ``tensor_parallel_size = 1``.
"""
