"""The peers of ``pitstop bench --peer NAME``: another engine on the same requests, same model.

- ``transformers``: its continuous batching, in this process, through the same
  drivers (:class:`~pitstop.bench.backends.TransformersBackend`);
- ``vllm``: in a process of its own, ``LLM.generate`` offline and ``vllm serve``
  online (:mod:`pitstop.bench.vllm_peer`, :mod:`pitstop.bench.vllm_server`),
  driven online by the clients pitstop's own online bench uses.

:func:`run_peer` returns the peer's results column; a peer that fails gives a
column with ``error`` (the cause and the fix), never an exception: the pitstop
columns of the same run stand.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.bench import floor as floors
from pitstop.bench.options import fill_column
from pitstop.bench.workloads import Workload

if TYPE_CHECKING:
    from pitstop.bench.backends import Backend

PEERS = ("transformers", "vllm")
# Peers that run in a process of their own: the bench runs them before its own columns, so
# that they find the GPU's memory free, and its engines start after theirs have exited.
SEPARATE_PROCESS_PEERS = ("vllm",)


@attrs.frozen(kw_only=True)
class PeerRun:
    """What the bench has settled before the peer runs: the same for both sides."""

    args: argparse.Namespace
    config: Any  # pitstop's EngineConfig (the flags, before any --matrix entry)
    workload: Workload  # already fitted to the model and tokenized
    model_config: Any
    device: str
    max_model_len: int
    concurrency: int | None
    request_rate: float | None
    repeats: int
    warmup: bool
    floor: floors.Floor | None
    skipped: list[str]

    @property
    def dtype(self) -> str:
        """The weights' dtype pitstop runs with (``auto`` resolved by the engine's own rule,
        :func:`pitstop.runner.model_runner.resolve_dtype`), by name: ``bfloat16``, ``float32``..."""
        import torch

        from pitstop.runner.model_runner import resolve_dtype

        resolved = resolve_dtype(str(self.config.dtype), torch.device(self.device))
        return str(resolved).removeprefix("torch.")


def run_peer(name: str, run: PeerRun) -> tuple[dict[str, Any], list[str]]:
    """Run the peer ``name``; its results column and notes on how to read it."""
    col: dict[str, Any] = {"name": f"peer:{name}", "backend": name}
    notes: list[str] = []
    try:
        if name == "vllm":
            notes = _vllm(run, col)
        else:
            _transformers(run, col)
    except Exception as exc:  # the peer is a third party: any failure is reported, not fatal
        col.pop("figures", None)
        col["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[bench] peer {name} failed: {col['error']}", file=sys.stderr)
    finally:
        if name in SEPARATE_PROCESS_PEERS:
            from pitstop.bench.vllm_peer import wait_for_gpu_memory

            wait_for_gpu_memory(run.device)
    return col, notes


def _transformers(run: PeerRun, col: dict[str, Any]) -> None:
    from pitstop.bench.backends import TransformersBackend

    model = run.config.model
    print(f"[bench] peer transformers on {model} ({run.device}, {run.dtype})", file=sys.stderr)
    measure_in_process(
        run,
        functools.partial(
            TransformersBackend, model, run.device, run.dtype, run.workload, run.max_model_len
        ),
        col,
    )


def measure_in_process(
    run: PeerRun,
    open_backend: Callable[[], Backend],
    col: dict[str, Any],
    *,
    floor: Callable[[], floors.Floor | None] | None = None,
) -> None:
    """Drive a backend of this process as ``run`` settled (repeats, clients, warm-up), hand
    its memory back after, and put the figures into ``col``; ``floor()``, when given, is
    the column's own floor once the backend ran (the weight bytes its engine held), kept
    in ``col["floor"]``."""
    from pitstop.bench.backends import release_memory
    from pitstop.bench.drivers import run_backend

    runs = run_backend(
        open_backend,
        run.workload,
        repeats=run.repeats,
        concurrency=run.concurrency,
        request_rate=run.request_rate,
        warmup=run.warmup,
        release=release_memory,
    )
    column_floor = floor() if floor is not None else run.floor
    if floor is not None and column_floor is not None:
        col["floor"] = column_floor.as_dict()
    fill_column(col, runs, column_floor, run.skipped)


def _output_path(args: argparse.Namespace) -> str | None:
    if getattr(args, "output", None):
        return str(args.output)
    if getattr(args, "out", None):
        return str(Path(args.out) / "results.json")
    return None


def _vllm(run: PeerRun, col: dict[str, Any]) -> list[str]:
    from pitstop.bench import vllm_peer
    from pitstop.bench.vllm_model import vllm_model

    version = vllm_peer.installed_version()
    workdir = vllm_peer.workdir_for(_output_path(run.args))
    log = workdir / f"vllm-{run.args.bench_mode}.log"
    extra = vllm_peer.parse_peer_args(getattr(run.args, "peer_arg", None))
    vmodel = vllm_model(
        run.config.model,
        run.model_config,
        workdir,
        tokenizer=run.config.tokenizer,
        dtype=run.dtype,
        as_checkpoint="speculative_config" in extra,
    )
    args = vllm_peer.engine_args(
        vmodel.engine_args(),
        run.config,
        run.workload,
        dtype=run.dtype,
        max_model_len=run.max_model_len,
        extra=extra,
    )
    adapters = _peer_adapters(run, args)
    col.update(version=version, model=vmodel.description, config=args, log=str(log))
    print(
        f"[bench] peer vllm {version} ({run.args.bench_mode}) on {vmodel.description}; log {log}",
        file=sys.stderr,
    )
    if run.args.bench_mode == "offline":
        runs, result = vllm_peer.run_offline(
            run.workload,
            args,
            repeats=run.repeats,
            warmup=run.warmup,
            workdir=workdir,
            log_path=log,
            lora=adapters,
        )
        if adapters:
            col["lora_adapters"] = len(adapters)
        col["version"] = result.get("vllm_version") or version
        col["resolved_config"] = result.get("resolved_config")
        col["load_s"] = result.get("load_s")
        fill_column(col, runs, run.floor, run.skipped)
        return [
            "peer:vllm offline: LLM.generate reports no per-token times, so its TTFT, TPOT, "
            "ITL and E2E are n/a; output tok/s and requests/s are over each whole pass"
        ]
    return _vllm_online(run, col, args, workdir, log)


def _peer_adapters(run: PeerRun, args: dict[str, Any]) -> list[Any]:
    """``--lora-adapters N``: the same random adapters as pitstop's columns, with vLLM's
    ``enable_lora``, ``max_loras`` (N, all resident as pitstop's) and ``max_lora_rank``
    (``--lora-rank``) set in ``args``; none: []."""
    count = int(getattr(run.args, "lora_adapters", 0) or 0)
    if not count:
        return []
    from pitstop.bench.lora_adapters import bench_adapters

    adapters = bench_adapters(run, count)
    args.setdefault("enable_lora", True)
    args.setdefault("max_loras", count)
    args.setdefault("max_lora_rank", int(getattr(run.args, "lora_rank", 16) or 16))
    return adapters


def _vllm_online(
    run: PeerRun, col: dict[str, Any], args: dict[str, Any], workdir: Path, log: Path
) -> list[str]:
    import logging

    from pitstop.bench.http import measure_server, probe
    from pitstop.bench.vllm_server import VllmServer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request

    with VllmServer(args, workdir=workdir, log_path=log) as server:
        col["url"] = server.url
        col["startup_s"] = server.startup_s
        col["argv"] = server.argv
        print(
            f"[bench] vllm serve answered {server.url}/health after {server.startup_s:.0f} s",
            file=sys.stderr,
        )
        info = probe(server.url, None)
        return measure_server(
            info,
            run.workload,
            col,
            api_key=None,
            model=info.model,
            concurrency=run.concurrency,
            request_rate=run.request_rate,
            repeats=run.repeats,
            warmup=run.warmup,
            skipped=run.skipped,
            floor=run.floor,
        )
