"""The GPU correctness matrix (issue 27): every strategy combination against transformers.

Each configuration runs in a process of its own, started fresh (``spawn``,
one configuration per process), with poisoned memory: nothing it reads can
come from another configuration's run. The reference is transformers'
float32 greedy decoding of the same chat prompts on the real SmolLM2
weights, with the margin between the two best logits at every step, so that
a divergence at a near-tie (< :data:`NEAR_TIE` logits) is allowed and
reported instead of failing.

Besides SmolLM2, two models have rows of their own (:mod:`gpu_matrix_models`): a random
Qwen3-MoE checkpoint (issue 48) against transformers, and SmolLM2 with a random PEFT
LoRA adapter on every other prompt (issue 47) against PEFT's merged model.

``python tests/helpers/gpu_matrix.py [--workers N] [--json FILE]`` runs it outside
pytest (``benchmarks/h200.sh`` runs the test, ``tests/core/loop/test_gpu_matrix.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

try:
    from helpers.gpu_matrix_models import ModelUnderTest, build_model, model_rows
except ImportError:  # run as a script: tests/helpers itself is on sys.path
    from gpu_matrix_models import ModelUnderTest, build_model, model_rows

NEW_TOKENS = 48
NEAR_TIE = 1e-3
MAX_MODEL_LEN = 192

PROMPTS = [
    "Name three rivers in South America and one fact about each.",
    "What is the capital of France? Answer in one sentence.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse.",
    "List the first five prime numbers and say what makes them prime.",
    "How do I reverse a list in Python? Give one line of code.",
    "Describe the water cycle to a ten-year-old.",
    "Give two tips for sleeping better.",
]

ALLOCATORS = ("preallocated", "paged", "prefix")
SCHEDULERS = ("fcfs", "continuous", "chunked")
KERNELS = ("reference", "fused")
BUDGETS: tuple[int | None, ...] = (16, 64, 2048, None)  # None: the scheduler's default
OVERLAP = ("on", "off")


def budget_settings(scheduler: str, budget: int | None) -> dict[str, Any]:
    """The step token budget by the scheduler's own name for it (chunked: ``chunk_size``)."""
    if budget is None:
        return {}
    return {"chunk_size": budget} if scheduler == "chunked" else {"max_num_batched_tokens": budget}


def configurations() -> list[dict[str, Any]]:
    """Every allocator x scheduler x kernel set x step budget x overlap, then the special cases:
    a cache small enough to preempt, and ``n=2`` (both samples must be the greedy tokens)."""
    out = []
    for allocator, scheduler, kernels, budget, overlap in itertools.product(
        ALLOCATORS, SCHEDULERS, KERNELS, BUDGETS, OVERLAP
    ):
        out.append(
            {
                "name": f"{allocator}/{scheduler}/{kernels}/budget={budget or 'default'}/"
                f"overlap={overlap}",
                "settings": {
                    "allocator": allocator,
                    "scheduler": scheduler,
                    "kernels": kernels,
                    "overlap": overlap,
                    **budget_settings(scheduler, budget),
                },
            }
        )
    for allocator, scheduler, kernels in itertools.product(
        ("paged", "prefix"), ("continuous", "chunked"), KERNELS
    ):
        out.append(
            {
                "name": f"{allocator}/{scheduler}/{kernels}/preempting(24 pages)",
                "settings": {
                    "allocator": allocator,
                    "scheduler": scheduler,
                    "kernels": kernels,
                    "max_num_pages": 24,
                    **budget_settings(scheduler, 64),
                },
                "expect_preemption": True,
            }
        )
        if scheduler == "chunked":
            out.append(
                {
                    "name": f"{allocator}/{scheduler}/{kernels}/n=2",
                    "settings": {
                        "allocator": allocator,
                        "scheduler": scheduler,
                        "kernels": kernels,
                    },
                    "n": 2,
                }
            )
    return (
        out
        + fused_layer_rows()
        + prefix_share_rows()
        + tiered_rows()
        + issue_table()
        + model_rows()
    )


def tiered_rows() -> list[dict[str, Any]]:
    """Issue 50's host tier (``tiered``) on a 24-page cache, under continuous and chunked, both
    kernel sets, overlap on and off: the second pass finds the first pass's prompts on the
    host (side-stream copies, events, the compute stream waiting on them)."""
    rows = []
    for scheduler, kernels, overlap in itertools.product(
        ("continuous", "chunked"), KERNELS, OVERLAP
    ):
        rows.append(
            {
                "name": f"tiered/{scheduler}/{kernels}/host-tier(24 pages, overlap={overlap})",
                "settings": {
                    "allocator": "tiered",
                    "scheduler": scheduler,
                    "kernels": kernels,
                    "overlap": overlap,
                    "max_num_pages": 24,
                    "kv_offloading_size": 0.05,
                    **budget_settings(scheduler, 64),
                },
            }
        )
    return rows


