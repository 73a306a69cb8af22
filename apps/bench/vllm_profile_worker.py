"""vLLM's side of ``benchmarks/kernel_profile.py``: the same two profiled runs, in vLLM.

Usage: ``python -P vllm_profile_worker.py JOB.json RESULT.json``, with vLLM's
``PYTHONPATH`` (see :mod:`pitstop.bench.vllm_worker`: standard library and
vLLM only). The job holds the ``LLM(...)`` keyword arguments, the prompts, the
two output lengths and a folder for the traces. vLLM's own profiler writes
them (``profiler_config``, or ``VLLM_TORCH_PROFILER_DIR`` on versions that
predate it); the engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that ``stop_profile`` returns once
the trace is written. The result lists, per run, the trace files that run
wrote; on a failure, the stage and the error. Exit status: 0 done, 3 failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

TRACE_WAIT_S = 180.0  # how long a run's trace may take to appear after stop_profile


def _traces(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*") if p.is_file() and ".json" in p.name}


def _llm(vllm: Any, kwargs: dict[str, Any], folder: Path) -> Any:
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(folder),
        "torch_profiler_with_stack": False,
    }
    try:
        return vllm.LLM(**kwargs, profiler_config=config)
    except TypeError as exc:  # a vLLM without profiler_config: the environment variable
        if "profiler_config" not in str(exc):
            raise
        os.environ["VLLM_TORCH_PROFILER_DIR"] = str(folder)
        return vllm.LLM(**kwargs)


def main(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    result: dict[str, Any] = {"stage": "import"}
    folder = Path(job["trace_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm

        result["vllm_version"] = vllm.__version__
        result["stage"] = "load"
        llm = _llm(vllm, job["llm_kwargs"], folder)
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]

        def params(tokens: int) -> Any:
            return vllm.SamplingParams(
                max_tokens=tokens, ignore_eos=True, temperature=0, detokenize=False
            )

        result["stage"] = "generate"
        warm = prompts[: min(8, len(prompts))]
        llm.generate(warm, [params(4)] * len(warm), use_tqdm=False)  # warm-up
        runs = []
        for tokens in job["max_tokens"]:
            before = _traces(folder)
            llm.start_profile()
            llm.generate(prompts, [params(tokens)] * len(prompts), use_tqdm=False)
            llm.stop_profile()
            deadline = time.monotonic() + TRACE_WAIT_S
            while not (_traces(folder) - before) and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(1.0)  # a trace still being written grows; let it finish
            runs.append({"max_tokens": tokens, "traces": sorted(_traces(folder) - before)})
        result = {"ok": True, "stage": "done", "vllm_version": vllm.__version__, "runs": runs}
        code = 0
    except Exception as exc:  # noqa: BLE001 - the parent reports it with the stage
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        code = 3
    Path(result_path).write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
