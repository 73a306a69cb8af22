"""LoRA adapters in ``max_loras`` device slots, applied to the model's projections per row.

Layout (:mod:`pitstop.plugins.kernels.triton_ops.lora` describes it): per layer and per
projection the model multiplies (``qkv_proj`` or ``q_proj`` ..., ``o_proj``,
``gate_up_proj`` or ``gate_proj``/``up_proj``, ``down_proj``), one stacked tensor per slice
(q|k|v, gate|up): ``A [slots, rank_max, in]`` and ``B [slots, out_i, rank_max]`` in the
model's dtype, plus ``ranks [slots]`` int32 and ``scaling [slots]`` float32. They are
allocated once, so their addresses never change (captured graphs stay valid); loading an
adapter copies it into one slot's rows (zeros for a module it does not train).

Per step, :meth:`LoRASlots.prepare` writes ``slot_of_row`` (each row's slot, -1 for a row
of the base model) into a static buffer; each wrapped projection adds
``scaling · B(A x)`` to the rows of a slot through the kernel ops (the PyTorch reference
on CPU, on CUDA the Triton ops: by default ``lora_shrink`` then ``lora_expand_add``, all
slices of a projection in each; with ``lora.kernel=fused`` one ``lora_add`` launch, the
rank-r intermediate kept in registers), after its base GEMM. With ``lora.overlap`` a
small step's shrink runs on a second stream beside the base GEMM (a fork and a join
inside the captured graph), so only the expand follows the GEMM. Rows of the base model
are left untouched. With ``lora.kernel=stacked`` (``dense`` weights; a fused layer's
cuBLAS way too, :meth:`LoRASlots._stacked`, while its Triton GEMMs add the delta inside) each
projection's base weight is a view into ``W_ext = [W | B']`` (the slots' B as extra
columns; :mod:`pitstop.plugins.kernels.triton_ops.lora_pack`), and a step of at most
:data:`WORKSPACE_ROWS` rows runs one ``lora_pack`` launch writing ``[x | h']`` before a
base GEMM that adds every row's delta; a larger step packs too where the slots' columns are
few beside K, else runs the base GEMM and adds the delta by two library GEMMs
(:meth:`LoRASlots._add_large`).

Slots are given least recently used first among the adapters the step does not use; the
host cache keeps up to ``max_cpu_loras`` read adapters (LRU, re-read from their path when
needed again).

Loading never stalls the running batch: when a request's adapter is checked (at
``add_request``, before it is queued) and is in no slot, it is copied at once into an empty
slot, and (:meth:`LoRASlots.ready`, which the engine asks right after and before each step,
with the queued requests' adapters) on CUDA otherwise into the least recently used slot that
none of those adapters holds; the copy runs on a side stream that first waits for everything
queued on the step stream (so no step launched before still reads that slot). The engine
keeps the request out of the scheduler until ``ready`` finds the copy finished, so no running
batch waits for it; a request that arrives when nothing else is queued goes at once, and its
first step waits for the copy's event on the device, not the host. Where no slot can be
taken, the step that runs the adapter loads it on its own stream, as before.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from pitstop.errors import ConfigError, InvalidRequestError
from pitstop.ground.step import SeqInput
from pitstop.ground.transfer import host_tensor
from pitstop.plugin_system.adapter import AdapterContext
from pitstop.plugins.adapters.lora.peft_adapter import (
    LoRAWeights,
    expected_shapes,
    rank_part,
    read_adapter,
)
from pitstop.plugins.kernels.lora_reference import NEXT_LAYER_QKV, ProjectionLoRA

# a projection attribute of the Llama-family layers -> the PEFT modules of its slices
SLICES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q", "k", "v"),
    "q_proj": ("q",),
    "k_proj": ("k",),
    "v_proj": ("v",),
    "o_proj": ("o",),
    "gate_up_proj": ("gate", "up"),
    "gate_proj": ("gate",),
    "up_proj": ("up",),
    "down_proj": ("down",),
}


def kernel_ops(device: torch.device) -> ModuleType:
    """The LoRA ops (``lora_add``, ``lora_meta``): Triton's on CUDA, the PyTorch reference elsewhere."""
    if device.type == "cuda":
        from pitstop.plugins.kernels.triton_ops import lora

        return lora
    from pitstop.plugins.kernels import lora_reference

    return lora_reference


# Steps of at most this many rows (decode and small mixed steps, what CUDA graphs capture)
# shrink into one float32 workspace, zeroed once a step for every projection of every layer,
# instead of zeroing each projection's intermediate: a launch fewer per projection
WORKSPACE_ROWS = 512


