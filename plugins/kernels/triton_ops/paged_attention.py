"""Paged attention over the KV cache: split-K decode and GQA-packed varlen causal prefill.

The cache is ``[num_pages, page_size, Hkv, D]`` for K and for V; a sequence's
token ``n`` lives at page ``block_tables[seq, n // page_size]``, offset
``n % page_size``. A cached prefix (prefix caching, chunked prefill) is read
in place, so one kernel serves a fresh prompt and a chunk over a cached prefix.

Both kernels run the same loop, :func:`.attend._attend`: key tiles of ``BLOCK_N``
tokens gathered through the block table (:func:`.attend._page_rows`; ``page_size``
is a compile-time constant, so the address arithmetic is shifts and masks),
loaded as whole 16-byte vectors into the software pipeline's shared-memory
stages (``num_stages``, cp.async), ``q @ k^T`` and ``p @ v`` through
``tl.dot`` (wgmma on Hopper) accumulated in float32, and an online softmax in
the log2 domain (scores times ``scale * log2(e)``, then ``exp2``). Only the
tiles that need a mask get one.

GQA packing: a program holds the query heads of one KV group, so every K/V
tile it loads serves ``group`` query heads. Its ``BLOCK_M`` rows are
``BLOCK_Q = BLOCK_M // group`` query tokens times the group's heads (row
``r`` is token ``r // group``, head ``r % group``; any group size works, rows
past ``BLOCK_Q * group`` are padding).

The kernels live in :mod:`.paged_prefill` (sequences computing several tokens) and
:mod:`.paged_decode` (one token each, split-K with its merge); this module holds their tile
tables and :class:`PagedAttention`, which launches them for a step.

Tile shapes are kept in code, keyed by head size and GQA ratio
(:data:`PREFILL_TILES`, :data:`DECODE_TILES`); they were chosen by the sweep
``python benchmarks/kernels_bench.py --tune`` on the H200. Nothing is tuned at
start-up.

An fp8 cache (``float8_e4m3fn``, ``float8_e5m2``: half the bytes of bf16 per
tile) is read as it is stored and widened in registers (exact: every fp8
value is a bf16 and an fp16 value); its scales (``kv_scale`` ``[2]``, read on
the device) are folded in where they cost nothing: K's into the softmax
scale, V's into the output once per program. The widening is a compile-time
choice (``PagedAttention(fp8_widen=...)``):

- ``"fp16"`` (the default; bf16 queries only): K and V tiles are widened to
  fp16, one hardware conversion per pair on Hopper (``cvt.rn.f16x2.e4m3x2``)
  where e4m3 to bf16 takes several instructions (which bounded the decode
  kernel at 45% of copy bandwidth on the H200, issue 29); both products run on fp16 operands with float32 accumulation, the
  probabilities rounded to fp16 (3 more mantissa bits than bf16) before P·V.
  The query tile is converted once per program, scaled by a power of two
  ``2^-e`` taken from the bits of its largest magnitude (``e`` = its exponent
  minus 14, clamped to [-112, 113]) so that the largest element lands in
  [2^14, 2^15) (lower for a tile below 2^-98, e.g. all zeros): nothing overflows fp16's 65504 whatever the bf16 query
  holds, every element within 2^-28 of the largest converts exactly (bf16's
  8 significant bits fit fp16's 11), smaller ones keep fp16's subnormal
  spacing (an error below 2^-39 of the largest); ``2^e`` is folded into the
  softmax scale (exact: a power of two), so no score changes.
- ``"query"``: K and V widened to the query's dtype (bf16), as before.
- ``"qk-fp8"`` (bf16 queries over an e4m3 cache; an e5m2 cache takes
  ``"fp16"``): each query row is scaled by a power of two ``2^-e_i`` (its
  largest magnitude into [2^7, 2^8)) and rounded to e4m3, so ``q . k`` runs on
  the fp8 tensor cores straight from the stored K tile, with no widening;
  ``2^e_i`` multiplies row ``i``'s scores back (exact). V is widened to fp16
  and P rounded to fp16 for ``P . V``, as in ``"fp16"``. The query's rounding
  to 3 mantissa bits is the one loss (FlashAttention 3's fp8 path rounds the
  query too); a test holds the kernel to attention over that rounded query,
  computed in float64.

fp16 and float32 queries always widen to their own dtype (fp16 already is
the one-instruction path; float32 keeps IEEE products), and a bf16 cache
compiles the same kernel whatever ``fp8_widen`` says.

PDL (``PagedAttention(pdl=...)``, :mod:`.pdl`): every kernel waits (``gdc_wait``)
before its first read, since all it reads (q, the cache, the tables, the
lengths, the partials) may come from the kernels before it; it lets the next
kernel launch once its key loop is done.

``precision="fp32"`` runs float32 inputs' matrix products in IEEE fp32;
``"fast"`` lets them use TF32 (for bf16/fp16 inputs the products are on the
tensor cores either way, the probabilities rounded to the input dtype before
P·V as every flash kernel does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pitstop.ground.attention import AttentionMetadata
from pitstop.plugins.kernels.cudnn_prefill import CudnnPrefill
from pitstop.plugins.kernels.triton_ops import paged_decode, paged_prefill, prefix_share
from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2

LOG2E = 1.4426950408889634
FP8_WIDEN = ("fp16", "query", "qk-fp8")  # PagedAttention(fp8_widen=...): module docstring
DECODE_MERGE = ("separate", "last-program")  # PagedAttention(decode_merge=...): module docstring


class PrefillTiles(NamedTuple):
    """Launch shape of the prefill kernel: rows (tokens x group heads) and keys per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class DecodeTiles(NamedTuple):
    """Launch shape of the decode kernel: keys per tile."""

    block_n: int
    num_warps: int
    num_stages: int


