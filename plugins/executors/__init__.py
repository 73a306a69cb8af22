"""Executors: how the engine runs a model split over several ranks (``tensor_parallel_size > 1``).

The config's ``distributed_executor_backend`` picks one by name
(:mod:`pitstop.plugin_system.executor`); ``mp``
(:mod:`~pitstop.plugins.executors.tensor_parallel`) ships.
"""