def packs_large_steps(n: int, k: int) -> bool:
    """``lora.large_steps=auto``: whether a stacked projection ``[n, k]`` packs steps over
    :data:`WORKSPACE_ROWS` rows (prefill chunks) into its base GEMM, rather than adding the
    delta by library GEMMs after it (:meth:`LoRASlots._add_large`).

    Over a chunk both ways compute about the same extra products; what differs is the extra
    pass over memory: the pack writes x again into ``[x | h']`` (K columns a row), the GEMMs
    read and write y again (N columns a row). So a projection packs when N >= K (q|k|v and
    gate|up), and o and down (K > N) take the GEMMs. Measured on an H100 (2026-12-07,
    thirteenth session, ``lora_bench.py --pack-tiles``, 8,192 rows of qwen3-0.6b, µs a layer's
    projection, packs with :func:`~pitstop.plugins.kernels.triton_ops.lora_pack.pack_tiles`'s
    large-step tiles): over 8 adapters q|k|v 147.5 packed against 196.9 by GEMMs, gate|up
    193.9 against 275.3, o 86.4 against 83.0, down 124.0 against 108.3; over one adapter
    q|k|v 120.3 against 177.9, gate|up 170.6 against 263.7, o 75.2 against 81.2 (the one
    shape the rule misses, by 6 µs), down 109.1 against 107.7.
    """
    return n >= k


class _Projection:
    """One projection's slot tensors (one A and one B per slice), and its column block of the
    shrink workspace (``index``; ``width`` = slices x rank)."""

    def __init__(self, modules: tuple[str, ...], shapes: dict, slots: int, rank: int, ctx) -> None:
        self.modules = modules
        self.index = 0
        self.width = len(modules) * rank
        kw = {"device": ctx.device, "dtype": ctx.dtype}
        self.A = [torch.zeros(slots, rank, shapes[m][1], **kw) for m in modules]
        self.B = [torch.zeros(slots, shapes[m][0], rank, **kw) for m in modules]
        # a fused layer's projection after an RMSNorm: the norm's gain, multiplied into each
        # A loaded (A * g[None, :]), as the layer folds it into the base weight
        self.gain: torch.Tensor | None = None
        # the stacked layout (lora.kernel=stacked, :meth:`stack`): W_ext [N, K + E] holding the
        # base weight then every slot's B columns, and A_all [E, K]; None: not stacked
        self.ext: torch.Tensor | None = None
        self.A_all: torch.Tensor | None = None
        self.rank = rank
        self.slot_width = len(modules) * rank  # E / slots: one slot's columns of h'
        self.packs_large_steps = False  # stacked, and steps over WORKSPACE_ROWS packed (stack)
        self.weights_region = ctx.weights_region or contextlib.nullcontext

    def stack(self, weight: torch.nn.Parameter, large_steps: str = "auto") -> None:
        """Lay ``weight`` out as the first K columns of ``W_ext`` (the parameter becomes a view
        of it, so the checkpoint loads into it and a weight update writes it), the slots' B
        after them, and stack A (:mod:`pitstop.plugins.kernels.triton_ops.lora_pack`)."""
        n, k = weight.shape
        widths = [b.shape[1] for b in self.B]
        assert sum(widths) == n and self.A[0].shape[2] == k, "the adapter's shapes match the weight"
        e = self.A[0].shape[0] * self.slot_width  # every slot's columns
        with self.weights_region():  # sleep mode releases and restores it with the weights
            self.ext = torch.zeros(n, k + e, dtype=weight.dtype, device=weight.device)
        self.ext[:, :k].copy_(weight.data)
        weight.data = self.ext[:, :k]
        self.A_all = torch.zeros(e, k, dtype=weight.dtype, device=weight.device)
        # steps over WORKSPACE_ROWS (prefill chunks): packed too, or the delta added by
        # library GEMMs after the base one (lora.large_steps: "pack" always, "gemms" never)
        rule = {"auto": packs_large_steps(n, k), "pack": True, "gemms": False}
        self.packs_large_steps = rule[large_steps]

    def load(self, slot: int, layer: int, adapter: LoRAWeights) -> None:
        """Copy ``adapter``'s weights of this projection into ``slot`` (zeros where untrained)."""
        for a_all, b_all, module in zip(self.A, self.B, self.modules, strict=True):
            a_all[slot].zero_()
            b_all[slot].zero_()
            pair = adapter.weights.get((layer, module))
            if pair is not None:
                a, b = pair
                a_all[slot, : adapter.rank].copy_(a, non_blocking=True)
                if self.gain is not None:
                    a_all[slot, : adapter.rank].mul_(self.gain.detach()[None, :])
                b_all[slot, :, : adapter.rank].copy_(b, non_blocking=True)
        if self.ext is not None:
            self._load_stacked(slot)

    def _load_stacked(self, slot: int) -> None:
        """Copy ``slot``'s A and B (just loaded) into ``A_all`` and ``W_ext``'s columns."""
        assert self.ext is not None and self.A_all is not None
        k = self.A[0].shape[2]
        first = slot * self.slot_width
        self.A_all[first : first + self.slot_width] = torch.cat([a[slot] for a in self.A])
        block = self.ext[:, k + first : k + first + self.slot_width]
        block.zero_()
        row = 0
        for i, b_all in enumerate(self.B):
            n = b_all.shape[1]
            block[row : row + n, i * self.rank : (i + 1) * self.rank] = b_all[slot]
            row += n


