"""Per-kernel time of one engine step, pitstop's and vLLM's, from the same requests (issue 29).

Both engines run the same token-id prompts twice under the torch profiler:
once with ``max_tokens=1`` (the prefill and the first token) and once with
``max_tokens=1+N``. The second run's kernel time minus the first's, divided
by ``N``, is the kernel time of one decode step at that batch and context,
whatever either engine's scheduler did with the prefill (chunks, mixing):
both runs did the same prefill. A ``prefill`` scenario profiles the first run
alone, per prompt.

Kernels are read from the profiler's Chrome trace (``cat`` ``kernel``,
``gpu_memcpy``, ``gpu_memset``; on a CPU, the top-level ``cpu_op`` events
stand in so the tool can be tested there) and grouped by what they do
(:data:`CATEGORIES`, by name), so the two engines' kernels, which are named
differently, meet in one table. vLLM runs in a process of its own
(:mod:`pitstop.bench.vllm_profile_worker`, vLLM's own ``start_profile``),
as the ``--peer vllm`` bench does.
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from pitstop.bench.floor import H200, Ceilings, non_embedding_params
from pitstop.ground.model_config import ModelConfig

# What a kernel does, by its name (first match wins; names lower-cased).
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("kv store", r"reshape_and_cache|store_kv|kv_store|write_kv|cache_write|concat_and_cache"),
    (
        "attention",
        r"attn|attention|flash|fmha|paged_decode|decode_kernel|decode_reduce|prefill_kernel"
        r"|split_kv|mha|mla",
    ),
    # pitstop's _rope_store_kernel rotates q/k and stores k/v in one pass: it counts as rotary
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|_mm_|mm_kernel|splitk|\baddmm|\bmm\b|linear"),
    ("norm", r"rms|norm"),
    ("rotary", r"rotary|rope"),
    ("activation", r"silu|gelu|act_and_mul|swiglu|swish"),
    (
        "sampler",
        r"sort|topk|top_k|top_p|softmax|sampl|multinomial|argmax|exponential|gumbel|cumsum",
    ),
    ("copy, index, elementwise", r"memcpy|memset|copy|elementwise|fill|index|gather|scatter|cat"),
)
TRACE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str) -> str:
    """The :data:`CATEGORIES` entry a kernel of this name belongs to ('other' when none)."""
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other"


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_times(events: Iterable[Mapping[str, Any]]) -> dict[str, tuple[float, int]]:
    """Device time (µs) and launch count of each kernel name.

    GPU events when there are any; otherwise the CPU operators that no other
    operator encloses (a CPU run has no kernels), so that nothing is counted twice.
    """
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in complete if e.get("cat") in TRACE_CATEGORIES]
    chosen = gpu or _outermost([e for e in complete if e.get("cat") == "cpu_op"])
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in chosen:
        entry = out[str(e.get("name", "?"))]
        entry[0] += float(e["dur"])
        entry[1] += 1
    return {name: (t, int(n)) for name, (t, n) in out.items()}


def _outermost(ops: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    by_thread: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for e in ops:
        by_thread[e.get("tid")].append(e)
    kept: list[Mapping[str, Any]] = []
    for events in by_thread.values():
        end = float("-inf")
        for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            if float(e["ts"]) >= end:
                kept.append(e)
                end = float(e["ts"]) + float(e["dur"])
    return kept


def per_step(
    longer: Mapping[str, tuple[float, int]], shorter: Mapping[str, tuple[float, int]], steps: int
) -> dict[str, tuple[float, float]]:
    """(µs, launches) per step of each kernel: ``(longer - shorter) / steps``; kernels whose
    difference is not positive (prefill-only kernels, noise) are left out."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    out: dict[str, tuple[float, float]] = {}
    for name, (t, n) in longer.items():
        t0, n0 = shorter.get(name, (0.0, 0))
        if t - t0 > 0:
            out[name] = ((t - t0) / steps, (n - n0) / steps)
    return out


