"""Piecewise CUDA graphs for steps that prefill: everything between two attentions captured.

Attention over a mix of prompts and decodes needs host-side lengths, so it
runs eagerly between the captured segments (:class:`PiecewiseGraphs`).
"""

from __future__ import annotations

import torch

from pitstop.ground.attention import AttentionMetadata
from pitstop.ground.poison import poison_
from pitstop.plugin_system.kinds import lacks
from pitstop.plugin_system.split_forward import SplitAttention, SplitForwardModel, SplitLayer
from pitstop.runner.graphs import ForwardParts, capture_graph


def mixed_step_tokens(step_token_budget: int, limit: int) -> int:
    """The largest prefill/mixed step to capture piecewise: the step budget, at most ``limit``
    (the ``piecewise_max_tokens`` setting).

    Longer steps launch eagerly: where their GEMMs take tens of milliseconds the host's
    launches hide behind them, but not on a small model (``qwen3-0.6b``'s 8,192-token prompt
    steps on an H100, 2026-12-07: 16.4 ms of kernels, 22.6 ms of wall, the host launching).
    """
    return max(16, min(step_token_budget, limit))


def supports_piecewise(model: torch.nn.Module) -> bool:
    """Whether a model has the split forward :class:`PiecewiseGraphs` drives
    (:class:`~pitstop.plugin_system.split_forward.SplitForwardModel`: the Llama family has it)."""
    # kinds.lacks, not isinstance(): see there (an nn.Module's submodules)
    layers = getattr(model, "layers", None) or ()
    return (
        not lacks(SplitForwardModel, model)
        and len(layers) > 0
        and all(not lacks(SplitLayer, x) and not lacks(SplitAttention, x.self_attn) for x in layers)
    )


# Above this many tokens a step's GEMMs set its time, so the buckets close in: a step replays
# the smallest bucket at least its size, and the rows past it are computed for nothing
FINE_BUCKETS_FROM = 2048


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture for prefill and mixed steps: 16, 32, 64, 128, then x1.5 / x2
    steps up to :data:`FINE_BUCKETS_FROM`; past it every eighth of the power of two below
    (2,048 to 4,096 by 256, then by 512), so that no step computes more than 12.5% of padding
    rows where its GEMMs are bound by FLOPs (x1.5 / x2 there: up to 50%)."""
    sizes: list[int] = []
    size = 16
    while size < min(max_tokens, FINE_BUCKETS_FROM):
        sizes.append(size)
        half = size + size // 2
        if size >= 128 and half < max_tokens:
            sizes.append(half)
        size *= 2
    while size < max_tokens:
        sizes.append(size)
        size += 1 << (size.bit_length() - 4)  # an eighth of the power of two at or below it
    sizes.append(max_tokens)
    return sorted(set(sizes))


class PiecewiseGraphs:
    """CUDA graphs for steps that prefill (chunks, prompts, mixed with decodes): all but attention.

    Attention over a mix of prompts and decodes needs host-side lengths, so
    it runs eagerly; everything between two attentions is one captured graph
    per token-count bucket: segment 0 is the embedding and layer 0 up to its
    attention (norm, projections, rotary, K/V store), segment i the rest of
    layer i-1 and layer i up to attention, the last segment the rest of the
    last layer and the final norm. A step of ``T`` tokens replays the graphs
    of the smallest bucket ``>= T`` and runs the model's attention between
    them on the real ``T`` rows; padding rows store no K/V (slot -1) and are
    row-independent everywhere else, so they never touch a real row. This
    turns a few hundred kernel launches per step into one replay per layer
    plus the attention call, so the host keeps ahead of the GPU.
    """

    def __init__(self, parts: ForwardParts, max_tokens: int, *, capture: bool = True) -> None:
        self.parts = parts
        self.captured = capture
        model = parts.model
        cfg = parts.model_config
        dev, dtype = parts.device, parts.dtype
        self.sizes = mixed_graph_sizes(max_tokens)
        t = self.max_tokens = self.sizes[-1]
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.q = torch.zeros(t, cfg.num_heads, cfg.head_size, dtype=dtype, device=dev)
        self.o = torch.zeros(t, cfg.num_heads, cfg.head_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev)
        self._no_tables = torch.zeros(0, 1, dtype=torch.int32, device=dev)
        self.num_layers = len(model.layers)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if not capture:  # the segments run eagerly (CPU tests of the split forward)
            return
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                graphs = []
                for segment in range(self.num_layers + 1):
                    graph, _, pool = capture_graph(
                        lambda segment=segment, size=size: self._segment(segment, size), pool, dev
                    )
                    graphs.append(graph)
                self.graphs[size] = graphs
        torch.cuda.synchronize(dev)

    def poison(self) -> None:
        """Poison the static inputs and activations (``poison_memory``, after capture)."""
        for buffer in (
            self.input_ids, self.positions, self.slots, self.q, self.o, self.residual, self.hidden,
        ):  # fmt: skip
            poison_(buffer)

    def _static_meta(self, size: int) -> AttentionMetadata:
        """What the captured segments read: positions and slots (rotary, K/V store)."""
        return AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slots[:size],
            block_tables=self._no_tables,
            context_lens=self.slots[:0],
            cu_query_lens=self.slots[:0],
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=0,
            max_query_len=0,
            max_context_len=0,
            page_size=self.parts.page_size,
        )

    def _segment(self, segment: int, size: int) -> None:
        """Run segment ``segment`` for ``size`` rows, reading and writing the static buffers."""
        parts = self.parts
        model, kv = parts.model, parts.kv_cache
        meta = self._static_meta(size)
        if segment == 0:
            ids = self.input_ids[:size]
            x = model.embed(ids)
            residual = None
        else:
            x, residual = model.layers[segment - 1].after_attention(
                self.o[:size], self.residual[:size]
            )
        if segment == self.num_layers:
            self.hidden[:size].copy_(model.final_norm(x, residual))
            return
        q, residual = model.layers[segment].before_attention(
            x, residual, parts.rotary, kv[segment, 0], kv[segment, 1], meta
        )
        self.q[:size].copy_(q)
        self.residual[:size].copy_(residual)

    def can_run(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens fits a captured bucket."""
        return 0 < num_tokens <= self.max_tokens

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One step: copy ids, positions and slots in, replay, attend eagerly between; ``[T, hidden]``."""
        n = input_ids.shape[0]
        size = next(b for b in self.sizes if b >= n) if self.captured else n
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.positions[n:size].zero_()
        self.input_ids[n:size].zero_()
        model, kv = self.parts.model, self.parts.kv_cache
        graphs = self.graphs.get(size)
        for layer in range(self.num_layers + 1):
            if graphs is not None:
                graphs[layer].replay()
            else:
                self._segment(layer, size)
            if layer == self.num_layers:
                break
            o = model.layers[layer].self_attn.attend(self.q[:n], kv[layer, 0], kv[layer, 1], meta)
            self.o[:n].copy_(o)
        return self.hidden[:n]
