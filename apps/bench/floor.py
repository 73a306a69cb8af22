"""Device ceilings and the physical floor of a workload (docs/workloads.md's method).

A lower bound on a workload's wall time: the FLOPs of every prefill
(2 x non-embedding parameters x prompt tokens, plus causal attention) over the
matrix rate, plus, for decode, the bytes that must cross HBM (all weights once
per decode step; every cached K and V read once per generated token) over the
copy bandwidth. The weights' bytes are those the chosen weight format holds
(``weights=``: ``fp8`` about half of bf16's), read from the loaded engine
(:meth:`Floor.with_weight_bytes`); before one is loaded, ``num_params`` x 2.

How many decode steps there are depends on how many sequences can decode
together: at least the longest request's decode length, and at least the
decode tokens divided by the number of sequences in flight (``concurrency``
clients, or every request when all are submitted at once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from pitstop.loading.model_config import ModelConfig


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
    """A workload's floor and its parts, in seconds."""

    prefill_s: float
    weights_s: float
    kv_s: float
    decode_steps: int
    output_tokens: int
    num_requests: int
    weight_bytes: int = 0  # bytes of weights one decode step reads (weights_s counts them)

    def with_weight_bytes(self, weight_bytes: int) -> Floor:
        """The same floor with decode reading ``weight_bytes`` of weights a step (those of
        the weight format an engine holds: ``ModelRunner.weight_bytes()``)."""
        if not self.weight_bytes or weight_bytes <= 0:
            return self
        weights_s = self.weights_s * weight_bytes / self.weight_bytes
        return attrs.evolve(self, weights_s=weights_s, weight_bytes=weight_bytes)

    @property
    def seconds(self) -> float:
        """The floor on wall time."""
        return self.prefill_s + self.weights_s + self.kv_s

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
        return {
            "seconds": self.seconds,
            "prefill_s": self.prefill_s,
            "weights_s": self.weights_s,
            "kv_s": self.kv_s,
            "decode_steps": self.decode_steps,
            "weight_bytes": self.weight_bytes,
            "output_tok_per_s": self.output_tok_per_s,
            "req_per_s": self.req_per_s,
            "ms_per_output_token": 1e3 * self.s_per_output_token,
        }


def non_embedding_params(mc: ModelConfig) -> int:
    """Parameters that every prompt token multiplies through (no embedding, no output head)."""
    emb = mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
    return mc.num_params - emb


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
    ``weight_bytes_total`` is what one decode step reads of the weights (default:
    ``num_params * weight_bytes``, dense weights of ``weight_bytes`` bytes each).
    """
    if not lengths:
        raise ValueError("a floor needs at least one request")
    dense = non_embedding_params(mc)
    attn_width = mc.num_layers * mc.num_heads * mc.head_size
    prefix_len, prefix_count = shared_prefix

    def prefill_flops(n: int, start: int = 0) -> float:
        # Q.K^T and P.V: 2 FLOPs a multiply-add, 2 products, over the causal pairs.
        pairs = (start + n) * (start + n + 1) / 2 - start * (start + 1) / 2
        return 2 * dense * n + 4 * attn_width * pairs

    flops = prefix_count * prefill_flops(prefix_len)
    kv_reads = 0  # cached tokens read, summed over generated tokens
    decode_tokens = 0
    for p, o in lengths:
        flops += prefill_flops(p - prefix_len, prefix_len)
        d = o - 1  # the first output token comes from the prefill
        decode_tokens += d
        kv_reads += d * p + d * (d + 1) // 2
    in_flight = min(concurrency or len(lengths), len(lengths))
    steps = max(max(o - 1 for _, o in lengths), math.ceil(decode_tokens / in_flight))
    read = weight_bytes_total if weight_bytes_total is not None else mc.num_params * weight_bytes
    return Floor(
        prefill_s=flops / ceilings.matmul_flops_per_s,
        weights_s=steps * read / ceilings.copy_bytes_per_s,
        kv_s=kv_reads * mc.kv_bytes_per_token * kv_bytes / ceilings.copy_bytes_per_s,
        decode_steps=steps,
        output_tokens=sum(o for _, o in lengths),
        num_requests=len(lengths),
        weight_bytes=read,
    )


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