@attrs.frozen
class Scenario:
    """The requests both engines profile: ``batch`` prompts of ``prompt_len`` tokens."""

    name: str
    batch: int
    prompt_len: int
    decode_steps: int  # N: the long run asks max_tokens = 1 + N

    @property
    def max_tokens(self) -> tuple[int, ...]:
        """The runs' output lengths: 1 (the prefill), then ``1 + N`` for a decode scenario."""
        return (1, 1 + self.decode_steps) if self.decode_steps else (1,)

    def per_unit(self, runs: list[dict[str, tuple[float, int]]]) -> dict[str, tuple[float, float]]:
        """(µs, launches) of each kernel per decode step (the runs of :attr:`max_tokens`: the
        second minus the first, over N) or, for a prefill scenario, per prompt."""
        if self.decode_steps == 0:
            (run,) = runs
            return {k: (t / self.batch, n / self.batch) for k, (t, n) in run.items()}
        short, long = runs
        return per_step(long, short, self.decode_steps)

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Seeded token ids, the same for both engines (distinct per prompt: no prefix hits)."""
        import random

        rng = random.Random(0)
        return [
            [rng.randrange(10, vocab_size - 10) for _ in range(self.prompt_len)]
            for _ in range(self.batch)
        ]


SCENARIOS: dict[str, Scenario] = {
    # nano's steady decode: 256 sequences at about its mean context
    "nano-decode": Scenario("nano-decode", batch=256, prompt_len=512, decode_steps=32),
    # single: one stream at batch 1
    "single-decode": Scenario("single-decode", batch=1, prompt_len=512, decode_steps=64),
    # longtail's long prompts: one 2,048-token prefill (per prompt, first run alone)
    "prefill-2048": Scenario("prefill-2048", batch=4, prompt_len=2048, decode_steps=0),
}


def roofline(
    label: str, us: float, mc: ModelConfig, scenario: Scenario, ceilings: Ceilings = H200
) -> tuple[str, float | None]:
    """What a category moves in one step (bytes or FLOPs, described) and the fraction of the
    ceiling its time reaches; (``''``, None) for categories without a simple model."""
    seconds = us * 1e-6
    if seconds <= 0:
        return "", None
    # a prefill scenario's table is per prompt; a decode step's is the whole batch
    b = 1 if scenario.decode_steps == 0 else scenario.batch
    ctx = scenario.prompt_len
    if label == "gemm":
        if scenario.decode_steps == 0:  # prefill: FLOPs
            flops = 2 * non_embedding_params(mc) * b * ctx
            return f"{flops / 1e12:.2f} TFLOP", flops / seconds / ceilings.matmul_flops_per_s
        # bf16: every dense weight and the output head once a step (the embedding is a lookup)
        weights = 2 * (non_embedding_params(mc) + mc.vocab_size * mc.hidden_size)
        return f"{weights / 1e9:.2f} GB weights", weights / seconds / ceilings.copy_bytes_per_s
    if label == "attention":
        if scenario.decode_steps == 0:
            pairs = ctx * (ctx + 1) / 2
            flops = 4 * mc.num_layers * mc.num_heads * mc.head_size * pairs * b
            return f"{flops / 1e12:.2f} TFLOP", flops / seconds / ceilings.matmul_flops_per_s
        kv = 2 * mc.kv_bytes_per_token * b * (ctx + scenario.decode_steps // 2)
        return f"{kv / 1e9:.2f} GB KV", kv / seconds / ceilings.copy_bytes_per_s
    return "", None


def category_table(
    engines: Mapping[str, Mapping[str, tuple[float, float]]],
    mc: ModelConfig,
    scenario: Scenario,
    ceilings: Ceilings = H200,
) -> list[dict[str, Any]]:
    """One row per category: µs per step (or per prompt) in each engine, what it moves, the
    fraction of the ceiling in each engine; largest pitstop excess first."""
    totals: dict[str, dict[str, float]] = defaultdict(dict)
    for engine, kernels in engines.items():
        for name, (us, _n) in kernels.items():
            cat = category(name)
            totals[cat][engine] = totals[cat].get(engine, 0.0) + us
    rows = []
    names = list(engines)
    for cat, by_engine in totals.items():
        row: dict[str, Any] = {"category": cat}
        for engine in names:
            us = by_engine.get(engine, 0.0)
            moved, frac = roofline(cat, us, mc, scenario, ceilings)
            row[engine] = us
            row[f"{engine} of ceiling"] = frac
            row["moves"] = moved or row.get("moves", "")
        rows.append(row)
    rows.append({"category": "total", **{e: sum(r[e] for r in rows) for e in names}})
    if len(names) > 1:
        a, b = names[0], names[1]
        rows.sort(key=lambda r: (r["category"] == "total", -(r[a] - r[b])))
    else:
        rows.sort(key=lambda r: (r["category"] == "total", -r[names[0]]))
    return rows


def markdown(rows: list[dict[str, Any]], engines: list[str], unit: str) -> str:
    """The table of :func:`category_table` in Markdown."""
    head = ["category", *[f"{e} ({unit})" for e in engines]]
    if len(engines) == 2:
        head.append(f"{engines[0]} - {engines[1]}")
    head += ["moves", *[f"{e} of ceiling" for e in engines]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["category"], *[f"{r[e]:,.1f}" for e in engines]]
        if len(engines) == 2:
            cells.append(f"{r[engines[0]] - r[engines[1]]:+,.1f}")
        cells.append(r.get("moves", ""))
        for e in engines:
            frac = r.get(f"{e} of ceiling")
            cells.append(f"{100 * frac:.0f}%" if frac is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def top_kernels(
    kernels: Mapping[str, tuple[float, float]], n: int = 15
) -> list[tuple[str, float, float]]:
    """The ``n`` kernels with the most time per step: (name, µs, launches)."""
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name, us, launches) for name, (us, launches) in ranked]


# ---------------------------------------------------------------------- running the engines
def profiled_runs(
    generate: Any, scenario: Scenario, prompts: list[list[int]], trace_dir: Path, prefix: str
) -> list[dict[str, tuple[float, int]]]:
    """Run ``generate(prompts, max_tokens)`` under the torch profiler for each of the
    scenario's :attr:`~Scenario.max_tokens`; each run's Chrome trace is written to
    ``trace_dir/PREFIX-TOKENS.json`` and its kernel times returned."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    trace_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for tokens in scenario.max_tokens:
        with profile(activities=activities) as prof:
            generate(prompts, tokens)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        path = trace_dir / f"{prefix}-{tokens}.json"
        prof.export_chrome_trace(str(path))
        runs.append(kernel_times(read_trace(path)))
    return runs