def fused_layer_rows() -> list[dict[str, Any]]:
    """Issue 44's fused decoder layer (``fused.layer``) under every allocator x scheduler, with
    the scheduler's default budget and a 16-token one (chunks and decodes mixed in a step)."""
    rows = []
    for allocator, scheduler, budget in itertools.product(ALLOCATORS, SCHEDULERS, (16, None)):
        rows.append(
            {
                "name": f"{allocator}/{scheduler}/fused+layer/budget={budget or 'default'}",
                "settings": {
                    "allocator": allocator,
                    "scheduler": scheduler,
                    "kernels": "fused",
                    "options": {"fused.layer": True},
                    **budget_settings(scheduler, budget),
                },
            }
        )
    return rows


def prefix_share_rows() -> list[dict[str, Any]]:
    """Cascade decode (``fused.decode_prefix_share``): ``n=2`` samples of each prompt share its
    cached pages (``prefix``, 8-token pages so that the chat prompts fill several), under
    continuous and chunked with the overlapped loop on and off (beside the one-launch merge it
    is refused at start: ``test_decode_split_tokens_refuses_what_it_cannot_join``)."""
    rows = []
    for scheduler, overlap, merge in (
        ("continuous", "on", "separate"),
        ("chunked", "on", "separate"),
        ("chunked", "off", "separate"),
    ):
        options: dict[str, Any] = {"fused.decode_prefix_share": 16}
        if merge != "separate":
            options["fused.decode_merge"] = merge
        rows.append(
            {
                "name": f"prefix/{scheduler}/fused+prefix-share/n=2/overlap={overlap}/"
                f"merge={merge}",
                "settings": {
                    "allocator": "prefix",
                    "scheduler": scheduler,
                    "kernels": "fused",
                    "overlap": overlap,
                    "page_size": 8,
                    "options": options,
                },
                "n": 2,
            }
        )
    return rows


def issue_table() -> list[dict[str, Any]]:
    """The rows of issue 27's table (reference kernels, the model's default context): with a
    step budget set, a fresh process once gave 504, 701, ... instead of 33, 30, 9860, ..."""
    base = {"kernels": "reference", "max_model_len": None}
    rows: list[tuple[str, dict[str, Any]]] = [
        ("defaults", {}),
        ("scheduler=chunked", {"scheduler": "chunked"}),
        ("scheduler=continuous", {"scheduler": "continuous"}),
        *((f"chunk_size={n}", {"chunk_size": n}) for n in (16, 32, 64, 2048)),
        ("chunk_size=16,page_size=32", {"chunk_size": 16, "page_size": 32}),
        (
            "chunk_size=64,enforce_eager,overlap=off",
            {"chunk_size": 64, "enforce_eager": True, "overlap": "off"},
        ),
        (
            "continuous,max_num_batched_tokens=64",
            {"scheduler": "continuous", "max_num_batched_tokens": 64},
        ),
        ("chunk_size=16,device=cpu", {"chunk_size": 16, "device": "cpu", "max_num_pages": 300}),
    ]
    return [{"name": f"issue27/{name}", "settings": {**base, **extra}} for name, extra in rows]


def run_configuration(
    model: str,
    case: dict[str, Any],
    prompt_ids: list[list[int]],
    device: str = "cuda",
    lora_path: str | None = None,
) -> dict[str, Any]:
    """In a fresh process: build one engine (poisoned memory), generate the prompts greedily
    twice (the second pass reuses freed pages, and the prefix cache where there is one),
    return both passes' tokens per prompt and sample, or the error."""
    start = time.perf_counter()
    try:
        import torch

        from pitstop import LLM, SamplingParams

        os.environ.setdefault("OMP_NUM_THREADS", "2")  # several of these share the host's cores
        settings = {
            "device": device,
            "dtype": "float32",
            "max_model_len": MAX_MODEL_LEN,
            "max_batch_size": 32,
            "max_prefill_batch": 16,
            "max_num_pages": 256,
            "poison_memory": True,
            **case["settings"],
        }
        llm = LLM(model, **settings)
        built = time.perf_counter()  # import, load, KV cache, graph capture: the case's fixed cost
        params = SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=case.get("n", 1)
        )
        lora = None
        if lora_path is not None:  # the adapter on the even prompts, the base model elsewhere
            from pitstop import LoRARequest

            adapter = LoRARequest("matrix", 1, lora_path)
            lora = [adapter if i % 2 == 0 else None for i in range(len(prompt_ids))]
        passes = []
        pass_seconds = []
        for _ in range(2):
            begun = time.perf_counter()
            outs = llm.generate(
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                use_tqdm=False,
                lora_request=lora,
            )
            passes.append([[c.token_ids for c in o.outputs] for o in outs])
            pass_seconds.append(round(time.perf_counter() - begun, 2))
            errors = [
                c.finish_reason for o in outs for c in o.outputs if c.finish_reason == "error"
            ]
            if errors:
                raise RuntimeError(f"{len(errors)} sample(s) failed with reason 'error'")
        stats = llm.engine.allocator.stats()
        return {
            "name": case["name"],
            "passes": passes,
            "preemptions": llm.engine.stats.preemptions,
            "pages_leaked": stats.num_pages - stats.pages_free,
            "allocator_counters": dict(stats.counters),  # tiered: its host hits, bytes moved
            "seconds": time.perf_counter() - start,
            "build_seconds": round(built - start, 2),
            "pass_seconds": pass_seconds,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        }
    except Exception as exc:  # noqa: BLE001 - reported per configuration
        return {
            "name": case["name"],
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": time.perf_counter() - start,
        }


