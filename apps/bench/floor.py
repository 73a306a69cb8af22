"""Device ceilings and the physical floor of a workload (docs/workloads.md's method).

A lower bound on a workload's wall time, step by step. Every step, prefill and
decode alike, takes at least the larger of its bytes over the copy bandwidth
and its FLOPs over the matrix rate::

    step_s = max(bytes / copy_bytes_per_s, flops / matmul_flops_per_s)
    floor  = prefill_s + sum(step_s for every decode step)

**Decode steps.** A step at batch ``b`` whose sequences hold ``ctx`` cached
tokens between them (each sequence's prompt, the tokens it generated so far
and the one it is generating) moves

- bytes: all weights once (``weight_bytes``: those of the chosen weight format,
  ``num_params x 2`` for bf16) + ``ctx x kv_bytes_per_token`` (every cached K
  and V read once);
- FLOPs: ``2 x matmul_params x b`` (every weight multiplied once per sequence;
  ``matmul_params`` are the non-embedding parameters plus the output head,
  ``vocab x hidden``) + ``4 x layers x heads x head_size x ctx`` (q·K^T and
  P·V over the context, 2 FLOPs a multiply-add).

Which sequences decode in which step follows the run's clients: with every
request in flight at once (offline, or ``concurrency`` >= requests) each
request decodes from the first step to its last token, so step ``s`` holds
exactly the requests with more than ``s`` decode tokens; with ``concurrency``
closed-loop clients the requests start in order, each as soon as one in
flight has finished (the client sends its next one; prefill taken as
instant), which is the fewest decode steps that arrival order allows. A
request's first output token comes from its prefill, so it decodes
``output_len - 1`` steps.

**Prefill**, as one phase before decode (the fastest engine prefills every
prompt in one pass and reads the weights once for all of them):

- FLOPs: ``2 x non-embedding params x prompt tokens`` + causal attention
  (``4 x layers x heads x head_size`` per (query, key) pair at or before the
  query) + the output head on each prompt's last token (``2 x vocab x hidden``);
  a shared prefix (``shared_prefix``) is prefilled once per distinct prefix;
- bytes: all weights once + the K and V of every prefilled token written once.

**Mixtures of experts** (a model config with ``num_experts``): a token multiplies
through the dense parameters and ``num_experts_per_tok`` experts of each sparse layer,
so the FLOPs count those (the *active* parameters); a decode step of ``b`` tokens reads
the dense weights and, in each sparse layer, the experts its tokens choose:
``E x (1 - (1 - k/E)^b)`` of the ``E`` experts, as many as uniform routing touches on
average (``expert_share`` of the weights are the routed experts'). Prefill reads every
expert once.

The matrix rate is the bf16 one for every weight format (an fp8 format's
FLOPs are not credited a faster rate; at the batch sizes where fp8 weights
pay, decode is bound by bytes).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import attrs

from pitstop.ground.model_config import ModelConfig


@attrs.frozen
class Ceilings:
    """What a device can do at best: copy bandwidth (bytes read + written per s) and matrix rate."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float
    source: str = "given"

    def as_dict(self) -> dict[str, Any]:
        return {
            "copy_TB_per_s": self.copy_bytes_per_s / 1e12,
            "matmul_TFLOP_per_s": self.matmul_flops_per_s / 1e12,
            "source": self.source,
        }


# NVIDIA H200, measured 2026-11-29 (docs/workloads.md).
H200 = Ceilings(4.23e12, 792e12, source="H200 (docs/workloads.md, measured 2026-11-29)")


