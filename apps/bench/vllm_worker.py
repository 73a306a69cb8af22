"""The vLLM side of ``pitstop bench offline --peer vllm``, run in a process of its own.

Usage: ``python -P vllm_worker.py JOB.json RESULT.json``. Started by
:mod:`pitstop.bench.vllm_peer`, with vLLM's ``PYTHONPATH`` (which may carry
packages that would shadow pitstop's), so this file imports nothing but the
standard library and vLLM: not pitstop, and ``-P`` keeps its own folder (which
holds a module named ``http``) off ``sys.path``.

The job holds the ``LLM(...)`` keyword arguments, the requests (token ids and
output lengths), the LoRA adapters the requests take in turn (if any), the sampling, the number of timed passes and whether to warm
up. The warm-up is the one pitstop's driver runs (the first 4 requests, outputs
cut to 8 tokens); every timed pass is one ``LLM.generate`` over all requests.
The result holds, per pass, the wall time and each request's prompt, output and
cached-prompt token counts; or, on a failure, the stage it failed at (``import``,
``load``, ``generate``) and the error. Exit status: 0 done, 3 failed (result
written), anything else a crash (the parent reads the log).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

WARMUP_REQUESTS = 4
WARMUP_TOKENS = 8
RESOLVED_CONFIG_CHARS = 6000  # how much of vLLM's own description of its config is kept


def _say(msg: str) -> None:
    print(f"[vllm-peer] {msg}", flush=True)


def _params(vllm: Any, job: dict[str, Any], max_tokens: int) -> Any:
    kwargs: dict[str, Any] = {
        "temperature": job["temperature"],
        "max_tokens": max_tokens,
        "ignore_eos": True,  # every request produces exactly its output_len
        "detokenize": False,  # token ids in, token ids out, as pitstop's bench
    }
    if job["top_k"] > 0:
        kwargs["top_k"] = job["top_k"]
    return vllm.SamplingParams(**kwargs)


def _adapters(job: dict[str, Any]) -> list[Any]:
    """The job's LoRA adapters (``[name, id, path]`` each) as vLLM's ``LoRARequest``; none: []."""
    if not job.get("lora"):
        return []
    from vllm.lora.request import LoRARequest

    return [LoRARequest(name, int(lora_id), path) for name, lora_id, path in job["lora"]]


def _generate(
    vllm: Any, llm: Any, job: dict[str, Any], requests: list[Any], adapters: list[Any]
) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": list(ids)} for ids, _ in requests]
    params = [_params(vllm, job, n) for _, n in requests]
    kwargs: dict[str, Any] = {}
    if adapters:  # the requests take the adapters in turn, as pitstop's bench gives them
        kwargs["lora_request"] = [adapters[i % len(adapters)] for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "input_lens": [len(ids) for ids, _ in requests],
        "output_lens": [len(o.outputs[0].token_ids) for o in outs],
        "cached_prompt_tokens": [getattr(o, "num_cached_tokens", None) for o in outs],
    }


def _resolved_config(llm: Any) -> str | None:
    """vLLM's own description of the configuration it resolved (attention backend, graphs, ...)."""
    try:
        return str(llm.llm_engine.vllm_config)[:RESOLVED_CONFIG_CHARS]
    except Exception:  # an internal attribute: absent in some versions
        return None


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Run the job; the result document (``ok`` False with ``stage`` and ``error`` on failure)."""
    stage = "import"
    version = None
    try:
        t = time.perf_counter()
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        _say(f"vLLM {version} imported in {time.perf_counter() - t:.1f} s from {vllm.__file__}")
        stage = "load"
        t = time.perf_counter()
        llm = vllm.LLM(**job["llm"])
        load_s = time.perf_counter() - t
        _say(f"LLM(...) ready in {load_s:.1f} s")
        stage = "generate"
        requests = [(r[0], r[1]) for r in job["requests"]]
        adapters = _adapters(job)
        warmup_s = None
        if job.get("warmup", True):
            t = time.perf_counter()
            short = [(ids, min(n, WARMUP_TOKENS)) for ids, n in requests[:WARMUP_REQUESTS]]
            _generate(vllm, llm, job, short, adapters)
            warmup_s = time.perf_counter() - t
        runs = []
        for k in range(max(1, job.get("repeats", 1))):
            run_ = _generate(vllm, llm, job, requests, adapters)
            tokens = sum(run_["output_lens"])
            _say(
                f"pass {k + 1}: {tokens} output tokens in {run_['wall_s']:.2f} s = "
                f"{tokens / run_['wall_s']:.1f} tok/s"
            )
            runs.append(run_)
        return {
            "ok": True,
            "vllm_version": version,
            "load_s": load_s,
            "warmup_s": warmup_s,
            "resolved_config": _resolved_config(llm),
            "runs": runs,
        }
    except BaseException as exc:  # any failure is reported to the parent, whatever it is
        if isinstance(exc, KeyboardInterrupt):
            raise
        traceback.print_exc()
        return {
            "ok": False,
            "stage": stage,
            "error": f"{type(exc).__name__}: {exc}",
            "vllm_version": version,
        }


def main(argv: list[str]) -> int:
    """``vllm_worker.py JOB RESULT``: run the job, write the result; 0 if it ran, 3 if not."""
    if len(argv) != 2:
        print("usage: python -P vllm_worker.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = run(job)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