def transformers_reference(
    gguf: Path, device: str = "cuda"
) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """The chat prompts' ids and transformers' float32 greedy tokens, with each step's top-2 margin."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pitstop.plugins.model_sources.gguf.cache import cache_dir_for
    from pitstop.plugins.model_sources.gguf.loader import load_gguf

    folder = cache_dir_for(gguf)
    if not (folder / "tokenizer.json").is_file():
        load_gguf(gguf).weights()  # converts once: the engines' processes then find the cache
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model = model.to(device).eval()
    prompt_ids = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompt_ids.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # v5: a dict
    tokens, margins = greedy_reference(model, prompt_ids)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return prompt_ids, tokens, margins


def greedy_reference(
    model: Any, prompt_ids: list[list[int]]
) -> tuple[list[list[int]], list[list[float]]]:
    """A transformers model's float32 greedy tokens for each prompt, with each step's top-2 margin."""
    import torch

    device = next(model.parameters()).device
    tokens, margins = [], []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model(torch.tensor([ids], device=device), use_cache=True)
            got, gaps = [], []
            for _ in range(NEW_TOKENS):
                top = out.logits[0, -1].float().topk(2)
                token = int(top.indices[0])
                got.append(token)
                gaps.append(float(top.values[0] - top.values[1]))
                out = model(
                    torch.tensor([[token]], device=device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            tokens.append(got)
            margins.append(gaps)
    return tokens, margins


def judge(
    result: dict[str, Any], reference: list[list[int]], margins: list[list[float]]
) -> tuple[str, list[str]]:
    """``("pass" | "near-tie" | "FAIL", details)`` of one configuration against the reference."""
    if "error" in result:
        return "FAIL", [result["error"]]
    details: list[str] = []
    verdict = "pass"
    for number, run in enumerate(result["passes"], start=1):
        for p, samples in enumerate(run):
            for s, got in enumerate(samples):
                want = reference[p]
                first = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None
                )
                if first is None and len(got) == len(want):
                    continue
                if first is not None and margins[p][first] < NEAR_TIE:
                    verdict = "near-tie" if verdict == "pass" else verdict
                    details.append(
                        f"pass {number} prompt {p} sample {s}: near-tie at token {first} "
                        f"(margin {margins[p][first]:.2e}): {got[first]} vs {want[first]}"
                    )
                    continue
                verdict = "FAIL"
                at = first if first is not None else min(len(got), len(want))
                details.append(
                    f"pass {number} prompt {p} sample {s}: differs at token {at} "
                    f"(margin {margins[p][at] if at < len(margins[p]) else float('nan'):.3f}): "
                    f"got {got[max(0, at - 2) : at + 4]} want {want[max(0, at - 2) : at + 4]}"
                )
    if result.get("pages_leaked"):
        verdict = "FAIL"
        details.append(f"{result['pages_leaked']} KV pages still held after every request ended")
    return verdict, details


def model_path() -> Path:
    """The SmolLM2 GGUF: ``$SMOLLM_GGUF`` (the H200 has no wheel), else the installed wheel's."""
    env = os.environ.get("SMOLLM_GGUF")
    if env:
        return Path(env)
    from pitstop.plugins.model_sources.gguf.source import smollm2_path

    return smollm2_path()


