"""`pitstop bench`: named workloads, offline and online drivers, floors, matrices, peers.

The pieces, one concept per module:

- :mod:`pitstop.bench.workloads`: the named workloads of docs/workloads.md and JSON-lines files;
- :mod:`pitstop.bench.floor`: device ceilings and the physical floor of a workload;
- :mod:`pitstop.bench.backends`: pitstop's engine and the ``transformers`` peer behind one interface;
- :mod:`pitstop.bench.http`: a running server measured through its OpenAI streaming API (``--url``);
- :mod:`pitstop.bench.peers`: ``--peer transformers|vllm``, the other engine's column;
- :mod:`pitstop.bench.vllm_peer`: vLLM's process, environment, arguments and offline run;
- :mod:`pitstop.bench.vllm_worker`: the script that runs ``LLM.generate`` in that process;
- :mod:`pitstop.bench.vllm_server`: ``vllm serve`` on a loopback port for the online peer;
- :mod:`pitstop.bench.local_server`: a free port and the wait for a local server's ``/health``;
- :mod:`pitstop.bench.vllm_model`: a pitstop model name as vLLM loads it (a preset's ``config.json``);
- :mod:`pitstop.bench.drivers`: offline (all at once), closed-loop and Poisson clients;
- :mod:`pitstop.bench.progress`: a bar on a terminal, a log line every 10 s elsewhere;
- :mod:`pitstop.bench.report`: per-request records, figures, tables and JSON;
- :mod:`pitstop.bench.matrix`: named configurations (``baseline,+paged,...`` or TOML);
- :mod:`pitstop.bench.plot`: the PNG (matplotlib, imported only when asked);
- :mod:`pitstop.bench.cli`: the ``pitstop bench`` subcommand.

Nothing here imports torch or transformers at import time, so ``pitstop --help`` stays quick.
"""
