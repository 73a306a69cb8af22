"""Running both configurations and tapping their logits; :func:`verify` puts it together."""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from pitstop.config import EngineConfig
from pitstop.entrypoints.chat import render_chat
from pitstop.entrypoints.engine_args import engine_config, setting_value
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.errors import InvalidRequestError
from pitstop.loading.tokenizer import Tokenizer
from pitstop.loop.engine import LLMEngine
from pitstop.plugin_system.plugin_manager import PluginManager, get_plugin_manager
from pitstop.verify.compare import Tolerance, default_tolerance, judge
from pitstop.verify.prompts import VerifyPrompt, shipped_prompts
from pitstop.verify.report import RunSummary, VerifyReport, describe_config

log = logging.getLogger(__name__)

# The reference configuration: these strategies, and the settings below kept from the
# configuration under test (the model and its numerics, and what sizes memory); every
# other setting takes its default.
REFERENCE_SETTINGS: dict[str, Any] = {
    "kernels": "reference",
    "allocator": "paged",
    "scheduler": "continuous",
    "speculative": None,
}
KEPT_SETTINGS = (
    "model",
    "tokenizer",
    "dtype",
    "device",
    "seed",
    "max_model_len",
    "page_size",
    "max_num_pages",
    "gpu_memory_utilization",
    "kv_cache_gib",
    "max_batch_size",
    "max_prefill_batch",
    "max_num_batched_tokens",
)


def reference_config(config: EngineConfig, kv_cache_dtype: str = "auto") -> EngineConfig:
    """The reference for ``config``: reference kernels, the paged allocator, the continuous
    scheduler, no speculation; the model, dtype, device, seed and memory settings of
    ``config`` (:data:`KEPT_SETTINGS`); defaults for the rest.

    ``kv_cache_dtype``: the reference's KV cache, by default the model's dtype (so an
    fp8 cache under test is measured against the unquantized one); ``"same"`` keeps
    ``config``'s (to check a kernel set on the same cache format).
    """
    kept = {
        name: setting_value(config, name) if name == "max_prefill_batch" else getattr(config, name)
        for name in KEPT_SETTINGS
    }
    kept["kv_cache_dtype"] = config.kv_cache_dtype if kv_cache_dtype == "same" else kv_cache_dtype
    return engine_config(**kept, **REFERENCE_SETTINGS, poison_memory=True)