class LoRASlots:
    """The ``lora`` adapter plugin: PEFT adapters in ``max_loras`` slots (see the module docstring)."""

    def __init__(
        self,
        ctx: AdapterContext,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        *,
        fused: bool = False,
        overlap: bool = False,
        stacked: bool = False,
        pack_split: bool = True,
        large_steps: str = "auto",
        shrink_before: bool = False,
    ) -> None:
        self.ctx = ctx
        self.shrink_before = shrink_before  # fused layers: shrinks summed by the GEMM before
        self.fused = fused  # one lora_add launch a projection, else shrink then expand
        # the stacked layout for the projections of unfused layers over dense weights: a step
        # of at most WORKSPACE_ROWS rows packs [x | h'] and the base GEMM adds the deltas
        self.stacked = stacked and not fused and ctx.config.weights == "dense"
        self.packed: torch.Tensor | None = None  # [WORKSPACE_ROWS * widest] (set by attach)
        self.pack_split = pack_split  # the pack launch may split K (else one program a tile)
        self.large_steps = large_steps  # a stacked projection's steps over WORKSPACE_ROWS
        self.pack_workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # the shrinks of small steps on a second stream, beside their base GEMMs (CUDA only)
        self.side: torch.cuda.Stream | None = None
        if overlap and not fused and not stacked and ctx.device.type == "cuda":
            self.side = torch.cuda.Stream(ctx.device)
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_per_step = max_loras  # the engine holds back requests over it (never a step)
        self.max_cpu = max(max_cpu_loras, max_loras)
        self.ops = kernel_ops(ctx.device)
        dev = ctx.device
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=dev)
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=dev)
        # every step's rows fit (graphs read these buffers by address: never reallocated for them)
        rows = max(ctx.config.max_num_batched_tokens or 0, ctx.step_tokens, 8192)
        self.slot_of_row = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        # the rows grouped by slot (Triton ops only): computed once a step, read by every launch
        self.meta = self._new_meta(rows)
        self.rows = 0  # rows of the current step
        # a stacked step over WORKSPACE_ROWS rows (_large_step): the slots it runs, first to
        # last + 1 (None: a small step, or no adapter)
        self.step_slots: tuple[int, int] | None = None
        # and each row's scale in each slot, [rows, max_loras] float32, static (piecewise CUDA
        # graphs of prefill steps read it by address); allocated by attach where one is stacked
        self.row_scale: torch.Tensor | None = None
        self._slot_index = torch.arange(max_loras, dtype=torch.int32, device=dev)  # 0 .. slots-1
        self.layers: list[dict[str, _Projection]] = []
        # the fused layers and their projections: their deltas read slot_of_row (rebuilt with it)
        self.fused_layers: list[tuple[torch.nn.Module, dict[str, _Projection]]] = []
        # [WORKSPACE_ROWS, projections, widest] float32 (Triton ops only; set by attach)
        self.workspace: torch.Tensor | None = None
        # the fused layers' shrinks summed by the projection before each (QKV, gate-up, down:
        # ProjectionLoRA.h_in), [WORKSPACE_ROWS, layers x 6 x padded rank] float32, zeroed
        # once a step (set by attach where layers are fused and lora.shrink_before is on)
        self.summed: torch.Tensor | None = None
        self.summed_blocks: list[dict[str, torch.Tensor]] = []  # a fused layer's, by projection
        self.slot_ids: list[int | None] = [None] * max_loras  # lora_int_id held per slot
        # adapters copied on a side stream at check(): the event each slot's copy records
        self.loader: torch.cuda.Stream | None = None
        if ctx.device.type == "cuda":
            self.loader = torch.cuda.Stream(ctx.device)
        self.copies: dict[int, torch.cuda.Event] = {}
        self.step_stream: torch.cuda.Stream | None = None  # the stream the steps run on
        self.slot_lru: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # host cache, LRU first
        self.requests: dict[int, Any] = {}  # lora_int_id -> the LoRARequest that named it
        # check() may run on a server thread while the engine thread prepares a step
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ attach
    def attach(self, model: torch.nn.Module) -> None:
        """Wrap every layer's projections; hand a fused layer (``fused.layer``) each
        projection's :class:`ProjectionLoRA` instead, which its ops add inside (the A of QKV
        and gate-up taking the norm's gain, as their base weights do)."""
        layers = getattr(model, "layers", None)
        if layers is None:
            raise ConfigError(f"the lora adapter cannot adapt {type(model).__name__}: no .layers")
        shapes = expected_shapes(self.ctx.model_config)
        for layer in layers:
            projections: dict[str, _Projection] = {}
            for block in (layer.self_attn, layer.mlp):
                if not hasattr(block, "linear_weights") or not hasattr(block, "linear"):
                    raise ConfigError(
                        f"the lora adapter cannot adapt {type(block).__name__} (a mixture of "
                        "experts?): it adapts dense attention and MLP projections"
                    )
                mine = {a: SLICES[a] for a in block.linear_weights() if a in SLICES}
                for attr, modules in mine.items():
                    projections[attr] = _Projection(
                        modules, shapes, self.max_loras, self.max_rank, self.ctx
                    )
                block.linear = self._wrap(block, block.linear, projections, tuple(mine))
                if self.stacked:
                    for attr in mine:
                        projections[attr].stack(getattr(block, attr), self.large_steps)
            self.layers.append(projections)
            if getattr(layer, "fused", False):
                self._hand_to_fused(layer, projections)
        self._allocate_summed()
        self._refresh_deltas()
        self._allocate_workspace()
        stacked = [p for ps in self.layers for p in ps.values() if p.ext is not None]
        if stacked:
            self.row_scale = self._new_row_scale(self.slot_of_row.shape[0])  # large steps
            # one static buffer: each projection's [x | h'] in turn (stream order)
            widest = max(p.ext.shape[1] for p in stacked)
            self.packed = torch.empty(
                WORKSPACE_ROWS * widest, dtype=self.ctx.dtype, device=self.ctx.device
            )
            new_workspace = getattr(self.ops, "pack_workspace", None)
            if new_workspace is not None:  # the Triton op's split-K sums (self-clearing)
                columns = self.max_loras * max(p.slot_width for p in stacked)  # the widest E
                self.pack_workspace = new_workspace(WORKSPACE_ROWS, columns, self.ctx.device)

    def _hand_to_fused(self, layer: torch.nn.Module, projections: dict[str, _Projection]) -> None:
        """A fused layer's projections take their delta from ``layer.projection_lora``; the
        QKV and gate-up A take the gains of the norms before them."""
        gains = {"qkv_proj": "input_layernorm", "gate_up_proj": "post_attention_layernorm"}
        for attr, proj in projections.items():
            if attr in gains:
                proj.gain = getattr(layer, gains[attr])
        self.fused_layers.append((layer, projections))

    # the projections of a fused layer whose shrink the op before them sums (ProjectionLoRA.h_in):
    # QKV (the previous layer's down GEMM), gate-up (the O GEMM), down (the gate-up GEMM)
    SUMMED = ("qkv_proj", "gate_up_proj", "down_proj")

    def _allocate_summed(self) -> None:
        """:attr:`summed`, where layers are fused and ``lora.shrink_before`` is on, and each
        fused layer's block of it for each projection of :attr:`SUMMED` (its slices' padded
        ranks, in :attr:`summed_blocks`)."""
        if not self.fused_layers or not self.shrink_before:
            return
        from pitstop.plugins.kernels.triton_ops.fused_linear import lora_rank_pad

        rank = lora_rank_pad(self.max_rank)
        widths = {attr: len(SLICES[attr]) * rank for attr in self.SUMMED}
        per_layer = sum(widths.values())
        self.summed = torch.empty(
            WORKSPACE_ROWS,
            len(self.fused_layers) * per_layer,
            dtype=torch.float32,
            device=self.ctx.device,
        )
        for layer in range(len(self.fused_layers)):
            first, blocks = layer * per_layer, {}
            for attr, width in widths.items():
                blocks[attr] = self.summed[:, first : first + width]
                first += width
            self.summed_blocks.append(blocks)

    def _refresh_deltas(self) -> None:
        """(Re)build the fused layers' deltas over the current ``slot_of_row`` buffer."""
        for index, (layer, projections) in enumerate(self.fused_layers):
            layer.projection_lora = {
                attr: ProjectionLoRA(
                    tuple(proj.A),
                    tuple(proj.B),
                    self.slot_of_row,
                    self.scaling,
                    self.ranks,
                    # a step's own: the shrink split over K into the workspace cleared once
                    # a step (the unsplit shrink before, one program over K 4,096-14,336 a
                    # row, is the likely reason llama3-8b's `single` with an adapter fell
                    # from 209 to 122 tok/s with fused.layer on the H200, 2026-12-06)
                    functools.partial(self._add_delta, proj=proj),
                    # the fused layer's timing, which calls the cuBLAS way many times on a
                    # step's inputs: an intermediate of its own each call
                    functools.partial(self._add_delta, proj=proj, workspace=False),
                    # stacked: the layer's cuBLAS way packs [x | h'] into one GEMM as an
                    # unfused projection does (over 8 adapters at nano's 256 rows the delta
                    # after cuBLAS ran 0.81x the base, the pack 0.89x: H100, 2026-12-07)
                    None if proj.ext is None else functools.partial(self._stacked, proj=proj),
                    self.summed_blocks[index].get(attr) if self.summed_blocks else None,
                )
                for attr, proj in projections.items()
            }
        # each layer's down GEMM may sum the next layer's QKV shrink (the model reads this key)
        for (layer, _), (after, _) in itertools.pairwise(self.fused_layers):
            qkv = after.projection_lora.get("qkv_proj")
            if qkv is not None and qkv.h_in is not None:  # lora.shrink_before
                layer.projection_lora[NEXT_LAYER_QKV] = qkv

    def _allocate_workspace(self) -> None:
        """The shrinks' float32 workspace of small steps (:data:`WORKSPACE_ROWS`), one column
        block a projection; only for the Triton ops (the reference allocates its own)."""
        # a stacked projection's small steps pack instead (no shrink, no workspace)
        every = [p for projections in self.layers for p in projections.values() if p.ext is None]
        if self.meta is None or not every:
            return
        for index, proj in enumerate(every):
            proj.index = index
        widest = max(p.width for p in every)
        self.workspace = torch.empty(
            WORKSPACE_ROWS, len(every), widest, dtype=torch.float32, device=self.ctx.device
        )

    def _wrap(
        self,
        block: torch.nn.Module,
        linear: Callable[..., torch.Tensor],
        projections: dict[str, _Projection],
        attrs_: tuple[str, ...],
    ) -> Callable[..., torch.Tensor]:
        """``block``'s linear, plus the LoRA delta of the projection whose weight it is given."""

        def adapted(x: torch.Tensor, weight: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            proj = next((projections[a] for a in attrs_ if getattr(block, a) is weight), None)
            if proj is None:
                return linear(x, weight, *args, **kwargs)
            if proj.ext is not None:
                return self._stacked(
                    x, weight, lambda a, w: linear(a, w, *args, **kwargs), proj=proj
                )
            shrunk = self._shrink_beside(x, proj)
            y = linear(x, weight, *args, **kwargs)
            if shrunk is None:
                return self._add_delta(x, y, proj)
            torch.cuda.current_stream(x.device).wait_stream(self.side)  # the join
            self._expand(y, shrunk, proj)
            return y

        return adapted

    def _stacked(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        proj: _Projection,
    ) -> torch.Tensor:
        """A stacked projection with every row's delta: ``gemm(a, w)``, the caller's base GEMM
        (``a @ w.T`` in its own form: with a bias, into a residual), once over ``[x | h']``
        and ``W_ext``, or, for a step over :data:`WORKSPACE_ROWS` rows that does not pack, over
        ``x`` and ``weight`` with the delta added after it (:meth:`_add_large`). An unfused
        projection (:meth:`_wrap`) and a fused layer's cuBLAS way (``ProjectionLoRA.stacked``)
        both run it."""
        assert proj.ext is not None
        if x.numel() <= WORKSPACE_ROWS * x.shape[-1] or proj.packs_large_steps:
            return gemm(self._pack(x, proj), proj.ext)
        y = gemm(x, weight)
        self._add_large(x, y, proj)
        return y

    def _shrink_beside(self, x: torch.Tensor, proj: _Projection) -> torch.Tensor | None:
        """``lora.overlap``: the shrink of a small step (its rows within the workspace) started
        on the side stream, so it runs beside the base GEMM the caller launches next; its
        intermediate, or None where it does not apply (the caller then runs both after the GEMM).

        Ordering: the side stream waits for everything launched so far (``x``, the step's
        workspace memset and grouping), and the caller's stream waits for it before the
        expand; inside a CUDA-graph capture these are the graph's fork and join. ``x`` is
        freed only after the join (the expand comes after it on the caller's stream), and the
        intermediate is the static workspace, so no allocation crosses the streams.
        """
        rows = x.numel() // x.shape[-1]
        if self.side is None or self.workspace is None or rows > WORKSPACE_ROWS:
            return None
        x2 = x.reshape(rows, x.shape[-1])
        out = self.workspace[:rows, proj.index, : proj.width]
        meta = {} if self.meta is None else {"meta": self.meta}
        self.side.wait_stream(torch.cuda.current_stream(x.device))  # the fork
        with torch.cuda.stream(self.side):
            self.ops.lora_shrink(
                x2, proj.A, self.slot_of_row[:rows], self.ranks, out=out, zeroed=True, **meta
            )
        return out

    def _pack(self, x: torch.Tensor, proj: _Projection) -> torch.Tensor:
        """``[x | h']`` of a stacked projection in the static buffer (``x``'s leading shape
        kept), for one GEMM over ``proj.ext`` that adds each row's delta."""
        assert self.packed is not None and proj.ext is not None and proj.A_all is not None
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        rows, width = x2.shape[0], proj.ext.shape[1]
        extra: dict[str, Any] = {} if self.pack_split else {"max_split": 1}
        if rows <= WORKSPACE_ROWS:  # the static buffers (what CUDA graphs capture)
            out = self.packed[: rows * width].view(rows, width)
            if self.pack_workspace is not None:
                extra["workspace"] = self.pack_workspace
        else:  # a prefill chunk: enough row tiles that K is not split (no workspace)
            out = torch.empty(rows, width, dtype=x2.dtype, device=x2.device)
        self.ops.lora_pack(
            x2, proj.A_all, self.slot_of_row[:rows], self.scaling, proj.slot_width, out=out, **extra
        )
        return out.view(*x.shape[:-1], width)

    def _add_large(self, x: torch.Tensor, y: torch.Tensor, proj: _Projection) -> None:
        """A stacked projection's delta over a step of many rows (a prefill chunk) in three
        library calls: ``h = x A_used^T`` over the columns of the slots this step runs, each
        row's columns outside its own slot zeroed and its own scaled (:attr:`row_scale`), then
        ``y += h B_used^T`` with B the slots' columns of ``W_ext``. Against the shrink and
        expand kernels the GEMMs compute every used slot for every row (``slots_used * slices
        * rank`` columns, small beside the projection's own), for host time of a few
        microseconds a call instead of two Triton launches. Captured in a piecewise CUDA graph
        (before any step chose its slots) they span every slot, and the graph reads the
        scales each step writes into the static :attr:`row_scale`."""
        assert proj.ext is not None and proj.A_all is not None and self.row_scale is not None
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # a piecewise graph: any slot
            first, last = 0, self.max_loras
        elif self.step_slots is None:  # no row of this step has an adapter
            return
        else:
            first, last = self.step_slots
        width = proj.slot_width
        k = x.shape[-1]
        x2, y2 = x.reshape(-1, k), y.reshape(-1, y.shape[-1])
        h = x2 @ proj.A_all[first * width : last * width].T
        scale = self.row_scale[: x2.shape[0], first:last, None]
        h.view(-1, last - first, width).mul_(scale)
        y2.addmm_(h, proj.ext[:, k + first * width : k + last * width].T)

    def _expand(self, y: torch.Tensor, h: torch.Tensor, proj: _Projection) -> None:
        """``y += scaling · B h`` for the rows of a slot (in place), ``h`` the shrink's result."""
        y2 = y.reshape(-1, y.shape[-1])
        meta = {} if self.meta is None else {"meta": self.meta}
        slots = self.slot_of_row[: y2.shape[0]]
        self.ops.lora_expand_add(y2, h, proj.B, slots, self.scaling, self.ranks, **meta)

    def _add_delta(
        self, x: torch.Tensor, y: torch.Tensor, proj: _Projection, workspace: bool = True
    ) -> torch.Tensor:
        """``y += scaling · B(A x)`` for the rows of a slot (in place); ``workspace`` False: the
        shrink's intermediate allocated and zeroed for this call, not the step's workspace
        (which is cleared once a step), so that the call can be repeated."""
        x2 = x.reshape(-1, x.shape[-1])
        slots = self.slot_of_row[: x2.shape[0]]
        y2 = y.reshape(-1, y.shape[-1])
        meta = {} if self.meta is None else {"meta": self.meta}  # grouped once this step
        if self.fused:  # one launch of the fused shrink-expand for every slice (prefills: two)
            self.ops.lora_add(y2, x2, proj.A, proj.B, slots, self.scaling, self.ranks, **meta)
            return y
        # the default (faster on the H200, docs/lora.md): shrink, then the expand adds into
        # y. A step over the workspace's rows (a prefill chunk, row tiles enough) shrinks
        # unsplit into an intermediate of its own, which then needs no memset: the expand
        # reads only the rows the shrink wrote. A smaller one splits K where its row tiles
        # are few, into a zeroed intermediate: its block of the workspace, zeroed once this
        # step (_prepare), or, for a call that must repeat (workspace False), its own
        rows = x2.shape[0]
        if rows > WORKSPACE_ROWS:
            self.ops.lora_add(
                y2, x2, proj.A, proj.B, slots, self.scaling, self.ranks, fused=False, **meta
            )
            return y
        into: dict[str, Any] = {}
        if workspace and self.workspace is not None:
            into = {"out": self.workspace[:rows, proj.index, : proj.width], "zeroed": True}
        h = self.ops.lora_shrink(x2, proj.A, slots, self.ranks, **meta, **into)
        self._expand(y, h, proj)
        return y

    def forget_slots(self) -> None:
        """Every slot emptied (zeros), so that each adapter loads again, from the host cache
        (or its folder), when a step next runs it: after sleep mode gave the weights' memory
        back without its contents (level 2; the stacked projections' B columns were lost
        with it), and after a weight update wrote a norm gain that the fused layer's A of
        QKV or gate-up was multiplied by when it loaded (:meth:`_Projection.load`)."""
        with self._lock:
            for projections in self.layers:
                for proj in projections.values():
                    if proj.ext is not None:
                        proj.ext[:, proj.A[0].shape[2] :].zero_()
            self.slot_ids = [None] * self.max_loras
            self.slot_lru.clear()
            self.copies.clear()
            self.ranks.zero_()

    # ------------------------------------------------------------------ requests
    def check(self, request: Any) -> None:
        """Read ``request``'s adapter into the host cache (InvalidRequestError names the problem)."""
        with self._lock:
            self._check(request)

    def _check(self, request: Any) -> None:
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise InvalidRequestError(
                f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r} at "
                f"{known.lora_path!r}; give another id to {request.lora_path!r}"
            )
        self._host(request)
        self.requests[request.lora_int_id] = request
        self._preload(request)

    def ready(self, request: Any, busy: Collection[int]) -> bool:
        """Whether a step can run ``request``'s adapter without waiting for its copy: it is in
        a slot and (CUDA) its side copy has finished. Where it is in no slot, its copy starts
        now, beside the running steps, into a slot that none of ``busy``'s adapters (those of
        the queued requests) holds. True where no copy can run beside the steps (the CPU, or
        no such slot): the step that runs it loads it, as before."""
        with self._lock:
            key = request.lora_int_id
            if key not in self.slot_lru:
                if self.loader is None:
                    return True
                self._preload(request, busy)  # reads it again if the host cache dropped it
                if key not in self.slot_lru:
                    return True
            copy = self.copies.get(self.slot_lru[key])
            return copy is None or bool(copy.query())

    def _preload(self, request: Any, busy: Collection[int] | None = None) -> None:
        """Copy ``request``'s adapter into a slot now, beside the running steps (module
        docstring): an empty one, or (given ``busy``, the queued requests' adapters, on CUDA)
        the least recently used one that none of them holds; else leave it to the step that
        runs it."""
        if request.lora_int_id in self.slot_lru:
            return
        empty = self.slot_ids.index(None) if None in self.slot_ids else None
        if self.loader is None:  # no stream orders a copy after a step still reading a slot
            if empty is not None:
                self._load(empty, request)
            return
        slot = empty if busy is None else self._free_slot(busy)
        if slot is None:
            return
        self.loader.wait_stream(self.step_stream or torch.cuda.current_stream(self.ctx.device))
        with torch.cuda.stream(self.loader):
            self._load(slot, request)
            self.copies[slot] = torch.cuda.Event()
            self.copies[slot].record(self.loader)

    def _host(self, request: Any) -> LoRAWeights:
        """The adapter's host copy (read now when not cached; LRU over ``max_cpu_loras``)."""
        key = request.lora_int_id
        if key in self.host:
            self.host.move_to_end(key)
            return self.host[key]
        shard = self.ctx.shard  # tensor parallelism: read whole, keep this rank's part
        whole = self.ctx.model_config if shard is None else shard.model_config
        weights = read_adapter(request.lora_name, request.lora_path, self.max_rank, whole)
        if shard is not None:
            weights = rank_part(weights, shard)
        self.host[key] = weights
        while len(self.host) > self.max_cpu:
            self.host.popitem(last=False)
        return weights

    # ------------------------------------------------------------------ steps
    def prepare(self, seqs: Sequence[SeqInput]) -> None:
        """Slot each sequence's adapter and write every row's slot (-1: the base model)."""
        with self._lock:
            self._prepare(seqs)

    def _prepare(self, seqs: Sequence[SeqInput]) -> None:
        wanted = {s.adapter.lora_int_id: s.adapter for s in seqs if s.adapter is not None}
        if self.loader is not None:
            self.step_stream = torch.cuda.current_stream(self.ctx.device)
        if len(wanted) > self.max_loras:
            raise RuntimeError(  # the engine holds back requests over it (max_per_step)
                f"a step runs {len(wanted)} adapters but max_loras={self.max_loras}"
            )
        slot_of = {key: self._slot(req, wanted) for key, req in wanted.items()}
        # each row's slot, repeated by numpy: a list of a prompt step's 8,192 ints made into a
        # tensor took 0.9 ms of host time a step (one CPU thread, 2026-12-07), 3 us this way
        per_seq = [-1 if s.adapter is None else slot_of[s.adapter.lora_int_id] for s in seqs]
        host = np.repeat(np.array(per_seq, dtype=np.int32), [len(s.token_ids) for s in seqs])
        rows = len(host)
        if rows > self.slot_of_row.shape[0]:  # eager steps only: graphs never grow past it
            self.slot_of_row = torch.full((rows,), -1, dtype=torch.int32, device=self.ctx.device)
            self.meta = self._new_meta(rows)
            self._refresh_deltas()
            if self.row_scale is not None:
                self.row_scale = self._new_row_scale(rows)
        staged = host_tensor(host, None, self.slot_of_row.device)  # pinned on a GPU
        self.slot_of_row[:rows].copy_(staged, non_blocking=True)
        if self.rows > rows:
            self.slot_of_row[rows : self.rows].fill_(-1)
        self.rows = rows
        self._large_step(slot_of.values(), rows)
        if self.meta is not None:  # over the whole buffer: right for any captured batch size
            self.ops.lora_meta(self.slot_of_row, self.max_loras, out=self.meta)
        # the rows this step's shrinks add into (a captured batch pads past them with rows of
        # slot -1, which no shrink writes and no expand reads): one memset for every projection.
        # A step of more rows shrinks unsplit into intermediates of its own: no memset at all.
        if self.workspace is not None and rows <= WORKSPACE_ROWS:
            self.workspace[:rows].zero_()
        # the shrinks a fused layer's Triton GEMMs sum for the projection after them: this
        # step's rows (rows past them are of slot -1, which no GEMM adds to or reads)
        if self.summed is not None and rows <= WORKSPACE_ROWS:
            self.summed[:rows].zero_()

    def _large_step(self, slots: Collection[int], rows: int) -> None:
        """For :meth:`_add_large`: the span of slots this step runs (None: none) and, in the
        static :attr:`row_scale`, each row's scale in each slot (its adapter's scaling in its
        own, else zero; rows past the step's are of slot -1, so zero: what a piecewise graph of
        a larger size reads); only for a stacked step over :data:`WORKSPACE_ROWS` rows."""
        self.step_slots = None
        if self.row_scale is None or rows <= WORKSPACE_ROWS:
            return
        if slots:
            self.step_slots = (min(slots), max(slots) + 1)
        mine = self.slot_of_row[:, None] == self._slot_index[None, :]
        torch.mul(mine, self.scaling[None, :], out=self.row_scale)

    def _new_row_scale(self, rows: int) -> torch.Tensor:
        """A zero :attr:`row_scale` of ``rows`` rows."""
        return torch.zeros(rows, self.max_loras, dtype=torch.float32, device=self.ctx.device)

    def _new_meta(self, rows: int) -> Any:
        """Static buffers for the rows grouped by slot (None: the ops group rows themselves)."""
        new_meta = getattr(self.ops, "new_meta", None)
        return None if new_meta is None else new_meta(rows, self.max_loras, self.ctx.device)

    def _slot(self, request: Any, wanted: dict[int, Any]) -> int:
        """The slot holding ``request``'s adapter, loaded into the least recently used free
        one (or one no adapter of this step holds) when it is in none."""
        key = request.lora_int_id
        if key in self.slot_lru:
            self.slot_lru.move_to_end(key)
            slot = self.slot_lru[key]
            copy = self.copies.pop(slot, None)
            if copy is not None:  # copied on the side stream: this step's stream waits for it
                torch.cuda.current_stream(self.ctx.device).wait_event(copy)
            return slot
        slot = self._free_slot(wanted)
        assert slot is not None, "the engine holds back adapters past max_loras"
        self._load(slot, request)
        return slot

    def _free_slot(self, busy: Collection[int]) -> int | None:
        """An empty slot, else the least recently used one whose adapter is not in ``busy``
        (None if every slot holds one that is); :meth:`_load` evicts its adapter."""
        if None in self.slot_ids:
            return self.slot_ids.index(None)
        victim = next((k for k in self.slot_lru if k not in busy), None)
        return None if victim is None else self.slot_lru[victim]

    def _load(self, slot: int, request: Any) -> None:
        """Copy ``request``'s adapter into ``slot`` (on the current stream) and record it there."""
        key = request.lora_int_id
        copy = self.copies.pop(slot, None)
        if copy is not None:  # an earlier side copy into this slot: this one comes after it
            torch.cuda.current_stream(self.ctx.device).wait_event(copy)
        if self.slot_ids[slot] is not None:
            self.slot_lru.pop(self.slot_ids[slot], None)
        adapter = self._host(request)
        for layer, projections in enumerate(self.layers):
            for proj in projections.values():
                proj.load(slot, layer, adapter)
        self.ranks[slot] = adapter.rank
        self.scaling[slot] = adapter.scaling
        self.slot_ids[slot] = key
        self.slot_lru[key] = slot