@attrs.frozen
class Floor:
    """A workload's floor and its parts: the quantities each step moves, and their times (s).

    ``step_batch[s]`` and ``step_context[s]`` are the sequences decoding in decode
    step ``s`` and the cached tokens they read between them; the times are
    derived from them, the model's shape and ``ceilings`` (the module's formula).
    """

    ceilings: Ceilings
    prefill_flops: float
    prefill_kv_bytes: float  # K and V of every prefilled token, written once
    step_batch: tuple[int, ...] = attrs.field(repr=False)
    step_context: tuple[int, ...] = attrs.field(repr=False)
    matmul_params: int  # weights a decoded token multiplies through (output head included)
    attn_width: int  # layers x query heads x head size
    kv_token_bytes: int  # bytes of K and V of one token over all layers
    output_tokens: int
    num_requests: int
    weight_bytes: int = 0  # bytes of weights one step reads (every expert, for an MoE model)
    expert_share: float = 0.0  # the part of weight_bytes that is routed experts' (MoE)
    num_experts: int = 0  # routed experts per sparse layer (MoE; 0: a dense model)
    experts_per_token: int = 0

    def step_weight_bytes(self, batch: int) -> float:
        """The weights a decode step of ``batch`` tokens reads: all of a dense model's; of an
        MoE model the dense part and the experts uniform routing touches on average."""
        if not self.num_experts:
            return float(self.weight_bytes)
        e, k = self.num_experts, self.experts_per_token
        touched = 1.0 - (1.0 - k / e) ** batch  # the fraction of experts at least one chose
        return self.weight_bytes * (1.0 - self.expert_share * (1.0 - touched))

    def with_weight_bytes(self, weight_bytes: int) -> Floor:
        """The same floor with every step reading ``weight_bytes`` of weights (those of
        the weight format an engine holds: ``ModelRunner.weight_bytes()``)."""
        if not self.weight_bytes or weight_bytes <= 0:
            return self
        return attrs.evolve(self, weight_bytes=weight_bytes)

    # ------------------------------------------------------------ per step
    def _bytes_s(self, nbytes: float) -> float:
        return nbytes / self.ceilings.copy_bytes_per_s

    def _flops_s(self, flops: float) -> float:
        return flops / self.ceilings.matmul_flops_per_s

    def step_bytes_s(self) -> list[float]:
        """Each decode step's bytes over the copy bandwidth."""
        return [
            self._bytes_s(self.step_weight_bytes(b) + ctx * self.kv_token_bytes)
            for b, ctx in zip(self.step_batch, self.step_context, strict=True)
        ]

    def step_flops_s(self) -> list[float]:
        """Each decode step's FLOPs over the matrix rate."""
        return [
            self._flops_s(2 * self.matmul_params * b + 4 * self.attn_width * ctx)
            for b, ctx in zip(self.step_batch, self.step_context, strict=True)
        ]

    # ------------------------------------------------------------ totals
    @property
    def decode_steps(self) -> int:
        return len(self.step_batch)

    @property
    def prefill_flops_s(self) -> float:
        return self._flops_s(self.prefill_flops)

    @property
    def prefill_bytes_s(self) -> float:
        return self._bytes_s(self.weight_bytes + self.prefill_kv_bytes)

    @property
    def prefill_s(self) -> float:
        """The prefill phase: the larger of its FLOPs and its bytes."""
        return max(self.prefill_flops_s, self.prefill_bytes_s)

    @property
    def weights_s(self) -> float:
        """Weight reads of every decode step over the copy bandwidth (part of the bytes)."""
        return self._bytes_s(sum(self.step_weight_bytes(b) for b in self.step_batch))

    @property
    def kv_s(self) -> float:
        """K/V reads of every decode step over the copy bandwidth (part of the bytes)."""
        return self._bytes_s(sum(self.step_context) * self.kv_token_bytes)

    @property
    def decode_flops_s(self) -> float:
        """Every decode step's FLOPs over the matrix rate, summed."""
        return sum(self.step_flops_s())

    @property
    def decode_s(self) -> float:
        """Decode: each step the larger of its bytes and its FLOPs, summed."""
        return sum(map(max, self.step_bytes_s(), self.step_flops_s()))

    @property
    def flops_bound_steps(self) -> int:
        """Decode steps whose FLOPs take longer than their bytes."""
        return sum(f > b for b, f in zip(self.step_bytes_s(), self.step_flops_s(), strict=True))

    @property
    def seconds(self) -> float:
        """The floor on wall time."""
        return self.prefill_s + self.decode_s

    @property
    def output_tok_per_s(self) -> float:
        """The best possible output tokens per second."""
        return self.output_tokens / self.seconds

    @property
    def req_per_s(self) -> float:
        """The best possible requests per second."""
        return self.num_requests / self.seconds

    @property
    def s_per_output_token(self) -> float:
        return self.seconds / self.output_tokens

    def as_dict(self) -> dict[str, Any]:
        """The floor and its parts as a run's JSON records them.

        ``seconds = prefill_s + decode_s``; ``weights_s + kv_s`` is decode's bytes
        alone and ``decode_flops_s`` its FLOPs alone (each step counts the larger).
        """
        return {
            "seconds": self.seconds,
            "prefill_s": self.prefill_s,
            "prefill_flops_s": self.prefill_flops_s,
            "prefill_bytes_s": self.prefill_bytes_s,
            "decode_s": self.decode_s,
            "weights_s": self.weights_s,
            "kv_s": self.kv_s,
            "decode_flops_s": self.decode_flops_s,
            "decode_steps": self.decode_steps,
            "flops_bound_steps": self.flops_bound_steps,
            "weight_bytes": self.weight_bytes,
            "output_tok_per_s": self.output_tok_per_s,
            "req_per_s": self.req_per_s,
            "ms_per_output_token": 1e3 * self.s_per_output_token,
        }