def run_matrix(
    cases: list[dict[str, Any]] | None = None,
    workers: int = 12,
    device: str = "cuda",
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """The reference in this process, then every case in a fresh process; one row per case.

    ``on_row(rows)`` is called after each case with the rows so far (so a run stopped at
    its time limit still leaves what it measured).
    """
    gguf = model_path()
    prompt_ids, reference, margins = transformers_reference(gguf, device)
    cases = cases if cases is not None else configurations()
    # the other models' checkpoints (built here) and references: {model key: ModelUnderTest}
    models = {"smollm2": ModelUnderTest(str(gguf), reference, margins)}
    keys = {c.get("model", "smollm2") for c in cases} - set(models)
    if keys:
        workdir = Path(tempfile.mkdtemp(prefix="pitstop-matrix-"))
        for key in sorted(keys):
            models[key] = build_model(
                key, gguf, prompt_ids, reference, margins, workdir, device, greedy_reference
            )
    context = multiprocessing.get_context("spawn")
    rows = []
    with ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1) as pool:
        futures = []
        for c in cases:
            m = models[c.get("model", "smollm2")]
            futures.append(
                pool.submit(run_configuration, m.path, c, prompt_ids, device, m.lora_path)
            )
        for case, future in zip(cases, futures, strict=True):
            result = future.result()
            m = models[case.get("model", "smollm2")]
            verdict, details = judge(result, m.reference, m.margins)
            if case.get("expect_preemption") and not result.get("preemptions"):
                verdict = "FAIL" if "error" not in result else verdict
                details.append("expected the small cache to preempt, it never did")
            rows.append(
                {
                    "name": case["name"],
                    "verdict": verdict,
                    "details": details,
                    "preemptions": result.get("preemptions"),
                    # the issue's prompt (prompt 0), first pass: its first six tokens
                    "first_tokens": result["passes"][0][0][0][:6] if "passes" in result else None,
                    "seconds": round(result.get("seconds", 0.0), 1),
                    "build_seconds": result.get("build_seconds"),
                    "pass_seconds": result.get("pass_seconds"),
                    "reference_first": m.reference[0][:6],
                }
            )
            print(
                f"[matrix] {len(rows)}/{len(cases)} {verdict} {case['name']} "
                f"({rows[-1]['seconds']} s; engine built in {result.get('build_seconds')} s, "
                f"passes {result.get('pass_seconds')} s)",
                file=sys.stderr,
            )
            if on_row is not None:
                on_row(rows)
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """A short table: counts, then every row that is not a plain pass."""
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("pass", "near-tie", "FAIL")}
    lines = [
        f"GPU correctness matrix: {len(rows)} configurations, each in a fresh process with "
        f"poisoned memory, {len(PROMPTS)} chat prompts x {NEW_TOKENS} tokens x 2 passes against "
        f"transformers fp32 greedy: {counts['pass']} pass, {counts['near-tie']} near-tie, "
        f"{counts['FAIL']} FAIL"
    ]
    reference = " ".join(str(t) for t in rows[0]["reference_first"]) if rows else ""
    for r in rows:
        if r["name"].startswith("issue27/"):
            got = ", ".join(str(t) for t in r["first_tokens"] or [])
            why = "; ".join(r["details"][:2])
            lines.append(
                f"  {r['verdict']:8} {r['name']}: first tokens {got}" + (f" ({why})" if why else "")
            )
    lines.append(f"  (transformers fp32: {reference})")
    for r in rows:
        if r["verdict"] != "pass" and not r["name"].startswith("issue27/"):
            lines.append(f"  {r['verdict']:8} {r['name']}: " + "; ".join(r["details"][:3]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python tests/helpers/gpu_matrix.py``: run the matrix, print the summary, 0 when nothing fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument(
        "--only",
        metavar="TEXT[,TEXT...]",
        help="run only cases whose name contains one of the comma-separated TEXTs",
    )
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu to try the harness"
    )
    parser.add_argument(
        "--shard",
        metavar="I/N",
        default="1/1",
        help="run every N-th case from the I-th (1-based): the whole matrix (207 cases, about "
        "21 minutes of 12 processes on one H200) outlasts a 10-minute device call; three "
        "shards fit one each (benchmarks/h200.sh verify2..4)",
    )
    args = parser.parse_args(argv)
    index, count = (int(x) for x in args.shard.split("/"))
    if not 1 <= index <= count:
        parser.error(f"--shard {args.shard}: want I/N with 1 <= I <= N")
    wanted = [t for t in (args.only or "").split(",") if t]
    cases = [c for c in configurations() if not wanted or any(t in c["name"] for t in wanted)]
    cases = cases[index - 1 :: count]

    def save(rows: list[dict[str, Any]]) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")

    rows = run_matrix(cases, args.workers, args.device, save)
    print(summary(rows))
    return 1 if any(r["verdict"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