def profile_pitstop(
    model: str,
    scenario: Scenario,
    trace_dir: Path,
    lora_adapters: int = 0,
    warm_prompts: bool = False,
    **engine_kwargs: Any,
) -> tuple[dict[str, tuple[float, float]], ModelConfig]:
    """pitstop's kernels per step of ``scenario`` (a warm-up run first, outside the profile),
    and the model's shape (which the vLLM side and the ceilings need). ``lora_adapters``: the
    requests take N random rank-16 adapters on every projection in turn (none: the base model).

    ``warm_prompts`` (a decode scenario): the engine takes the ``prefix`` allocator and runs
    the prompts once before the profile, so that both profiled runs find every prompt's full
    pages cached and prefill only its last tokens. Without it the long run's chunked prefill
    shares its steps with the decode rows of the prompts already prefilled, and so takes
    more steps (and launches) for the same prompts than the short run: the difference of the
    two runs then holds prefill work too. A prompt served nothing from the cache (a cache too
    small for the batch's prompts) raises a :class:`ValueError` naming the fix."""
    engine_kwargs.setdefault("max_model_len", scenario.prompt_len + scenario.decode_steps + 16)
    if lora_adapters:
        engine_kwargs["adapter"] = "lora"
        engine_kwargs.setdefault("options", {}).setdefault("max_loras", lora_adapters)
    if warm_prompts:
        if scenario.decode_steps == 0:
            raise ValueError(
                f"warm prompts apply to a decode scenario; {scenario.name} profiles the prompts' "
                "own prefill: drop the warm prompts"
            )
        if engine_kwargs.setdefault("allocator", "prefix") != "prefix":
            raise ValueError(
                f"warm prompts need the prefix allocator, not {engine_kwargs['allocator']!r}: "
                "drop the allocator or the warm prompts"
            )
    runs, mc = _profile_pitstop_runs(
        model, scenario, trace_dir, engine_kwargs, lora_adapters, warm_prompts
    )
    _free_cuda()  # vLLM runs next, in its own process: the engine's memory is given back first
    return scenario.per_unit(runs), mc