# The winners of `kernels_bench.py --tune` on the H200 (bf16, 4,096 and 16,384 tokens, page 16,
# 2026-12-01), keyed by (head_size, group); other shapes take the rule in prefill_tiles().
PREFILL_TILES: dict[tuple[int, int], PrefillTiles] = {
    (128, 1): PrefillTiles(128, 128, 8, 3),
    (128, 2): PrefillTiles(128, 64, 4, 3),
    (128, 4): PrefillTiles(256, 64, 8, 3),
    (128, 8): PrefillTiles(128, 64, 4, 3),
    (64, 4): PrefillTiles(128, 64, 4, 3),
}
# Decode, keyed by head size, for groups of up to 8 query heads per KV head (two warps per
# program and four stages: the best worst case over batch 256 x 512 and 64 x 2,048; 1-warp
# programs were within run-to-run noise of it); larger groups need more warps.
DECODE_TILES: dict[int, DecodeTiles] = {
    128: DecodeTiles(64, 2, 4),
    64: DecodeTiles(64, 2, 4),
}
# decode_tiles="by-batch" (fused.decode_tiles): the H200 decode sweep's best tiles at head size
# 128, group 4 (docs/benchmarks.md, 2026-12-02): (32, 1, 2) from 128 decodes a launch (bf16
# 92.5% -> 99.9% of copy bandwidth at 256 x 512, fp8 59.6% -> 70.2%), and (64, 2, 2) for an
# fp8 cache below that (63.0% -> 65.7% at 64 x 2,048); bf16 below 128 keeps DECODE_TILES.
DECODE_TILE_RULES = ("fixed", "by-batch")  # PagedAttention(decode_tile_rule=...)
WIDE_BATCH_DECODE = 128
WIDE_BATCH_TILES = DecodeTiles(32, 1, 2)
FP8_DECODE_TILES = DecodeTiles(64, 2, 2)
# the interpreter: small tiles so that small test shapes still cross tile borders
INTERPRETER_PREFILL = PrefillTiles(32, 16, 1, 1)
INTERPRETER_DECODE = DecodeTiles(16, 1, 1)