def non_embedding_params(mc: ModelConfig) -> int:
    """Parameters that every prompt token multiplies through (no embedding, no output head)."""
    emb = mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
    return mc.num_params - emb


def decode_schedule(decode_lens: Sequence[int], in_flight: int) -> list[int]:
    """The decode step at which each request starts (0-based), with at most ``in_flight``
    decoding at once, in order, each as soon as a slot frees (a slot holding a request
    of ``d`` decode steps from step ``t`` is free again at step ``t + d``)."""
    if in_flight >= len(decode_lens):
        return [0] * len(decode_lens)
    free = [0] * in_flight
    starts = []
    for d in decode_lens:
        t = heapq.heappop(free)
        starts.append(t)
        heapq.heappush(free, t + d)
    return starts


def _steps(
    prompts: Sequence[int], decode_lens: Sequence[int], starts: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per decode step: the sequences decoding, and the tokens of context they read.

    A request of prompt ``p`` starting at step ``t`` reads ``p + (s - t) + 1`` tokens
    at step ``s`` (its prompt, its earlier tokens and the one it generates), so a
    step's context is ``sum(p - t + 1) + batch x s`` over the requests in it.
    """
    n_steps = max((t + d for t, d in zip(starts, decode_lens, strict=True)), default=0)
    count = [0] * (n_steps + 1)
    base = [0] * (n_steps + 1)
    for p, d, t in zip(prompts, decode_lens, starts, strict=True):
        if d <= 0:
            continue
        count[t] += 1
        count[t + d] -= 1
        base[t] += p - t + 1
        base[t + d] -= p - t + 1
    batch, context = [], []
    b = c = 0
    for s in range(n_steps):
        b += count[s]
        c += base[s]
        batch.append(b)
        context.append(c + b * s)
    return tuple(batch), tuple(context)


def floor(
    mc: ModelConfig,
    lengths: Sequence[tuple[int, int]],
    *,
    concurrency: int | None = None,
    shared_prefix: tuple[int, int] = (0, 0),
    ceilings: Ceilings = H200,
    weight_bytes: int = 2,
    kv_bytes: int = 2,
    weight_bytes_total: int | None = None,
) -> Floor:
    """The floor of requests of ``(input_len, output_len)`` on a model of shape ``mc``.

    ``concurrency`` is how many sequences decode together (None: all of them).
    ``shared_prefix = (length, count)`` says every prompt begins with one of
    ``count`` prefixes of ``length`` tokens: the fastest engine prefills each once.
    ``weight_bytes_total`` is what one step reads of the weights (default:
    ``num_params * weight_bytes``, dense weights of ``weight_bytes`` bytes each);
    ``kv_bytes`` the bytes of one cached K or V element.
    """
    if not lengths:
        raise ValueError("a floor needs at least one request")
    dense = non_embedding_params(mc)  # what a token multiplies through (MoE: active ones)
    experts = moe_shape(mc)
    if experts is not None:
        dense -= mc.num_params - mc.active_params  # type: ignore[attr-defined]
    head = mc.vocab_size * mc.hidden_size
    attn_width = mc.num_layers * mc.num_heads * mc.head_size
    prefix_len, prefix_count = shared_prefix

    def prefill_flops(n: int, start: int = 0) -> float:
        # Q.K^T and P.V: 2 FLOPs a multiply-add, 2 products, over the causal pairs.
        pairs = (start + n) * (start + n + 1) / 2 - start * (start + 1) / 2
        return 2 * dense * n + 4 * attn_width * pairs

    flops = prefix_count * prefill_flops(prefix_len)
    prefilled = prefix_count * prefix_len
    for p, _ in lengths:
        flops += prefill_flops(p - prefix_len, prefix_len) + 2 * head
        prefilled += p - prefix_len
    prompts = [p for p, _ in lengths]
    decode_lens = [max(o - 1, 0) for _, o in lengths]  # the first token comes from prefill
    in_flight = min(concurrency or len(lengths), len(lengths))
    batch, context = _steps(prompts, decode_lens, decode_schedule(decode_lens, in_flight))
    kv_token_bytes = mc.kv_bytes_per_token * kv_bytes
    read = weight_bytes_total if weight_bytes_total is not None else mc.num_params * weight_bytes
    return Floor(
        ceilings=ceilings,
        prefill_flops=flops,
        prefill_kv_bytes=prefilled * kv_token_bytes,
        step_batch=batch,
        step_context=context,
        matmul_params=dense + head,
        attn_width=attn_width,
        kv_token_bytes=kv_token_bytes,
        output_tokens=sum(o for _, o in lengths),
        num_requests=len(lengths),
        weight_bytes=read,
        **(experts or {}),
    )


def moe_shape(mc: ModelConfig) -> dict[str, Any] | None:
    """A mixture-of-experts config's routed experts for :class:`Floor` (None: a dense model):
    how many a sparse layer has, how many a token chooses, their share of the weights."""
    e = getattr(mc, "num_experts", None)
    if not e:
        return None
    k = mc.num_experts_per_tok  # type: ignore[attr-defined]
    per_expert = 3 * mc.hidden_size * mc.moe_intermediate_size  # type: ignore[attr-defined]
    routed = len(mc.sparse_layers) * e * per_expert  # type: ignore[attr-defined]
    return {"num_experts": e, "experts_per_token": k, "expert_share": routed / mc.num_params}


def measure_ceilings(
    device: Any = None, *, size_mib: int = 1024, n: int = 8192, repeats: int = 10
) -> Ceilings:
    """Measure device-to-device copy bandwidth and the bf16 matrix rate on a CUDA device."""
    import torch

    device = torch.device(device or "cuda")
    if device.type != "cuda":
        raise ValueError(f"ceilings are measured on a CUDA device, not {device}")

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        best = math.inf
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    src = torch.empty(size_mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    mm_s = timed(lambda: torch.mm(a, b))
    name = torch.cuda.get_device_name(device)
    torch.cuda.empty_cache()
    return Ceilings(2 * size_mib * 2**20 / copy_s, 2 * n**3 / mm_s, source=f"measured on {name}")


def ceilings_for(device: Any, measure: bool = False) -> Ceilings:
    """The ceilings a run's floor uses on CUDA ``device``: the H200's documented ones on an
    H200 (so its runs compare across days), measured here on any other GPU (the H200's would
    put another card's fraction of floor on a scale it cannot reach), or measured anyway
    with ``measure`` (``--measure-ceilings``)."""
    import torch

    if measure or "H200" not in torch.cuda.get_device_name(device):
        return measure_ceilings(device)
    return H200


def read_result(path: str) -> dict[str, Any]:
    """A ``pitstop bench`` result file, ``.json`` or ``.json.gz``."""
    import gzip
    import json

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def floor_of_result(doc: dict[str, Any], *, ceilings: Ceilings | None = None) -> Floor:
    """The floor of a stored ``pitstop bench`` result, recomputed with this module's formula
    from the requests it ran (their prompt and output lengths), its model's shape and its
    clients; ``ceilings`` default to the ones the run used."""
    shape = dict(doc["model"]["shape"])
    cls = config_class(shape.get("architecture", ""))  # an MoE model's config keeps its experts
    fields = attrs.fields_dict(cls)
    mc = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in shape.items() if k in fields})
    column = next(c for c in doc["configs"] if c.get("requests"))
    lengths = [(r["input_len"], r["output_len"]) for r in column["requests"]]
    wl = doc["workload"]
    prefix_len = wl.get("shared_prefix_len") or 0
    given = doc.get("ceilings") or {}
    if ceilings is None and given:
        ceilings = Ceilings(
            given["copy_TB_per_s"] * 1e12, given["matmul_TFLOP_per_s"] * 1e12, given["source"]
        )
    return floor(
        mc,
        lengths,
        concurrency=wl.get("concurrency"),
        shared_prefix=(prefix_len, 4 if prefix_len else 0),
        ceilings=ceilings or H200,
    )


def config_class(architecture: str) -> type[ModelConfig]:
    """The model config class the installed model plugins use for ``architecture`` (their
    ``dummy:`` presets'; :class:`ModelConfig` when none has a preset of it)."""
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    presets = get_plugin_manager().presets().values()
    return next((type(p) for p in presets if p.architecture == architecture), ModelConfig)


def restate(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each column of a stored result as a fraction of its recorded floor and of the floor
    this module computes now (the weight bytes each column's engine held, where recorded)."""
    base = floor_of_result(doc)
    rows = []
    columns = [*doc["configs"], *([doc["peer"]] if doc.get("peer") else [])]
    for col in columns:
        fig = col.get("figures") or {}
        wall = fig.get("wall_s")
        if not wall:
            continue
        held = (col.get("floor") or doc.get("floor") or {}).get("weight_bytes") or 0
        now = base.with_weight_bytes(held)
        rows.append(
            {
                "column": col["name"],
                "output_tok_per_s": fig.get("output_tok_per_s"),
                "floor_s_recorded": fig.get("floor_s"),
                "fraction_recorded": fig.get("floor_fraction"),
                "floor_s_now": now.seconds,
                "fraction_now": now.seconds / wall,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m pitstop.bench.floor RESULT.json[.gz] ...``: each column's fraction of
    floor as recorded and as this module's formula restates it."""
    import sys

    for path in argv if argv is not None else sys.argv[1:]:
        doc = read_result(path)
        print(f"{path}: {doc['workload'].get('name')} on {doc['model']['name']}")
        for r in restate(doc):
            rec = r["fraction_recorded"]
            print(
                f"  {r['column']}: {r['output_tok_per_s']:,.1f} tok/s, "
                f"{'n/a' if rec is None else f'{rec:.1%}'} of the recorded floor "
                f"({r['floor_s_recorded'] or float('nan'):.4f} s) -> {r['fraction_now']:.1%} "
                f"of the floor now ({r['floor_s_now']:.4f} s)"
            )


if __name__ == "__main__":
    main()