def _profile_pitstop_runs(
    model: str,
    scenario: Scenario,
    trace_dir: Path,
    engine_kwargs: dict[str, Any],
    lora_adapters: int = 0,
    warm_prompts: bool = False,
) -> tuple[list[dict[str, tuple[float, int]]], ModelConfig]:
    from pitstop import LLM, SamplingParams

    with LLM(model, **engine_kwargs) as llm:
        mc = llm.engine.model_config
        prompts = scenario.prompts(mc.vocab_size)
        adapters: list[Any] = []
        if lora_adapters:
            from pitstop.bench.lora_adapters import lora_requests, write_random_adapters

            folder = Path(tempfile.mkdtemp(prefix="profile-lora-"))
            adapters = lora_requests(write_random_adapters(mc, lora_adapters, 16, folder))

        cached: list[list[int]] = []  # each run's cached prompt tokens, per prompt

        def generate(batch: list[list[int]], tokens: int) -> None:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
            lora = [adapters[i % len(adapters)] for i in range(len(batch))] if adapters else None
            outputs = llm.generate(
                prompt_token_ids=batch, sampling_params=params, use_tqdm=False, lora_request=lora
            )
            cached.append([out.num_cached_tokens for out in outputs])

        generate(prompts[: min(8, len(prompts))], 4)  # warm-up: graphs, autotuning
        if warm_prompts:
            generate(prompts, 1)  # every prompt's pages into the prefix cache
        runs = profiled_runs(generate, scenario, prompts, trace_dir, "pitstop")
        if warm_prompts:
            _check_warm(cached[-len(runs) :], scenario)
        return runs, mc


def _check_warm(cached: list[list[int]], scenario: Scenario) -> None:
    """Every prompt of every profiled run found pages in the prefix cache (``cached``: each
    run's cached prompt tokens per prompt), else a ValueError naming the fix."""
    for run, tokens in enumerate(cached):
        missed = sum(1 for n in tokens if n == 0)
        if missed:
            raise ValueError(
                f"warm prompts: {missed} of {len(tokens)} prompts found nothing in the prefix "
                f"cache in profiled run {run + 1}; the KV cache does not hold {scenario.batch} "
                f"prompts of {scenario.prompt_len} tokens: profile fewer (--batch) or give the "
                "cache more memory"
            )


def _free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile_vllm(
    model: str,
    mc: ModelConfig,
    scenario: Scenario,
    trace_dir: Path,
    *,
    gpu_memory_utilization: float = 0.9,
    extra: dict[str, Any] | None = None,
    timeout_s: float | None = None,
) -> tuple[dict[str, tuple[float, float]], str]:
    """vLLM's kernels per step of ``scenario`` on the same prompts (its own process, prefix
    caching off, CUDA graphs and its other defaults on); returns them and vLLM's version."""
    from pitstop.bench import vllm_peer
    from pitstop.bench.vllm_model import vllm_model

    trace_dir.mkdir(parents=True, exist_ok=True)
    target = vllm_model(model, mc, trace_dir)
    kwargs = {
        **target.engine_args(),
        "dtype": "bfloat16",
        "max_model_len": scenario.prompt_len + scenario.decode_steps + 16,
        "max_num_seqs": max(scenario.batch, 256),  # pitstop's default max_batch_size
        "gpu_memory_utilization": gpu_memory_utilization,
        "enable_prefix_caching": False,
        "seed": 0,
        **(extra or {}),
    }
    job = {
        "llm_kwargs": kwargs,
        "prompts": scenario.prompts(mc.vocab_size),
        "max_tokens": list(scenario.max_tokens),
        "trace_dir": str(trace_dir / "vllm-traces"),
    }
    log = trace_dir / "vllm-profile.log"
    worker = Path(vllm_peer.__file__).with_name("vllm_profile_worker.py")
    result = vllm_peer.run_worker(worker, job, workdir=trace_dir, log_path=log, timeout_s=timeout_s)
    if not result.get("ok"):
        raise vllm_peer.VllmPeerError(
            f"vLLM's profile failed at {result.get('stage')}: {result.get('error')}; "
            f"the end of its log ({log}):\n{vllm_peer.log_tail(log)}"
        )
    runs = []
    for run in result["runs"]:
        if not run["traces"]:
            raise vllm_peer.VllmPeerError(
                f"vLLM wrote no trace for max_tokens={run['max_tokens']} under {job['trace_dir']}"
            )
        runs.append(kernel_times(e for path in run["traces"] for e in read_trace(path)))
    return scenario.per_unit(runs), str(result.get("vllm_version"))
