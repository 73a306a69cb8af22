"""vLLM as the peer of ``pitstop bench``: its environment, its arguments, its offline run.

vLLM always runs in a process of its own (``LLM.generate`` in
:mod:`pitstop.bench.vllm_worker` offline, ``vllm serve`` online:
:mod:`pitstop.bench.vllm_server`), so neither engine holds the other's GPU
memory, and vLLM's packages never enter pitstop's process. Where vLLM lives:

- ``PITSTOP_VLLM_PYTHON``: the interpreter that runs it (default: this one);
- ``PITSTOP_VLLM_PYTHONPATH``: put before ``PYTHONPATH`` for vLLM's process only (the
  H200 installs the carried wheels under ``/tmp/vsite``: ``benchmarks/vllm_setup.sh``);
- ``VLLM_USE_FLASHINFER_SAMPLER`` is set to ``0`` unless given (the carried set has no
  FlashInfer cubins).

:func:`engine_args` gives both sides the same model, shapes and limits: dtype,
``max_model_len``, ``max_num_seqs`` (pitstop's ``max_batch_size``), memory fraction,
KV-cache dtype, ``kv_cache_gib`` (vLLM's ``kv_cache_memory_bytes``), weight quantization
(``weights=fp8`` is vLLM's ``quantization=fp8``), seed; prefix caching only for a workload
whose prompts reuse earlier ones (shared prefixes, conversations: the timed passes and the
warm-up repeat the same prompts, which a prefix cache would serve from memory); the
workload's own vLLM arguments (``multiturn``: ``kv_offloading_size`` and
``kv_offloading_backend``, vLLM's CPU offloading); vLLM's own defaults for everything else
(CUDA graphs, chunked prefill, its attention backend), and ``--peer-arg KEY=VALUE`` on top.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pitstop.bench.report import RequestRecord, RunResult
from pitstop.bench.workloads import Workload
from pitstop.errors import PitstopError

ENV_PYTHON = "PITSTOP_VLLM_PYTHON"
ENV_PYTHONPATH = "PITSTOP_VLLM_PYTHONPATH"
ENV_TIMEOUT = "PITSTOP_VLLM_TIMEOUT"  # seconds the offline process may take in all
DEFAULT_TIMEOUT_S = 3600.0
STOP_GRACE_S = 30.0  # after SIGTERM, how long vLLM has to exit before SIGKILL
LOG_TAIL_LINES = 25
WORKER = Path(__file__).with_name("vllm_worker.py")

INSTALL_HINT = (
    f"install vLLM for that interpreter (pip install vllm==0.24.0), or set {ENV_PYTHON} to an "
    f"interpreter that has it, or {ENV_PYTHONPATH} to the folder it was installed into (on the "
    f"H200: bash benchmarks/vllm_setup.sh, then {ENV_PYTHONPATH}=/tmp/vsite)"
)


class VllmPeerError(PitstopError, RuntimeError):
    """The vLLM peer cannot run: not installed, cannot load the model, did not come up."""


# ---------------------------------------------------------------------- the process
def peer_python() -> str:
    """The interpreter that runs vLLM."""
    return os.environ.get(ENV_PYTHON) or sys.executable


def peer_env() -> dict[str, str]:
    """The environment of vLLM's process: this one, with vLLM's ``PYTHONPATH`` first."""
    env = dict(os.environ)
    extra = env.get(ENV_PYTHONPATH, "")
    if extra:  # absolute: vLLM's process runs in a folder of its own
        extra = os.pathsep.join(os.path.abspath(p) for p in extra.split(os.pathsep) if p)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def where() -> str:
    """Where vLLM is looked for, for error messages."""
    extra = os.environ.get(ENV_PYTHONPATH)
    return f"{peer_python()}" + (f" with {ENV_PYTHONPATH}={extra}" if extra else "")


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' when it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def missing_module_hint(log: str) -> str:
    """The fix for a vLLM process that stopped on ``ModuleNotFoundError`` ('' for any other end).

    vLLM itself missing is :data:`INSTALL_HINT`; a module vLLM imports that is missing (its
    server needs packages its offline path does not) is named, with how to add it."""
    found = re.findall(r"No module named '([^']+)'", log)
    if not found:
        return ""
    module = found[-1]
    if module.split(".")[0] == "vllm":
        return INSTALL_HINT
    package = module.split(".")[0].replace("_", "-")
    return (
        f"vLLM imports the module {module!r}, which {where()} lacks: pip install {package} for "
        "that interpreter (on the H200: carry its wheel and its own needs in .vx/, which "
        "benchmarks/vllm_setup.sh installs beside vLLM; benchmarks/vllm_download.sh fetches "
        "them for the next set of parts)"
    )


def installed_version() -> str:
    """The version of the vLLM that :func:`peer_python` imports (read from its metadata,
    without importing it); a :class:`VllmPeerError` naming the fix when there is none."""
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    try:
        done = subprocess.run(
            [peer_python(), "-P", "-c", code],
            env=peer_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise VllmPeerError(f"cannot run {peer_python()} ({exc}); fix: {INSTALL_HINT}") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmPeerError(f"vLLM is not installed for {where()} ({last}); fix: {INSTALL_HINT}")
    return done.stdout.strip()


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM (``timeout``, a cancelled job) into SystemExit while vLLM runs, so that
    the ``finally`` blocks that stop it run; a no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def start_process(argv: list[str], log_path: Path, cwd: Path) -> subprocess.Popen:
    """Start ``argv`` in a session of its own (vLLM starts children: they form one group),
    its output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=peer_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_process(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop ``proc`` and every process of its group: SIGTERM, then SIGKILL after ``grace_s``."""

    def signal_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    if proc.poll() is None:
        signal_group(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            signal_group(signal.SIGKILL)
            proc.wait(10)
    signal_group(signal.SIGKILL)  # children the leader left behind (vLLM's engine core)


def wait_for_gpu_memory(device: str, fraction: float = 0.9, timeout_s: float = 30.0) -> None:
    """After vLLM's processes exit, wait (at most ``timeout_s``) until ``fraction`` of the
    GPU's memory is free again, so that the engine started next sizes its KV cache on all of
    it; a no-op off CUDA."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        if free >= fraction * total or time.monotonic() > deadline:
            if free < fraction * total:
                print(
                    f"[bench] only {free / 2**30:.1f} of {total / 2**30:.1f} GiB of {device} are "
                    "free after the vLLM peer exited",
                    file=sys.stderr,
                )
            return
        time.sleep(0.5)


# ---------------------------------------------------------------------- the arguments
def kv_cache_dtype(pitstop_value: str) -> str:
    """vLLM's ``kv_cache_dtype`` of pitstop's: the fp8 formats by name, else ``auto``."""
    return pitstop_value if pitstop_value.startswith("fp8") else "auto"


def quantization(weights: str | None) -> str | None:
    """vLLM's ``quantization`` for pitstop's weight format: ``fp8`` (vLLM's
    ``--quantization fp8``: per-channel e4m3 weights quantized at load, activations
    per token, as pitstop's), else none (dense weights; a GGUF file vLLM reads as it is)."""
    return "fp8" if weights == "fp8" else None


def parse_peer_args(items: list[str] | None) -> dict[str, Any]:
    """``--peer-arg KEY=VALUE`` items -> ``{key: value}``; a value that is JSON
    (``true``, ``8``, ``{"method": "ngram"}``) is parsed, any other is a string."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise VllmPeerError(
                f"--peer-arg takes KEY=VALUE (an LLM(...) keyword / vllm serve flag), got {item!r}"
            )
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def engine_args(
    model_args: dict[str, Any],
    config: Any,
    workload: Workload,
    *,
    dtype: str,
    max_model_len: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments (the ``vllm serve`` flags, spelt with dashes) that give
    vLLM pitstop's model, shapes and limits (see the module doc); ``extra`` wins."""
    args: dict[str, Any] = dict(model_args)
    args.update(
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=config.max_batch_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_dtype=kv_cache_dtype(config.kv_cache_dtype),
        seed=config.seed,
        enable_prefix_caching=workload.reuses_prompts,
    )
    if config.kv_cache_gib is not None:  # the same device cache on both sides
        args["kv_cache_memory_bytes"] = int(config.kv_cache_gib * 2**30)
    args.update(workload.peer_args)  # the workload's own (multiturn: vLLM's CPU offloading)
    if "kv_offloading_size" in args and "kv_offloading_size" in config.options:
        args["kv_offloading_size"] = config.options["kv_offloading_size"]  # the size pitstop's has
    if config.tensor_parallel_size > 1:
        args["tensor_parallel_size"] = config.tensor_parallel_size
    if quantization(getattr(config, "weights", None)):
        args["quantization"] = quantization(config.weights)
    if config.enforce_eager:
        args["enforce_eager"] = True
    args.update(extra or {})
    return args


# ---------------------------------------------------------------------- offline
def _failure(result: dict[str, Any], args: dict[str, Any], log: Path) -> VllmPeerError:
    stage, error = result.get("stage"), result.get("error", "unknown error")
    version = result.get("vllm_version")
    if stage == "import":
        fix = missing_module_hint(str(error)) or INSTALL_HINT
        return VllmPeerError(f"vLLM is not importable by {where()} ({error}); fix: {fix}")
    if stage == "load":
        return VllmPeerError(
            f"vLLM {version} cannot load the model {args.get('model')} ({error}); fix: pass a "
            "model vLLM reads (a dummy: preset, a Hugging Face checkpoint folder, a GGUF file "
            "of an architecture it supports) and make sure the GPU has the memory free "
            f"(gpu_memory_utilization={args.get('gpu_memory_utilization')}); vLLM's log: {log}"
        )
    return VllmPeerError(f"vLLM {version} failed while generating ({error}); vLLM's log: {log}")


def run_worker(
    worker: Path, job: dict[str, Any], *, workdir: Path, log_path: Path, timeout_s: float | None
) -> dict[str, Any]:
    """Run a worker script (``python -P WORKER JOB.json RESULT.json``) in vLLM's environment,
    stopped whatever happens; return the result it wrote. A :class:`VllmPeerError` when it
    outlasts ``timeout_s`` (default ``PITSTOP_VLLM_TIMEOUT`` or 3,600 s) or writes nothing."""
    timeout_s = timeout_s or float(os.environ.get(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S)
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, result_path = (
        workdir / f"{worker.stem}-job.json",
        workdir / f"{worker.stem}-result.json",
    )
    if worker == WORKER:  # the names earlier results and docs use
        job_path, result_path = workdir / "vllm-job.json", workdir / "vllm-result.json"
    result_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    argv = [peer_python(), "-P", str(worker), str(job_path), str(result_path)]
    with stop_on_sigterm():
        proc = start_process(argv, log_path, workdir)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise VllmPeerError(
                f"the vLLM process did not finish within {timeout_s:.0f} s (set {ENV_TIMEOUT} "
                f"for more); vLLM's log: {log_path}"
            ) from None
        finally:
            stop_process(proc)
    try:
        return json.loads(result_path.read_text())
    except (OSError, ValueError):
        raise VllmPeerError(
            f"the vLLM process ({where()}) exited with status {proc.returncode} before it "
            f"reported anything; the end of its log ({log_path}):\n{log_tail(log_path)}"
        ) from None


def run_offline(
    workload: Workload,
    args: dict[str, Any],
    *,
    repeats: int,
    warmup: bool,
    workdir: Path,
    log_path: Path,
    timeout_s: float | None = None,
    lora: list[Any] | None = None,
) -> tuple[list[RunResult], dict[str, Any]]:
    """Run ``workload`` through ``LLM(**args).generate`` in a vLLM process: a warm-up, then
    ``repeats`` timed passes. Returns one :class:`RunResult` per pass (request counts and
    wall time: ``LLM.generate`` reports no per-token times) and what vLLM said about itself
    (``vllm_version``, ``resolved_config``, ``load_s``). ``lora``: pitstop ``LoRARequest`` values
    that the requests take in turn, as vLLM's own (``args`` must enable LoRA)."""
    if any(r.prompt_token_ids is None for r in workload.requests):
        raise VllmPeerError("the vLLM peer takes token ids; tokenize text prompts first")
    job = {
        "llm": args,
        "requests": [[list(r.prompt_token_ids or ()), r.output_len] for r in workload.requests],
        "temperature": workload.temperature,
        "top_k": workload.top_k,
        "repeats": repeats,
        "warmup": warmup,
        "lora": [[a.lora_name, a.lora_int_id, a.lora_path] for a in lora or ()],
    }
    result = run_worker(WORKER, job, workdir=workdir, log_path=log_path, timeout_s=timeout_s)
    if not result.get("ok"):
        print(log_tail(log_path), file=sys.stderr)
        raise _failure(result, args, log_path)
    runs = [_run_result(r, i) for i, r in enumerate(result["runs"])]
    return runs, result


def _run_result(run: dict[str, Any], index: int) -> RunResult:
    """One pass of the worker as the bench's :class:`RunResult` (no per-token times)."""
    cached = run.get("cached_prompt_tokens") or []
    records = [
        RequestRecord(f"vllm{index}-{i}", n_in, n_out, 0.0, None, None)
        for i, (n_in, n_out) in enumerate(zip(run["input_lens"], run["output_lens"], strict=True))
    ]
    known = [c for c in cached if c is not None]
    prompt = sum(run["input_lens"])
    hit = sum(known) / prompt if known and len(known) == len(records) and prompt else None
    return RunResult(
        records=records,
        start=0.0,
        end=float(run["wall_s"]),
        prefix_hit_rate=hit,
        per_request_counters=False,
    )


def workdir_for(output: str | None) -> Path:
    """Where the peer's files go: beside ``--output`` when given, else a fresh temp folder."""
    if output:
        return Path(output).resolve().parent / (Path(output).stem + "-vllm")
    return Path(tempfile.mkdtemp(prefix="pitstop-vllm-"))