def verify(
    config: EngineConfig,
    prompts: Sequence[VerifyPrompt] | None = None,
    *,
    plugins: PluginManager | None = None,
    tolerance: Tolerance | None = None,
    max_tokens: int | None = None,
    reference_kv_cache_dtype: str = "auto",
) -> VerifyReport:
    """Run ``prompts`` (default: the shipped set) through ``config`` and through its
    reference configuration, and compare them prompt by prompt.

    ``tolerance`` defaults to the dtype's; ``max_tokens`` replaces every prompt's own;
    ``reference_kv_cache_dtype`` is the reference's KV cache (:func:`reference_config`).
    Bad names or settings raise before any weight loads.
    """
    prompts = list(prompts) if prompts is not None else shipped_prompts()
    if not prompts:
        raise InvalidRequestError("no prompts to verify; give at least one")
    limits = [max_tokens or p.max_tokens for p in prompts]
    # Both engines run with poisoned memory (pitstop.ground.poison): the reference, then the
    # candidate, each built fresh, and neither can pass on values the other left in memory.
    config = attrs.evolve(config, poison_memory=True)
    ref_config = reference_config(config, reference_kv_cache_dtype)

    (plugins or get_plugin_manager()).check_config(config)  # before any weight loads
    # rows[i][o] = (output tokens before o, the reference's logits predicting output token o)
    rows: list[dict[int, tuple[list[int], torch.Tensor]]] = [{} for _ in prompts]

    def keep(index: int, before: list[int], row: torch.Tensor) -> None:
        rows[index][len(before)] = (before, row.detach().to("cpu", torch.float32, copy=True))

    log.info(
        "verify: generating with the reference configuration (%s)", describe_config(ref_config)
    )
    ref, prompt_ids, tokenizer = _run(ref_config, plugins, prompts, None, limits, keep)
    ref_logits = [_leading_rows(rows[i], out) for i, out in enumerate(ref.token_ids)]
    # diffs[i][o] = max |candidate - reference| over the row predicting output token o
    diffs: list[dict[int, float]] = [{} for _ in prompts]

    def compare(index: int, before: list[int], row: torch.Tensor) -> None:
        o = len(before)
        reference = ref_logits[index]
        if o < len(reference) and before == ref.token_ids[index][:o]:
            diff = (row.detach().to("cpu", torch.float32) - reference[o]).abs().max().item()
            diffs[index][o] = diff if math.isfinite(diff) else math.nan

    log.info("verify: generating with the configuration under test (%s)", describe_config(config))
    cand, _, _ = _run(config, plugins, prompts, prompt_ids, limits, compare)

    tolerance = tolerance or default_tolerance(ref.summary.dtype)
    results = [
        judge(
            prompts[i],
            len(prompt_ids[i]),
            limits[i],
            (ref.token_ids[i], cand.token_ids[i]),
            (ref.texts[i], cand.texts[i]),
            ref_logits[i],
            diffs[i],
            tolerance,
            tokenizer.decode if tokenizer is not None else str,
        )
        for i in range(len(prompts))
    ]
    return VerifyReport(
        model=config.model,
        dtype=ref.summary.dtype,
        device=ref.summary.device,
        tolerance=tolerance,
        reference=ref.summary,
        candidate=cand.summary,
        results=results,
    )


RowCallback = Callable[[int, list[int], torch.Tensor], None]


class _LogitsTap:
    """Hands every logit row an engine's target model computes to a callback.

    The runner computes logits once per step, for the rows it samples:
    ``num_logits`` rows at the end of each sampling sequence's tokens, in input
    order (one per sequence for a decode or prefill, k + 1 when verifying k
    drafts). The tap is the engine's logits observer
    (:meth:`~pitstop.loop.engine.LLMEngine.observe_logits`) and calls
    ``on_row(prompt_index, output_tokens_before_the_row, logits_row)``.
    """

    def __init__(self, engine: LLMEngine, on_row: RowCallback) -> None:
        self.engine, self.on_row = engine, on_row
        # Rows seen at launch, handed on by flush(): under the overlapped loop a row's
        # context ends in a token the host learns of only when the step after it is launched.
        self._rows: list[tuple[int, Any, Any, int, torch.Tensor]] = []
        engine.observe_logits(self._see)

    def _see(self, inputs: Any, sequences: list[Any], logits: torch.Tensor) -> None:
        row = 0
        for inp, seq in zip(inputs, sequences, strict=True):
            if not inp.sample:
                continue
            if seq is not None and seq.request_id.startswith(_REQUEST_PREFIX):
                index = int(seq.request_id.removeprefix(_REQUEST_PREFIX))
                for j in range(inp.num_logits):
                    self._rows.append(
                        (index, seq, inp, j, logits[row + j].to(torch.float32, copy=True))
                    )
            row += inp.num_logits

    def flush(self) -> None:
        """Hand every row seen so far to the callback, now that its context tokens are known."""
        rows, self._rows = self._rows, []
        for index, seq, inp, j, logits in rows:
            # the step computed seq.token_ids[start_pos : start_pos + len] (drafts after the end)
            context = seq.token_ids[: inp.start_pos] + [
                seq.token_ids[p] if p < seq.num_tokens else t
                for p, t in enumerate(inp.token_ids, start=inp.start_pos)
            ]
            first = len(context) - inp.num_logits
            # row j predicts the token after context[: first + j + 1]
            before = context[seq.num_prompt_tokens : first + j + 1]
            if seq.is_finished and len(before) >= len(seq.output_token_ids):
                continue  # a step launched after the sequence finished: its token was discarded
            self.on_row(index, before, logits)