def prefill_tiles(head_size: int, group: int, dtype: torch.dtype) -> PrefillTiles:
    """The prefill tiles for this head size and GQA ratio on a CUDA device."""
    if dtype == torch.float32:  # IEEE fp32 products run on FMA units: small tiles, 8 warps
        return PrefillTiles(64, 32, 8, 2) if head_size <= 128 else PrefillTiles(32, 16, 4, 2)
    tiles = PREFILL_TILES.get((head_size, group)) or PREFILL_TILES.get((head_size, 4))
    if tiles is None:
        tiles = PrefillTiles(128, 64, 4, 3) if head_size <= 128 else PrefillTiles(64, 32, 4, 3)
    if group > tiles.block_m:  # at least one query token per tile
        tiles = tiles._replace(block_m=next_power_of_2(group))
    return tiles


def decode_tiles(head_size: int, group: int, dtype: torch.dtype) -> DecodeTiles:
    """The decode tiles for this head size and GQA ratio on a CUDA device."""
    if dtype == torch.float32:  # with 4 warps ptxas spills
        return DecodeTiles(32, 8, 2)
    if head_size in DECODE_TILES and group <= 8:
        return DECODE_TILES[head_size]
    return DecodeTiles(64, 4, 3) if head_size <= 128 else DecodeTiles(32, 4, 2)


def _row_strides(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor
) -> tuple[int, ...]:
    """The strides both kernels take, in their order: ``stride_qt`` ... ``stride_oh``."""
    return (
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
    )


class PagedAttention:
    """Launches the prefill and decode kernels for one step's mixed batch.

    Tile shapes come from :func:`prefill_tiles` / :func:`decode_tiles` at the
    first call of each head size and GQA ratio (or from ``prefill``/``decode``,
    which the tuning sweep passes). The split count is fixed at construction
    from the device and ``max_context`` (the configured ``max_model_len``), so
    that a decode launch's grid depends only on its batch size. ``fp8_widen``:
    how bf16 queries meet an fp8 cache, ``"fp16"`` or ``"query"``;
    ``decode_merge``: how a split decode's partials are merged, ``"separate"``
    (a second kernel) or ``"last-program"`` (inside the decode launch, by the
    split that finishes last; it owns :attr:`decode_counters`). Both in the
    module docstring. ``decode_tile_rule``: ``"fixed"`` (one tile per head size)
    or ``"by-batch"`` (the decode sweep's best tiles for the launch's batch and
    cache dtype: :data:`WIDE_BATCH_TILES`, :data:`FP8_DECODE_TILES`). ``pdl``:
    programmatic dependent launch of every kernel (``None``: where it works, :mod:`.pdl`).
    ``long_prefill``: where a step's prefills are all long, cuDNN's attention instead of the
    prefill kernel (:mod:`pitstop.plugins.kernels.cudnn_prefill`; None: never).
    ``prefix_share_tokens``: decodes that share at least this many tokens of cached pages read
    them once a group (:mod:`.prefix_share`; 0: never; not with the one-launch merge or
    ``qk-fp8``, which keep the plain decode). ``split_tokens``: a decode batch large enough
    for one split a sequence (:meth:`num_splits`) has its contexts cut into pieces of this
    many tokens instead (rounded up to the tile), ``cdiv(max_context, split_tokens)`` splits
    in the grid, those past a context's end exiting at once: every program's work is bounded,
    so a batch of ragged contexts does not wait on the SMs that drew its longest sequences
    (0: off; the separate merge only, no prefix share).
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        precision: str = "fp32",
        num_sms: int | None = None,
        prefill: PrefillTiles | None = None,
        decode: DecodeTiles | None = None,
        split_waves: int = 4,
        min_split_tokens: int | None = None,
        fp8_widen: str = "fp16",
        decode_merge: str = "separate",
        decode_tile_rule: str = "fixed",
        pdl: bool | None = None,
        long_prefill: CudnnPrefill | None = None,
        prefix_share_tokens: int = 0,
        split_tokens: int = 0,
    ) -> None:
        self.long_prefill = long_prefill
        self.prefix_share_tokens = prefix_share_tokens
        if split_tokens < 0:
            raise ValueError(f"split_tokens must be >= 0 (0: off), not {split_tokens}")
        if split_tokens and (decode_merge == "last-program" or prefix_share_tokens):
            raise ValueError(
                "split_tokens splits large decode batches into pieces of a fixed length, merged "
                "by the separate reduce kernel: not with decode_merge='last-program' or a "
                "prefix share; leave one of them at its default"
            )
        # large batches' decode contexts in pieces of this many tokens (0: one split a sequence)
        self.split_tokens = split_tokens
        # (the step, whether made inside a CUDA-graph capture, its groups)
        self._share_step: tuple[AttentionMetadata, bool, prefix_share.ShareLayout] | None = None
        if decode_tile_rule not in DECODE_TILE_RULES:
            raise ValueError(
                f"decode_tile_rule must be one of {DECODE_TILE_RULES}, not {decode_tile_rule!r}"
            )
        self.decode_tile_rule = decode_tile_rule
        self.pdl = pdl
        if fp8_widen not in FP8_WIDEN:
            raise ValueError(f"fp8_widen must be one of {FP8_WIDEN}, not {fp8_widen!r}")
        if decode_merge not in DECODE_MERGE:
            raise ValueError(f"decode_merge must be one of {DECODE_MERGE}, not {decode_merge!r}")
        self.decode_merge = decode_merge
        self.device, self.dtype, self.max_context = device, dtype, max_context
        self.fp8_widen = fp8_widen
        # input_precision matters for float32 inputs only: IEEE fp32, or TF32 tensor cores when "fast"
        self.dot_precision = "ieee" if precision == "fp32" and dtype == torch.float32 else "tf32"
        self.on_gpu = device.type == "cuda"
        # Triton 3.9's interpreter multiplies bf16 operands of tl.dot as raw 16-bit integers:
        # on CPU, products run on float32 copies (exact products, float32 sums: the same math).
        self.upcast_dot = not self.on_gpu and dtype == torch.bfloat16
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if self.on_gpu else 4
            )
        self.num_sms = num_sms
        self._prefill_override, self._decode_override = prefill, decode
        # decode splits: up to split_waves programs per SM, at most max_context / min_split_tokens
        # (H200 sweeps of split counts, timed from CUDA graphs: batch 8 and 32 were fastest at 8
        # and 2 splits, i.e. ~512 programs, 64 x 2,048 at 1; batch 1 at 32 splits for context
        # 4,096 and 64 for 32,768, and 1 x 128 lost only 0.5 us at 32 splits against 1)
        self.split_waves = split_waves
        self.min_split_tokens = min_split_tokens or (128 if self.on_gpu else 16)
        # decode_merge="last-program": one arrival counter per (decode, KV head), zeroed here
        # once and zero again after every launch (its last program resets it). num_splits() > 1
        # needs num_decodes * num_kv_heads <= split_waves * num_sms / 2, so this many always
        # suffice for the engine's split counts (a forced count may need more: _counters()).
        self.decode_counters: torch.Tensor | None = None
        self._retired_counters: list[torch.Tensor | None] = []
        if decode_merge == "last-program":
            self.decode_counters = torch.zeros(
                max(1, split_waves * num_sms), dtype=torch.int32, device=device
            )

    def prefill_tiles(self, head_size: int, group: int, max_query_len: int) -> PrefillTiles:
        """The prefill tiles of this call; short queries (drafts, small chunks) take fewer rows."""
        tiles = self._prefill_override or (
            prefill_tiles(head_size, group, self.dtype) if self.on_gpu else INTERPRETER_PREFILL
        )
        rows = max(16, next_power_of_2(max_query_len * group))
        if rows < tiles.block_m:  # one tile of rows holds every query: no row tile left idle
            tiles = tiles._replace(block_m=rows, num_warps=min(tiles.num_warps, 4))
        return tiles

    def decode_tiles(
        self, head_size: int, group: int, num_decodes: int = 1, fp8: bool = False
    ) -> DecodeTiles:
        """The decode tiles for this head size and GQA ratio (and, under the ``by-batch``
        rule, the launch's number of decodes and whether the cache is fp8)."""
        if self._decode_override is not None:
            return self._decode_override
        if not self.on_gpu:
            return INTERPRETER_DECODE
        tiles = decode_tiles(head_size, group, self.dtype)
        if self.decode_tile_rule == "fixed" or tiles != DECODE_TILES.get(head_size):
            return tiles  # float32, an unswept head size or a large group: the fixed rule
        if num_decodes >= WIDE_BATCH_DECODE:
            return WIDE_BATCH_TILES
        return FP8_DECODE_TILES if fp8 else tiles

    def widen_f16(
        self, q: torch.Tensor, kv_scale: torch.Tensor | None, k_cache: torch.Tensor | None = None
    ) -> bool:
        """Whether this launch widens fp8 K/V to fp16 (an fp8 cache, bf16 queries,
        ``fp8_widen="fp16"``, or ``"qk-fp8"`` over an e5m2 cache, which it does not take)."""
        if kv_scale is None or q.dtype != torch.bfloat16:
            return False
        return self.fp8_widen == "fp16" or (
            self.fp8_widen == "qk-fp8" and not self.query_fp8(q, kv_scale, k_cache)
        )

    def query_fp8(
        self, q: torch.Tensor, kv_scale: torch.Tensor | None, k_cache: torch.Tensor | None
    ) -> bool:
        """Whether this launch rounds the query to e4m3 for fp8 ``q . k`` (``fp8_widen="qk-fp8"``,
        bf16 queries, an e4m3 cache)."""
        return (
            self.fp8_widen == "qk-fp8"
            and kv_scale is not None
            and q.dtype == torch.bfloat16
            and k_cache is not None
            and k_cache.dtype == torch.float8_e4m3fn
        )

    def reset_decode_counters(self) -> None:
        """Zero the arrival counters of ``decode_merge="last-program"`` (not inside a capture).

        Every completed launch leaves them zero; only a launch that never
        finished (a device fault, after which CUDA needs a new context anyway)
        could leave a count behind, and the next launch would then merge early
        and wrong. Call this after recovering from such an error.
        """
        if self.decode_counters is not None:
            self.decode_counters.zero_()

    def _counters(self, pairs: int) -> torch.Tensor:
        """The arrival counters, at least ``pairs`` of them (grown, zeroed, outside a capture)."""
        counters = self.decode_counters
        assert counters is not None
        if pairs > counters.numel():
            if self.on_gpu and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"decode_merge='last-program': {pairs} (decode, KV head) pairs need more "
                    f"counters than the {counters.numel()} allocated; run this batch size "
                    "once before capturing it"
                )
            counters = torch.zeros(
                next_power_of_2(pairs), dtype=torch.int32, device=counters.device
            )
            # a graph captured earlier still points at the old ones: they stay allocated
            self._retired_counters.append(self.decode_counters)
            self.decode_counters = counters
        return counters

    def num_splits(self, num_decodes: int, num_kv_heads: int) -> int:
        """Context splits per decode sequence: up to ``split_waves`` programs per SM.

        Depends only on the batch size (and constants fixed at construction),
        so a captured CUDA graph's grid stays valid for every context length;
        a split past a shorter context's end only writes an empty state.
        """
        programs = max(1, num_decodes * num_kv_heads)
        want = self.split_waves * self.num_sms // programs
        cap = max(1, cdiv(self.max_context, self.min_split_tokens))
        splits = max(1, min(want, cap, 64))
        # a power of two: at most 7 compiled variants of the kernels across all batch sizes
        return 1 << (splits.bit_length() - 1)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of q ``[T, Hq, D]`` over the paged cache; returns a fresh ``[T, Hq, D]``.

        An fp8 cache needs ``kv_scale`` (float32 ``[2]``: K's scale, then V's).
        """
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        assert hq % hkv == 0 and k_cache.shape[3] == d and k_cache.stride() == v_cache.stride()
        if k_cache.element_size() == 1:
            assert kv_scale is not None and kv_scale.dtype == torch.float32, "fp8 cache: kv_scale"
        else:
            kv_scale = None
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        scale_log2e = scale * LOG2E
        if meta.num_prefills and not (
            self.long_prefill is not None
            and kv_scale is None
            and self.long_prefill.attend(q, k_cache, v_cache, meta, scale, out)
        ):
            self.prefill(q, k_cache, v_cache, meta, scale_log2e, out, hkv, kv_scale)
        if meta.num_decodes:
            self.decode(q, k_cache, v_cache, meta, scale_log2e, out, hkv, kv_scale)
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale_log2e: float,
        out: torch.Tensor,
        hkv: int,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Causal attention of the batch's first ``num_prefills`` sequences (prompts, chunks, drafts) into ``out``."""
        _, hq, d = q.shape
        group = hq // hkv
        tiles = self.prefill_tiles(d, group, meta.max_query_len)
        block_q = tiles.block_m // group
        bt = meta.block_tables
        grid = (hkv, cdiv(meta.max_query_len, block_q), meta.num_prefills)
        use_pdl = _pdl.enabled(q.device, self.pdl)
        paged_prefill._prefill_kernel[grid](
            q,
            k_cache,
            v_cache,
            out if kv_scale is None else kv_scale,  # any pointer when the cache is not fp8
            bt,
            meta.context_lens,
            meta.cu_query_lens,
            out,
            scale_log2e,
            *_row_strides(q, k_cache, bt, out),
            GROUP=group,
            HEAD=d,
            PAGE_SIZE=meta.page_size,
            BLOCK_M=tiles.block_m,
            BLOCK_Q=block_q,
            BLOCK_N=tiles.block_n,
            DOT_PRECISION=self.dot_precision,
            UPCAST=self.upcast_dot,
            QUANT=kv_scale is not None,
            WIDEN_F16=self.widen_f16(q, kv_scale, k_cache),
            Q_FP8=self.query_fp8(q, kv_scale, k_cache),
            PDL=use_pdl,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            **_pdl.launch_kwargs(use_pdl),
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale_log2e: float,
        out: torch.Tensor,
        hkv: int,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Split-K decode of the batch's last ``num_decodes`` sequences (one query token each) into ``out``."""
        nd = meta.num_decodes
        _, hq, d = q.shape
        group = hq // hkv
        tiles = self.decode_tiles(d, group, nd, fp8=kv_scale is not None)
        splits = self.num_splits(nd, hkv)
        split_tokens = 0
        if splits == 1 and self.split_tokens:  # a large batch: pieces of a fixed length
            split_tokens = cdiv(self.split_tokens, tiles.block_n) * tiles.block_n
            splits = max(1, cdiv(self.max_context, split_tokens))
            split_tokens = split_tokens if splits > 1 else 0
        bt = meta.block_tables
        share = self._share_layout(q, kv_scale, k_cache, meta, group, tiles)
        slots = splits + (share.splits if share is not None else 0)
        merge_last = splits > 1 and self.decode_merge == "last-program" and share is None
        if slots > 1:
            part_o = torch.empty((nd, hq, slots, d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((nd, hq, slots, 2), dtype=torch.float32, device=q.device)
        else:
            part_o = part_ml = out  # unused
        if merge_last:
            assert splits & (splits - 1) == 0, (
                f"last-program merge: {splits} splits, not a power of 2"
            )
            counters = self._counters(nd * hkv)
        else:
            counters = out  # unused
        use_pdl = _pdl.enabled(q.device, self.pdl)
        switches = dict(
            DOT_PRECISION=self.dot_precision,
            UPCAST=self.upcast_dot,
            QUANT=kv_scale is not None,
            WIDEN_F16=self.widen_f16(q, kv_scale, k_cache),
            PDL=use_pdl,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            **_pdl.launch_kwargs(use_pdl),
        )
        if share is not None:
            prefix_share.shared_pass(
                q, k_cache, v_cache, kv_scale, bt, share, part_o, part_ml, scale_log2e,
                meta.num_prefill_tokens, meta.num_prefills, splits, tiles.block_n, switches,
            )  # fmt: skip
        paged_decode._decode_kernel[(nd, hkv, splits)](
            q,
            k_cache,
            v_cache,
            out if kv_scale is None else kv_scale,  # any pointer when the cache is not fp8
            bt,
            meta.context_lens,
            out,
            part_o,
            part_ml,
            counters,
            share.start if share is not None else out,  # unused without a shared pass
            scale_log2e,
            meta.num_prefill_tokens,
            meta.num_prefills,
            *_row_strides(q, k_cache, bt, out),
            GROUP=group,
            BLOCK_G=max(16, next_power_of_2(group)),
            HEAD=d,
            PAGE_SIZE=meta.page_size,
            BLOCK_N=tiles.block_n,
            NUM_SPLITS=splits,
            Q_FP8=self.query_fp8(q, kv_scale, k_cache),
            MERGE_LAST=merge_last,
            MERGE_G=next_power_of_2(group) if merge_last else 1,
            SHARE_SPLITS=slots - splits,
            SPLIT_TOKENS=split_tokens,
            **switches,
        )
        if slots > 1 and not merge_last:
            paged_decode._decode_reduce_kernel[(nd, hq)](
                out,
                part_o,
                part_ml,
                meta.context_lens,
                meta.num_prefill_tokens,
                meta.num_prefills,
                out.stride(0),
                out.stride(1),
                HEAD=d,
                NUM_SPLITS=slots,
                BLOCK_S=next_power_of_2(slots),
                PDL=use_pdl,
                SPLIT_TOKENS=split_tokens,
                num_warps=4,
                **_pdl.launch_kwargs(use_pdl),
            )

    def _share_layout(
        self,
        q: torch.Tensor,
        kv_scale: torch.Tensor | None,
        k_cache: torch.Tensor,
        meta: AttentionMetadata,
        group: int,
        tiles: DecodeTiles,
    ) -> prefix_share.ShareLayout | None:
        """This step's decode groups (:func:`.prefix_share.group_decodes`), made at the step's
        first call and kept for its other layers (the same ``meta``); None where the shared
        pass does not apply (off, fewer than two decodes, the one-launch merge, ``qk-fp8``, a
        group too large for a tile)."""
        if self.prefix_share_tokens <= 0:  # off (the default): nothing else to ask
            return None
        members = prefix_share.max_members(group)
        if (
            meta.num_decodes < 2
            or members < 2
            or self.decode_merge == "last-program"
            or self.query_fp8(q, kv_scale, k_cache)
        ):
            return None
        # made at the step's first layer and kept for the others; a capture makes its own (a
        # layout made before it would not be in the graph, so replays would not regroup)
        capturing = self.on_gpu and torch.cuda.is_current_stream_capturing()
        made = self._share_step
        if made is not None and made[0] is meta and made[1] == capturing:
            return made[2]
        layout = prefix_share.group_decodes(
            meta.block_tables,
            meta.context_lens,
            meta.num_prefills,
            meta.num_decodes,
            meta.page_size,
            self.prefix_share_tokens,
            members,
            max(meta.page_size, tiles.block_n),
            prefix_share.share_splits(self.max_context, self.prefix_share_tokens),
        )
        self._share_step = (meta, capturing, layout)
        return layout