_REQUEST_PREFIX = "verify-"


@attrs.frozen
class _Generated:
    token_ids: list[list[int]]
    texts: list[str]
    summary: RunSummary


def _generate(
    engine: LLMEngine,
    prompt_ids: Sequence[list[int]],
    max_tokens: Sequence[int],
    tap: _LogitsTap | None = None,
) -> _Generated:
    """Greedy generation, one new prompt per step (as requests arrive at a server)."""
    start = time.perf_counter()
    pending = list(enumerate(prompt_ids))
    finished: dict[str, Any] = {}
    while pending or engine.has_unfinished_requests():
        if pending:
            i, ids = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i])
            engine.add_request(
                params=params, prompt_token_ids=ids, request_id=f"{_REQUEST_PREFIX}{i}"
            )
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if tap is not None:
            tap.flush()
    if tap is not None:
        tap.flush()
    outs = [finished[f"{_REQUEST_PREFIX}{i}"] for i in range(len(prompt_ids))]
    stats, alloc = engine.stats, engine.allocator.stats()
    describe = getattr(engine.runner.kernels, "describe", None)
    summary = RunSummary(
        config=engine.config,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device),
        kernels=dict(describe()) if describe is not None else {},
        steps=stats.steps,
        seconds=time.perf_counter() - start,
        preemptions=stats.preemptions,
        prefix_hit_tokens=alloc.prefix_hit_tokens,
        spec_proposed_tokens=stats.spec_proposed_tokens,
        spec_accepted_tokens=stats.spec_accepted_tokens,
    )
    return _Generated([o.token_ids for o in outs], [o.text for o in outs], summary)


def _run(
    config: EngineConfig,
    plugins: PluginManager | None,
    prompts: Sequence[VerifyPrompt],
    prompt_ids: list[list[int]] | None,
    max_tokens: Sequence[int],
    on_row: RowCallback,
) -> tuple[_Generated, list[list[int]], Tokenizer | None]:
    """Build an engine for ``config``, generate (tokenizing the prompts unless given), and
    free the engine before returning: the next one may need all of the GPU's memory."""
    engine = LLMEngine(config, plugins)
    device = engine.device
    try:
        ids = prompt_ids if prompt_ids is not None else _tokenize(engine, prompts)
        tap = _LogitsTap(engine, on_row)
        return _generate(engine, ids, max_tokens, tap), ids, engine.tokenizer
    finally:
        engine.close()  # tensor parallelism: the workers stop before the next engine starts
        del engine  # the tap's closures make a cycle: collect it now
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _tokenize(engine: LLMEngine, prompts: Sequence[VerifyPrompt]) -> list[list[int]]:
    tok = engine.tokenizer
    if tok is None:
        raise InvalidRequestError(
            f"model {engine.config.model!r} has no tokenizer, so the prompts cannot be encoded; "
            "pass one with --tokenizer"
        )
    max_len = engine.config.max_model_len
    assert max_len is not None
    ids_list = []
    for p in prompts:
        if p.messages is not None:
            ids = render_chat(tok, [dict(m) for m in p.messages]).token_ids
        else:
            assert p.prompt is not None
            ids = tok.encode(p.prompt)
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"prompt {p.label!r} ({p.source}) has {len(ids)} tokens, max_model_len is "
                f"{max_len}; shorten it or raise --max-model-len"
            )
        ids_list.append(ids)
    return ids_list


def _leading_rows(
    rows: dict[int, tuple[list[int], torch.Tensor]], output: list[int]
) -> list[torch.Tensor]:
    """The reference's logit rows for output tokens 0, 1, ... while each row's context is the output."""
    kept = []
    for o in range(len(output)):
        if o not in rows or rows[o][0] != output[:o]:
            break
        kept.append(rows[o][1])
    return kept
