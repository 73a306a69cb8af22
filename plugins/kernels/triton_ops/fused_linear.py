"""Skinny-M GEMMs with the decoder layer's prologue and epilogue inside: norm, SiLU·mul, residual.

Three ops over ``x [M, K]`` and a weight ``[N, K]`` (a checkpoint's row layout, never
re-laid out), for decode and mixed steps of 1..256 rows (correct for any M):

- :func:`norm_linear`: ``rstd(x)[:, None] * (x @ W.T) (+ bias)``, the RMSNorm's gain
  folded into ``W`` at load (``W' = W * g[None, :]``), so only the row scale
  ``rstd = 1 / sqrt(mean(x.float() ** 2) + eps)`` remains; it commutes with the GEMM
  (row ``i`` of ``diag(r) x W^T`` is ``r_i`` times row ``i`` of ``x W^T``), so the
  sum of squares is accumulated in float32 from the very ``x`` tiles the K loop
  loads for the products, and applied in the epilogue.
- :func:`norm_gate_up`: the same over a merged ``[gate | up]`` weight ``[2F, K]``,
  two accumulators per tile (rows ``n`` and ``F + n``), ``silu(g) * u`` in the
  epilogue; returns ``[M, F]``.
- :func:`linear_residual`: ``residual + x @ W.T (+ bias)``.

Rounding: products of the input dtype (bf16, fp16, or fp32 in IEEE fp32) accumulated
in float32; every epilogue step (row scale, bias, SiLU·mul, residual add) in float32;
one rounding, to ``x``'s dtype, at the store (bf16 rounded to nearest-even on the
float32 bits, :func:`rope_store._rounded`, so Triton's interpreter, which truncates,
rounds as the GPU does). This is *more* accurate than the unfused chain (which rounds
the normed row, the projection and the activation each to bf16), so tests compare
with float64 arithmetic of the same formula.

Orientation: each program computes the transposed tile ``acc[BLOCK_N, BLOCK_M] =
W[n, k] @ x[m, k]^T`` ("swap AB"): the wide weight tile is the MMA's M side (64 rows
a warpgroup on Hopper) and the few token rows its N side (down to 16), so one row of
tokens wastes no tensor-core rows. Out-of-range weight rows and token rows are
clamped onto the last valid row instead of masked, so every load streams whole
vectors; only the store is masked (and K, where ``K`` is not a multiple of the split).

Tile order: grid axis 0 numbers the ``(column tile, row tile)`` pairs with the row tiles
fastest, so the programs that multiply one weight tile by the row tiles of a step of more
rows than ``BLOCK_M`` are scheduled side by side: the weight tile streams from HBM once
and its other readers find it in L2 (a weight wider than L2, llama3-8b's gate-up at 235
MB, was read once per row tile from HBM in column-major order). Grid axis 1 is the split.

Split-K (:class:`LinearConfig.split_k` > 1): when ``cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M)``
tiles are too few to fill the GPU, grid axis 1 cuts K into ``split_k`` ranges of
``cdiv(cdiv(K, split_k), BLOCK_K) * BLOCK_K`` columns (a last range may be short or
empty). Every program writes its float32 partial accumulator(s) and its rows' partial
sum of squares to a workspace slot of its own (tile, split), then increments the
tile's arrival counter; the one that reads ``split_k - 1`` sums every split's partials
in split order (so the bits do not depend on which program arrived last), runs the
epilogue, writes the output and stores 0 into the counter. The memory ordering is
:mod:`.paged_attention`'s one-launch merge, unchanged: plain stores by every thread,
``tl.debug_barrier()``, one ``atomic_add(sem="acq_rel", scope="gpu")`` whose release
is cumulative over the program's stores; the increments of one counter are totally
ordered and each acq_rel RMW synchronizes with the next, so every partial happens
before the last program's acquire; a second barrier orders its threads after that
acquire, and its loads of the partials bypass L1 (``.cg``). Nothing waits on
another program (no spin, so residency does not matter); the counter reset is a
plain store (no other increment of this launch remains), so every completed launch
leaves the counters zero, with no memset: CUDA-graph safe. The workspace and
counters are per device, allocated once (:func:`workspace`, fixed size: the config
rule shrinks ``split_k`` until a launch fits), shared by every launch on the
device's one stream: launches on several streams at once must not split.

Stream-K (:class:`LinearConfig.stream_k` > 0, plain GEMMs of one row tile): every program
takes the same run of K steps across the tiles, a tile cut between programs summed by its
last part in part order, with the same workspace and counters (:mod:`.fused_linear_stream_k`).

LoRA (``lora=``, :class:`ProjectionLoRA`: the ``lora`` adapter plugin's slots of one
projection, :mod:`.lora`'s layout): ``scaling[s] * B_s (A_s x)`` added to each token
row of slot ``s`` inside the GEMM, no launch of its own. The shrink rides in the K loop:
each program loads, beside its weight tile, the ``[R, BLOCK_K]`` tile of A of its tile's
*lead slot* (the largest slot among its rows; every load masked off where it has none)
and accumulates ``h = A x`` (float32) from the very ``x`` tiles of the product, so the
extra bytes are ``R / BLOCK_N`` of the weight's, read from L2 (A is shared by every
column tile). Rows of another slot in the same tile (a tile of several adapters) take
one more pass over the program's K range per slot present, after the loop. The expand
runs in the epilogue, ``B_s[col, :] @ h`` (float32), scaled per row, added to the
accumulator before the row scale (so the normed projections' A has the norm's gain
folded in, as their weights do), the bias and SiLU·mul, or before the residual. With
split-K each split's ``h`` goes to the workspace beside its partials and the last
program sums them in split order. A projection's slices (q|k|v; gate|up) must fall on
tile borders (:func:`lora_fits`); each column tile takes its slice's A and B.

One shrink for every program (``LinearConfig.shared_shrink``): at few rows every column
program re-reads the whole of A for the same ``h`` (llama3-8b's gate-up at one row: 448
programs, each 256 KB of A beside 1 MB of weight, from L2), which cost 3.5, 2.0, 12.8 and
2.3 µs on q|k|v, o, gate-up and down against their GEMMs alone (an H100, 2026-12-07). With
the shrink shared, K's steps are cut into ``CHUNKS`` chunks (at most
:data:`SHARED_MAX_CHUNKS`, no more than the programs) and program ``j`` (in launch order,
so among the first to run) computes chunk ``j`` of every slice's shrink right after the PDL
wait, stores it to its own float32 partials and releases it with one ``acq_rel`` add on one
counter of the device. A consumer (every program; with split K the last split of each tile)
arrives on the same counter with one ``acq_rel`` add of :data:`SHARED_CONSUMER` (producers
count in the low bits): if every producer had released, it sums the chunks in chunk order;
if not, it computes every chunk itself with the producer's own code and sums them in the same
order, so the bits are the same either way and nothing waits on another program (no spin:
residency does not matter). The launch's last event, producer or consumer, zeroes the
counter, as the split-K counters are zeroed (no memset, CUDA-graph safe, one stream). Only
where every tile holds at most one adapter (one row tile, and one row or one slot: the
fused layer gives Triton nothing else) and the shrink is not read from ``h_in``. Off by
default; the fused layer times it beside the K loop's way up to 16 rows.

PDL (:mod:`.pdl`): a program loads its first weight tile(s) (they do not depend on
the previous kernel) and, with LoRA, its rows' slots, its lead slot's rank, first A
tile(s), B tile(s) and scaling (the runner writes ``slot_of_row`` with plain stream
copies before the step's first kernel, and an adapter's tensors before the step, so no
kernel that may still run writes them), then ``gdc_wait()``, then everything else (x,
the workspace, the counters, bias, residual); ``gdc_launch_dependents()`` once its K
loop is done.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pitstop.plugins.kernels.lora_reference import ProjectionLoRA
from pitstop.plugins.kernels.triton_ops import fused_linear_stream_k as stream_k
from pitstop.plugins.kernels.triton_ops import pdl as _pdl
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, k_per_split, next_power_of_2
from pitstop.plugins.kernels.triton_ops.lora import _pick
from pitstop.plugins.kernels.triton_ops.skinny_steps import (
    _add_part,
    _dot,
    _epilogue,
    _k_product,
    _k_step,
    _load_k,
    _store_part,
)


class LinearConfig(NamedTuple):
    """Launch shape: tile rows (tokens), tile columns (weight rows), K step, K splits, warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    # 1: a LoRA's shrink shared by the programs, not ridden in each one's K loop (module
    # docstring, "One shrink for every program"); only where a tile holds one adapter
    shared_shrink: int = 0
    # > 0: stream-K over this many programs, every program the same K steps
    # (:mod:`.fused_linear_stream_k`); only plain GEMMs of one row tile
    stream_k: int = 0


# (largest M of the bucket) -> (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for bf16/fp16 on a
# Hopper GPU, from benchmarks/fused_linear_bench.py's sweeps on the H200 (2026-12-04, Triton
# 3.6). BLOCK_M covers M up to 64: a second row tile streams the weights again (llama3-8b
# gate-up at M=64: 118 us with 32-row tiles, 67 with 64); 5 stages lost to 4 where a split
# has two K steps (qwen3-0.6b QKV at M=1: 8.6 us against 5.8). Above 64 rows the tiles
# re-read the weights and cuBLAS is faster: use it there. Tiles of BLOCK_M 128 with 8 warps
# gave intermittently wrong results (relative error up to 0.4) at M=256 under Triton 3.6:
# no 8-warp tile is used until that is understood.
GPU_TILES: dict[int, tuple[int, int, int, int, int]] = {
    16: (16, 64, 128, 4, 4),
    32: (32, 64, 128, 4, 4),
    64: (64, 64, 128, 4, 3),
    128: (64, 64, 64, 4, 4),
    256: (64, 64, 64, 4, 4),
}
# More tiles a shape of 65..256 rows may take where the fused layer times its candidates
# (layer_choice.py): 128 token rows a tile read the weights half as often as 64 at 256 rows,
# with one warpgroup (4 warps; no 8-warp tile, see above). (128, 64, 64, 4, 3) gave wrong
# results on an H100 (relative error 0.16 at 128-256 rows, 2026-12-05), so it is not here;
# on that H100 cuBLAS beat these at 128 and 256 rows for every qwen3-0.6b projection (before
# the row-tile-fastest order). (128, 128, 64, 4, 3), added 2026-12-05 without a GPU: a 128 x 128
# accumulator halves both the weight's and the rows' re-reads; it stays only if the GPU test
# (test_wide_tiles_match_float64_every_time, twenty calls of every op) passes.
WIDE_TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 64, 128, 4, 3),
    (64, 128, 64, 4, 3),
    (128, 128, 64, 4, 3),
)
FP32_TILES = (16, 64, 32, 4, 3)  # IEEE fp32 products on FMA units: small K steps
INTERPRETER_TILES = (16, 16, 32, 1, 1)  # small, so test shapes cross tile borders
MAX_SPLIT = 16
MAX_LORA_SLICES = 3  # q|k|v
MIN_K_PER_SPLIT = 256  # at least two K steps of 128 per split on the GPU
# split K until the grid has about this many programs per SM: two up to 16 rows (the H200
# sweep: split 4-8 best at M=1), one above (split programs lost to fewer, longer ones there)
PROGRAMS_PER_SM = 2
PROGRAMS_PER_SM_WIDE = 1
# up to this many rows the fused layer also times the table's tile unsplit (unsplit_tiles),
# with DEEP_STAGES stages where a stage holds one weight tile, where its tiles are at least a
# third as many as the SMs
UNSPLIT_ROWS = 16
DEEP_STAGES = 6
# the split-K workspace (float32) and counters of a device: fixed, so nothing grows mid-capture
WORKSPACE_FLOATS = {"cuda": 1 << 22, "cpu": 1 << 16}
NUM_COUNTERS = {"cuda": 1 << 13, "cpu": 1 << 10}
# the shared shrink (LinearConfig.shared_shrink): at most this many programs each compute one
# chunk of K's shrink (a consumer loads every chunk, unrolled: more chunks, more loads, less
# work a producer); their float32 partials' room (chunks x slices x rank x BLOCK_M)
SHARED_MAX_CHUNKS = 16
SHARED_FLOATS = {"cuda": 1 << 20, "cpu": 1 << 14}
# a consumer's increment of the shared shrink's counter: producers count in the low 16 bits
SHARED_CONSUMER = 1 << 16


class SplitWorkspace(NamedTuple):
    """A device's split-K partials (float32) and per-tile arrival counters (int32, zero
    between launches); the shared shrink's chunk partials (float32) and its one counter
    (int32, zero between launches)."""

    partials: torch.Tensor
    counters: torch.Tensor
    shrink_partials: torch.Tensor
    shrink_counter: torch.Tensor


_workspaces: dict[torch.device, SplitWorkspace] = {}


def workspace(device: torch.device) -> SplitWorkspace:
    """The split-K workspace of ``device``, allocated (zeroed) at the first call; call it (or
    run each shape once) before capturing a CUDA graph: it cannot be allocated inside one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _workspaces.get(device)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fused_linear: the split-K workspace must be allocated before a CUDA graph "
                "capture; call fused_linear.workspace(device) (or run once) first"
            )
        kind = "cuda" if device.type == "cuda" else "cpu"
        ws = SplitWorkspace(
            torch.zeros(WORKSPACE_FLOATS[kind], dtype=torch.float32, device=device),
            torch.zeros(NUM_COUNTERS[kind], dtype=torch.int32, device=device),
            torch.zeros(SHARED_FLOATS[kind], dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )
        _workspaces[device] = ws
    return ws


def reset_counters(device: torch.device) -> None:
    """Zero the arrival counters (after a device fault left a launch unfinished; not in a capture)."""
    ws = workspace(device)
    ws.counters.zero_()
    ws.shrink_counter.zero_()


def _grid_tiles(m: int, n: int, block_m: int, block_n: int) -> int:
    """The ``(column tile, row tile)`` programs of one K split over ``m`` rows and ``n`` columns."""
    return cdiv(n, block_n) * cdiv(max(m, 1), block_m)


def _split_fits(
    tiles: int, split: int, block_m: int, block_n: int, accs: int, kind: str, rank_pad: int = 0
) -> bool:
    """Whether a launch's split-K partials fit the workspace: each (tile, split) its
    accumulators, its rows' squares and, with a LoRA of padded rank ``rank_pad``, its ``h``."""
    floats = tiles * split * (accs * (block_n + rank_pad) * block_m + block_m)
    return floats <= WORKSPACE_FLOATS[kind] and tiles <= NUM_COUNTERS[kind]


def lora_rank_pad(rank_max: int) -> int:
    """The kernel's rank of a LoRA of ``rank_max`` (a power of two, at least 16; 0: none)."""
    return max(16, next_power_of_2(rank_max)) if rank_max > 0 else 0


def fit_lora_split(
    config: LinearConfig, m: int, n: int, k: int, gate_up: bool, rank_pad: int, kind: str
) -> LinearConfig:
    """``config`` with the largest K split up to its own whose partials fit the workspace beside
    a LoRA's ``h`` (``rank_pad`` floats a row and accumulator), no split left empty: the
    table's rules size the split without one (llama3-8b's gate-up at 17-32 rows, split 4 with
    a rank-16 LoRA, needed 1.1 times the workspace)."""
    tiles = _grid_tiles(m, n, config.block_m, config.block_n)
    accs = 2 if gate_up else 1
    for split in range(config.split_k, 1, -1):
        per_split = k_per_split(k, split, config.block_k)
        fits = _split_fits(tiles, split, config.block_m, config.block_n, accs, kind, rank_pad)
        if fits and cdiv(k, per_split) == split:
            return config._replace(split_k=split)
    return config._replace(split_k=1)


@functools.lru_cache(maxsize=512)
def choose_config(
    m: int, n: int, k: int, dtype: torch.dtype, gate_up: bool, on_gpu: bool, num_sms: int
) -> LinearConfig:
    """The launch shape for ``M=m`` rows, ``n`` output columns (``F`` for gate-up), depth ``k``.

    Tiles by M bucket (:data:`GPU_TILES`; fp32 and the interpreter take their own), then the
    K split: doubled while the grid has fewer than ``PROGRAMS_PER_SM * num_sms`` programs
    (``PROGRAMS_PER_SM_WIDE`` above 16 rows)
    (a gate-up tile counts twice: it streams two weight tiles), each split keeps at least
    :data:`MIN_K_PER_SPLIT` columns (two K steps in the interpreter), and the workspace fits.
    """
    if not on_gpu:
        tile = INTERPRETER_TILES
    elif dtype == torch.float32:
        tile = FP32_TILES
    else:
        tile = GPU_TILES[min((b for b in GPU_TILES if b >= m), default=max(GPU_TILES))]
    return with_split(tile, m, n, k, gate_up, on_gpu, num_sms)


def tile_candidates(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    gate_up: bool,
    num_sms: int,
    lora_rank: int = 0,
) -> list[LinearConfig]:
    """The launch shapes a GPU call of ``m`` rows may take, the table's first
    (:func:`choose_config`), up to 64 rows the same tile with :func:`balanced_split`'s K
    split, then for 65..256 rows of bf16/fp16 the :data:`WIDE_TILES`, each with its K split
    by the table's rule; the fused layer times them (``layer_choice.py``).
    ``lora_rank`` (a LoRA delta inside, its ``rank_max``; 0: none): gate-up's wide tiles over
    a K step of 64, and up to 64 rows of bf16/fp16 also tiles 128 and 256 columns wide, which
    load A's rank rows beside two and four times the weight rows (``R / BLOCK_N`` of the
    weight's bytes: a half and a quarter of the 64-column tile's), each with the table's K
    split and the balanced one; every shape's K split is cut where its partials and the
    LoRA's ``h`` would not fit the workspace (:func:`fit_lora_split`); up to
    :data:`UNSPLIT_ROWS` rows each of those in one row tile also with the shrink shared
    (``shared_shrink``); without one, up to :data:`UNSPLIT_ROWS` rows, the table's tile under
    stream-K too (:func:`stream_k_tiles`)."""
    configs = [choose_config(m, n, k, dtype, gate_up, True, num_sms)]
    if m <= 64:  # the table's tile with its work spread evenly over the SMs
        configs.append(balanced_split(configs[0], m, n, k, gate_up, num_sms))
    tiles = _grid_tiles(m, n, configs[0].block_m, configs[0].block_n)
    if m <= UNSPLIT_ROWS and dtype != torch.float32 and tiles * 3 >= num_sms:
        configs += unsplit_tiles(configs[0], gate_up)
    if m <= UNSPLIT_ROWS and dtype != torch.float32 and not lora_rank:
        configs += stream_k_tiles(configs[0], gate_up, num_sms)
    if dtype != torch.float32 and 64 < m <= 256:
        wide = WIDE_TILES
        if lora_rank and gate_up:  # two weight tiles and A's rank rows a stage: over a K step of
            # 128 the 128-row tile needs 240 KiB of shared memory, over sm_90's 227 KiB
            wide = tuple((bm, bn, 64, warps, stages) for bm, bn, _, warps, stages in wide)
        configs += [with_split(t, m, n, k, gate_up, True, num_sms) for t in wide]
    if lora_rank and dtype != torch.float32 and m <= 64:
        first = configs[0]  # two 128-row weight tiles a stage for gate-up: two stages fit,
        # over a K step of 64 at 64 rows (at 128 the two stages and the epilogue's [64, 2 x 128]
        # accumulators need 232 KiB of shared memory, over sm_90's 227 KiB)
        stages = min(first.num_stages, 2 if gate_up else 3)
        bk = 64 if gate_up and first.block_m > 32 else first.block_k
        wide = (first.block_m, 128, bk, first.num_warps, stages)
        configs += _both_splits(wide, m, n, k, gate_up, num_sms)
        if m <= 16:  # 256 columns: a quarter of the 64-column tile's A bytes; two stages of
            # a 256-row weight tile (two for gate-up, over a K step of 64) fit in shared
            # memory, and the [256, 16] accumulators in registers
            bk = 64 if gate_up else min(first.block_k, 128)
            widest = (first.block_m, 256, bk, first.num_warps, 2)
            configs += _both_splits(widest, m, n, k, gate_up, num_sms)
    if lora_rank:
        pad = lora_rank_pad(lora_rank)
        configs = [fit_lora_split(c, m, n, k, gate_up, pad, "cuda") for c in configs]
        if m <= UNSPLIT_ROWS:  # each shape with the shrink shared too, where one row tile
            configs += [c._replace(shared_shrink=1) for c in configs if m <= c.block_m]
    return list(dict.fromkeys(configs))  # in order, without repeats


def unsplit_tiles(table: LinearConfig, gate_up: bool) -> list[LinearConfig]:
    """The table's tile over the whole of K (no split), and for a single weight tile a stage
    the same with :data:`DEEP_STAGES` stages: a latency-bound step of few rows whose split-K
    programs each pay the partials' round trip and the last arriver's pass. On one H100
    (2026-12-07, the sixteenth session's timed choices at one row of llama3-8b) the split
    GEMMs read their weights at 72-76% of the copy rate (q|k|v split 2: 22.2 us for 50 MB; o
    split 4: 15.5 us for 34 MB) where gate-up, unsplit, read its 235 MB at 98%; unsplit, q|k|v
    has 96 programs of 64 columns, fewer than the SMs, each streaming its whole K with more
    bytes in flight over deeper stages. Timed beside the others, kept only where faster."""
    unsplit = table._replace(split_k=1)
    if gate_up:  # two weight tiles a stage: the table's stages are what fits
        return [unsplit]
    return [unsplit, unsplit._replace(num_stages=max(table.num_stages, DEEP_STAGES))]


def stream_k_tiles(table: LinearConfig, gate_up: bool, num_sms: int) -> list[LinearConfig]:
    """The table's tile under stream-K (:mod:`.fused_linear_stream_k`: every program the same
    K steps) over one and two programs an SM, and for a single weight tile a stage one an SM
    with :data:`DEEP_STAGES` stages: a GEMM of few rows whose tiles spread unevenly over the
    SMs (llama3-8b's q|k|v and o at one row read at 76% and 72% of copy on an H100, where
    gate-up's 448 tiles read at 98%). Timed beside the others, kept only where faster."""
    one = table._replace(split_k=1, stream_k=num_sms)
    shapes = [one, one._replace(stream_k=2 * num_sms)]
    if not gate_up:
        shapes.append(one._replace(num_stages=max(table.num_stages, DEEP_STAGES)))
    return shapes


def _both_splits(
    tile: tuple[int, int, int, int, int], m: int, n: int, k: int, gate_up: bool, num_sms: int
) -> list[LinearConfig]:
    """A wide LoRA tile with the table's K split and with :func:`balanced_split`'s: a tile of
    twice the columns has half the column tiles, so the table's rule can leave SMs idle
    (llama3-8b's gate-up at one row: 112 programs of 128 columns, unsplit, on 132 SMs) or
    load the busiest one with a whole wave more (q|k|v: 192 programs of split 4 where split
    8 gives each of 132 SMs three equal ones, as the 64-column tile's split 4 does)."""
    table = with_split(tile, m, n, k, gate_up, True, num_sms)
    return [table, balanced_split(table, m, n, k, gate_up, num_sms)]


def balanced_split(
    config: LinearConfig, m: int, n: int, k: int, gate_up: bool, num_sms: int
) -> LinearConfig:
    """``config`` with the K split that spreads the work most evenly over ``num_sms`` SMs:
    the least ``ceil(programs / SMs) * columns a split`` (the K columns of the busiest SM,
    where a GEMM of few rows is bound by each SM's share of the bandwidth), the smaller split
    on a tie, each split at least :data:`MIN_K_PER_SPLIT` columns, the workspace fitting.
    llama3-8b's QKV at one row: 96 column tiles, the doubling rule's 2 splits leave the
    busiest SMs two half-tiles (one tile's columns), 4 splits three quarter-tiles."""
    tiles = _grid_tiles(m, n, config.block_m, config.block_n)
    weight = 2 if gate_up else 1
    best, best_load = config.split_k, None
    for split in range(1, MAX_SPLIT + 1):
        per_split = k_per_split(k, split, config.block_k)
        if split > 1 and (per_split < MIN_K_PER_SPLIT or cdiv(k, per_split) < split):
            continue  # too short, or a split left empty
        if not _split_fits(tiles, split, config.block_m, config.block_n, weight, "cuda"):
            continue
        load = cdiv(tiles * split, num_sms) * per_split
        if best_load is None or load < best_load:
            best, best_load = split, load
    return config._replace(split_k=best)


def with_split(
    tile: tuple[int, int, int, int, int],
    m: int,
    n: int,
    k: int,
    gate_up: bool,
    on_gpu: bool,
    num_sms: int,
) -> LinearConfig:
    """``tile`` ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)`` with its K split: doubled while
    the grid has fewer than ``PROGRAMS_PER_SM * num_sms`` programs (``PROGRAMS_PER_SM_WIDE``
    above 16 rows; a gate-up tile counts twice), each split keeping at least
    :data:`MIN_K_PER_SPLIT` columns (two K steps in the interpreter), the workspace fitting."""
    bm, bn, bk, warps, stages = tile
    min_k = MIN_K_PER_SPLIT if on_gpu else 2 * bk
    if on_gpu and gate_up and stages > 4:  # two weight tiles a stage
        stages = 4
    tiles = _grid_tiles(m, n, bm, bn)
    weight = 2 if gate_up else 1
    per_sm = PROGRAMS_PER_SM if m <= 16 or not on_gpu else PROGRAMS_PER_SM_WIDE
    split = 1
    while (
        split < MAX_SPLIT
        and tiles * split * 2 * weight <= per_sm * num_sms
        and k // (split * 2) >= min_k
        and _split_fits(tiles, split * 2, bm, bn, weight, "cuda" if on_gpu else "cpu")
    ):
        split *= 2
    return LinearConfig(bm, bn, bk, split, warps, stages)


@triton.jit
def _lora_rank(rank_ptr, s):
    """Slot ``s``'s adapter rank; 0 for ``s < 0`` (no adapter: every LoRA load is masked off)."""
    rank = tl.load(rank_ptr + tl.maximum(s, 0))
    return tl.where(s >= 0, rank, 0)


@triton.jit
def _lora_a_tile(a_ptr, s, rank, r, k, k_end, stride_as, stride_ar):
    """``A_s[:, k]`` (``[R, BLOCK_K]``): rows past slot ``s``'s rank and K past ``k_end``
    load as zeros (nothing for ``s < 0``)."""
    a_rows = a_ptr + tl.maximum(s, 0).to(tl.int64) * stride_as + r[:, None] * stride_ar
    return tl.load(a_rows + k[None, :], mask=(r < rank)[:, None] & (k < k_end)[None, :], other=0.0)


@triton.jit
def _lora_shrink_step(
    a_ptr, s, rank, r, k, k_end, xt, h, stride_as, stride_ar,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``h + A_s[:, k] @ xt`` (``[R, BLOCK_M]``, float32): one K step of the LoRA shrink of
    slot ``s`` (:func:`_lora_a_tile`'s tile)."""
    at = _lora_a_tile(a_ptr, s, rank, r, k, k_end, stride_as, stride_ar)
    return _dot(at, xt.to(at.dtype), h, UPCAST, DOT_PRECISION)


@triton.jit
def _lora_b_tile(b_ptr, sb, stride_bn, s, rank, col, n_ok, r):
    """``B_s[col, :]`` (``[BLOCK_N, R]``): columns past slot ``s``'s rank, and rows past N,
    load as zeros."""
    b_rows = b_ptr + tl.maximum(s, 0).to(tl.int64) * sb + col.to(tl.int64)[:, None] * stride_bn
    return tl.load(b_rows + r[None, :], mask=n_ok[:, None] & (r < rank)[None, :], other=0.0)


@triton.jit
def _lora_b_dot(bt, h, slot_m, s):
    """``bt @ h`` over the columns (token rows) of slot ``s``: ``[BLOCK_N, BLOCK_M]`` float32
    (products of float32 copies, IEEE: the delta is not rounded before the epilogue)."""
    hs = tl.where((slot_m == s)[None, :], h, 0.0)
    return tl.dot(bt.to(tl.float32), hs, input_precision="ieee")


@triton.jit
def _lora_row_scale(scale_ptr, slot_m, sl, stride_ss, stride_si):
    """Each token row's ``scaling[slot, slice]`` (0 for a row without an adapter)."""
    scale = tl.load(scale_ptr + tl.maximum(slot_m, 0) * stride_ss + sl * stride_si)
    return tl.where(slot_m >= 0, scale, 0.0)


@triton.jit
def _lora_delta(
    b_ptr, sb, stride_bn, bt0, row_scale, col, n_ok, h, slot_m, s0, others, slots, rank_ptr, r,
):  # fmt: skip
    """The LoRA delta of one slice's column tile, ``scaling[slot] * B_slot[col, :] @ h`` per
    token row (``[BLOCK_N, BLOCK_M]`` float32; zero for rows without an adapter): the lead
    slot ``s0`` from its B tile ``bt0`` (loaded before the PDL wait), then, where the tile
    holds ``others``, every other slot present; ``row_scale`` from :func:`_lora_row_scale`."""
    delta = _lora_b_dot(bt0, h, slot_m, s0)
    if others > 0:
        for s in range(0, slots):
            here = tl.sum((slot_m == s).to(tl.int32), axis=0)
            if (here > 0) & (s != s0):
                bt = _lora_b_tile(b_ptr, sb, stride_bn, s, _lora_rank(rank_ptr, s), col, n_ok, r)
                delta += _lora_b_dot(bt, h, slot_m, s)
    return delta * row_scale[None, :]


@triton.jit
def _shrink_for_next(
    y, n, m, M, N, slot_m, s0, rank0, r, next_a0, next_a1, next_a2, next_as, next_ar,
    next_ws_ptr, next_ws_stride, NEXT: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """This tile's part of the next projection's LoRA shrink: for each of its ``NEXT`` slices
    ``j``, ``A'_j[s0][:, n] @ y`` (``y``: this tile of the output as stored, which is that
    projection's input, columns ``n`` of its K) added into ``next_ws[m, j * R + r]`` (float32,
    zeroed once a step by the adapter plugin), for the rows of the tile's lead slot ``s0``;
    the next projection reads the sums instead of computing its shrink (``H_IN``)."""
    rows_ok = (m < M) & (slot_m == s0)  # no adapter in the tile (s0 -1): rank0 0, none added
    ws_rows = next_ws_ptr + m.to(tl.int64)[None, :] * next_ws_stride
    for j in tl.static_range(NEXT):
        a_g = _pick(next_a0, next_a1, next_a2, j)
        at = _lora_a_tile(a_g, s0, rank0, r, n, N, next_as, next_ar)  # [R, BLOCK_N]
        part = _dot(at, y.to(at.dtype), tl.zeros([R, BLOCK_M], tl.float32), UPCAST, DOT_PRECISION)
        tl.atomic_add(
            ws_rows + (j * R + r)[:, None], part, mask=(r < rank0)[:, None] & rows_ok[None, :]
        )


@triton.jit
def _h_from_producer(h_in_ptr, h_in_stride, m, M, sl, r, R: tl.constexpr):
    """Slice ``sl``'s shrink of each row, as the projection before this one summed it
    (:func:`_shrink_for_next`): ``[R, BLOCK_M]`` float32."""
    rows = h_in_ptr + m.to(tl.int64)[None, :] * h_in_stride + (sl * R + r)[:, None]
    return tl.load(rows, mask=(m < M)[None, :], other=0.0)


@triton.jit
def _shrink_chunk(
    x_cols, a_ptr, s, rank, r, kk, j, K, stride_as, stride_ar,
    STEPS: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Chunk ``j`` of the shared shrink of slot ``s`` (``A_s[:, k] @ x[:, k]`` over K steps ``j
    * STEPS ..``, ``[R, BLOCK_M]`` float32): its producer and a consumer that finds it missing
    run this same code, so both get the same bits."""
    h = tl.zeros([R, BLOCK_M], tl.float32)
    for t in tl.static_range(STEPS):
        k = (j * STEPS + t) * BLOCK_K + kk
        xt = _load_k(x_cols + k[:, None], k, K, False, 0)
        h = _lora_shrink_step(a_ptr, s, rank, r, k, K, xt, h, stride_as, stride_ar, UPCAST, DOT_PRECISION)  # fmt: skip
    return h


@triton.jit
def _produce_shared_shrink(
    x_cols, a0, a1, a2, s, rank, r, kk, j, m, M, K, stride_as, stride_ar, hs_ptr, counter,
    events, SLICES: tl.constexpr, STEPS: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program ``j``'s chunk of every slice's shrink into its own partials, then one release on
    the counter (the producers' count in its low bits); the launch's last event zeroes it."""
    cols = tl.arange(0, BLOCK_M)
    for q in tl.static_range(SLICES):
        hq = _shrink_chunk(
            x_cols, _pick(a0, a1, a2, q), s, rank, r, kk, j, K, stride_as, stride_ar, STEPS, R,
            BLOCK_M, BLOCK_K, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        rows = hs_ptr + ((j * SLICES + q) * R + r)[:, None] * BLOCK_M + cols[None, :]
        tl.store(rows, hq, mask=(m < M)[None, :])
    tl.debug_barrier()  # every thread's partial stores before the one thread's release
    before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if before + 1 == events:
        tl.store(counter, 0)


@triton.jit
def _shared_ready(counter, events, CHUNKS: tl.constexpr, CONSUMER: tl.constexpr):
    """A consumer's arrival on the shared shrink's counter: whether every producer's chunk was
    released before it (then acquired); the launch's last event zeroes the counter."""
    before = tl.atomic_add(counter, CONSUMER, sem="acq_rel", scope="gpu")
    if before + CONSUMER == events:
        tl.store(counter, 0)
    tl.debug_barrier()  # the acquire (one thread) before every thread's loads
    return before % CONSUMER == CHUNKS


@triton.jit
def _shared_h(
    ready, x_cols, a_ptr, s, rank, r, kk, sl, m, M, K, stride_as, stride_ar, hs_ptr,
    SLICES: tl.constexpr, CHUNKS: tl.constexpr, STEPS: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Slice ``sl``'s whole shrink, ``[R, BLOCK_M]`` float32: the producers' chunks summed in
    chunk order where all were ``ready``, else every chunk computed here (the same code, the
    same order: the same bits either way; nothing waits for another program)."""
    h = tl.zeros([R, BLOCK_M], tl.float32)
    if ready:  # unrolled: every chunk's load issued before the sums wait for any
        cols = tl.arange(0, BLOCK_M)
        for j in tl.static_range(CHUNKS):
            rows = hs_ptr + ((j * SLICES + sl) * R + r)[:, None] * BLOCK_M + cols[None, :]
            h += tl.load(rows, mask=(m < M)[None, :], other=0.0, cache_modifier=".cg")
    else:
        for j in range(CHUNKS):
            h += _shrink_chunk(
                x_cols, a_ptr, s, rank, r, kk, j, K, stride_as, stride_ar, STEPS, R, BLOCK_M,
                BLOCK_K, UPCAST, DOT_PRECISION,
            )  # fmt: skip
    return h


@triton.jit
def _consume_shared_shrink(
    x_cols, a_g, a_up, s0, rank0, r, kk, sl, m, M, K, stride_as, stride_ar, hs_ptr, counter,
    events, slot_m, GATE_UP: tl.constexpr, SLICES: tl.constexpr, CHUNKS: tl.constexpr,
    STEPS: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, CONSUMER: tl.constexpr,
):  # fmt: skip
    """The tile's ``h`` (and gate-up's ``h_u``) from the shared shrink, on the rows of its lead
    slot ``s0``: one arrival on the counter, then :func:`_shared_h` for each slice it needs."""
    ready = _shared_ready(counter, events, CHUNKS, CONSUMER)
    h = _shared_h(
        ready, x_cols, a_g, s0, rank0, r, kk, sl, m, M, K, stride_as, stride_ar, hs_ptr, SLICES,
        CHUNKS, STEPS, R, BLOCK_M, BLOCK_K, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    h = tl.where((slot_m == s0)[None, :], h, 0.0)
    h_u = h
    if GATE_UP:
        h_u = _shared_h(
            ready, x_cols, a_up, s0, rank0, r, kk, 1, m, M, K, stride_as, stride_ar, hs_ptr,
            SLICES, CHUNKS, STEPS, R, BLOCK_M, BLOCK_K, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        h_u = tl.where((slot_m == s0)[None, :], h_u, 0.0)
    return h, h_u


@triton.jit(do_not_specialize=["M"])
def _fused_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    ws_ptr,
    sq_ptr,
    counters_ptr,
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    h_ws_ptr,
    lora_a0,
    lora_a1,
    lora_a2,
    lora_b0,
    lora_b1,
    lora_b2,
    lora_sb0,
    lora_sb1,
    lora_sb2,
    lora_end0,
    lora_end1,
    lora_slot_ptr,
    lora_rank_ptr,
    lora_scale_ptr,
    lora_ss,
    lora_si,
    lora_slots,
    stride_as,
    stride_ar,
    stride_bn,
    next_a0,
    next_a1,
    next_a2,
    next_as,
    next_ar,
    next_ws_ptr,
    next_ws_stride,
    h_in_ptr,
    h_in_stride,
    hs_ptr,
    hs_counter,
    hs_events,
    NORM: tl.constexpr,
    GATE_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    LORA: tl.constexpr,
    R: tl.constexpr,
    NEXT: tl.constexpr,
    H_IN: tl.constexpr,
    IN_LOOP: tl.constexpr,
    SHARED: tl.constexpr,
    SLICES: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNK_STEPS: tl.constexpr,
    CONSUMER: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # row tiles fastest: the programs of one column tile's row tiles run side by side, so its
    # weight tile streams from HBM once and the others read it from L2 (module docstring)
    tile = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = tile % m_tiles
    pid_n = tile // m_tiles
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    if SPLIT_K == 1:
        k_begin = 0
        k_end = K
    else:
        per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_begin = split * per_split
        k_end = tl.minimum(k_begin + per_split, K)
    # rows past N (M) read the last row: unmasked loads, masked store
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + tl.minimum(m, M - 1).to(tl.int64)[None, :] * stride_xm
    k = k_begin + kk
    # the first weight tile(s) before the wait: they do not depend on the previous kernel
    w = _load_k(w_rows + k[None, :], k, k_end, EVEN_K, 1)
    u = w
    if GATE_UP:
        u = _load_k(w_rows + N * stride_wn + k[None, :], k, k_end, EVEN_K, 1)
    # LoRA (module docstring): the rows' slots, the tile's lead slot s0, its first A tile(s),
    # its B tile(s) and the rows' scaling, before the wait too: the runner writes slot_of_row
    # before the step's first kernel and the adapters' tensors before the step
    r = tl.arange(0, R)
    slot_m = tl.full([BLOCK_M], -1, tl.int32)
    s0 = -1
    rank0 = 0
    sl = 0
    a_g = lora_a0
    b_g = lora_b0
    sb_g = lora_sb0
    col = n
    lora_dt = x_ptr.dtype.element_ty
    at0 = tl.zeros([R, BLOCK_K], lora_dt)
    at0_u = at0
    bt0 = tl.zeros([BLOCK_N, R], lora_dt)
    bt0_u = bt0
    scale_m = tl.zeros([BLOCK_M], tl.float32)
    scale_m_u = scale_m
    if LORA:
        slot_m = tl.load(lora_slot_ptr + m, mask=m < M, other=-1)
        slot_m = tl.where((slot_m >= 0) & (slot_m < lora_slots), slot_m, -1)
        s0 = tl.max(slot_m, axis=0)
        rank0 = _lora_rank(lora_rank_ptr, s0)
        if not GATE_UP:  # the slice of this column tile (q, k or v), its A and its columns
            first = pid_n * BLOCK_N
            sl = (first >= lora_end0).to(tl.int32) + (first >= lora_end1).to(tl.int32)
            a_g = _pick(lora_a0, lora_a1, lora_a2, sl)
            b_g = _pick(lora_b0, lora_b1, lora_b2, sl)
            sb_g = tl.where(sl == 0, lora_sb0, tl.where(sl == 1, lora_sb1, lora_sb2))
            col = n - tl.where(sl == 0, 0, tl.where(sl == 1, lora_end0, lora_end1))
        if IN_LOOP:
            at0 = _lora_a_tile(a_g, s0, rank0, r, k, k_end, stride_as, stride_ar)
        bt0 = _lora_b_tile(b_g, sb_g, stride_bn, s0, rank0, col, n < N, r)
        scale_m = _lora_row_scale(lora_scale_ptr, slot_m, sl, lora_ss, lora_si)
        if GATE_UP:
            if IN_LOOP:
                at0_u = _lora_a_tile(lora_a1, s0, rank0, r, k, k_end, stride_as, stride_ar)
            bt0_u = _lora_b_tile(lora_b1, lora_sb1, stride_bn, s0, rank0, n, n < N, r)
            scale_m_u = _lora_row_scale(lora_scale_ptr, slot_m, 1, lora_ss, lora_si)
    _pdl.wait(PDL)
    if SHARED:  # the first CHUNKS programs each compute one chunk of the shrink, first of all
        producer = tile + split * tl.num_programs(0)
        if producer < CHUNKS:
            _produce_shared_shrink(
                x_cols, lora_a0, lora_a1, lora_a2, s0, rank0, r, kk, producer, m, M, K,
                stride_as, stride_ar, hs_ptr, hs_counter, hs_events, SLICES, CHUNK_STEPS, R,
                BLOCK_M, BLOCK_K, UPCAST, DOT_PRECISION,
            )  # fmt: skip
    xt = _load_k(x_cols + k[:, None], k, k_end, EVEN_K, 0)  # [BLOCK_K, BLOCK_M]
    zero = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc, acc_u, sq = _k_product(
        w, u, xt, zero, zero, tl.zeros([BLOCK_M], tl.float32), GATE_UP, NORM, UPCAST,
        DOT_PRECISION,
    )  # fmt: skip
    # LoRA (module docstring): the shrink of the tile's lead slot s0 rides in the K loop
    h = tl.zeros([R, BLOCK_M], tl.float32)
    h_u = h
    if IN_LOOP:
        h = _dot(at0, xt.to(at0.dtype), h, UPCAST, DOT_PRECISION)
        if GATE_UP:
            h_u = _dot(at0_u, xt.to(at0_u.dtype), h_u, UPCAST, DOT_PRECISION)
    for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
        k = k0 + kk
        acc, acc_u, sq, xt = _k_step(
            w_rows, x_cols, k, k_end, acc, acc_u, sq, N, stride_wn, GATE_UP, NORM, EVEN_K,
            UPCAST, DOT_PRECISION,
        )  # fmt: skip
        if IN_LOOP:
            h = _lora_shrink_step(a_g, s0, rank0, r, k, k_end, xt, h, stride_as, stride_ar, UPCAST, DOT_PRECISION)  # fmt: skip
            if GATE_UP:
                h_u = _lora_shrink_step(lora_a1, s0, rank0, r, k, k_end, xt, h_u, stride_as, stride_ar, UPCAST, DOT_PRECISION)  # fmt: skip
    others = 0
    if LORA:
        if H_IN:  # the projection before summed this shrink (_shrink_for_next): after the wait
            h = _h_from_producer(h_in_ptr, h_in_stride, m, M, sl, r, R)
            if GATE_UP:
                h_u = _h_from_producer(h_in_ptr, h_in_stride, m, M, 1, r, R)
        h = tl.where((slot_m == s0)[None, :], h, 0.0)
        h_u = tl.where((slot_m == s0)[None, :], h_u, 0.0)
        others = tl.sum(((slot_m >= 0) & (slot_m != s0)).to(tl.int32), axis=0)
        if others > 0:  # a tile of several adapters: one more pass over K for each other slot
            for s in range(0, lora_slots):
                here = tl.sum((slot_m == s).to(tl.int32), axis=0)
                if (here > 0) & (s != s0):
                    rank_s = _lora_rank(lora_rank_ptr, s)
                    hs = tl.zeros([R, BLOCK_M], tl.float32)
                    hs_u = hs
                    for k1 in range(k_begin, k_end, BLOCK_K):
                        k = k1 + kk
                        xt = _load_k(x_cols + k[:, None], k, k_end, EVEN_K, 0)
                        hs = _lora_shrink_step(a_g, s, rank_s, r, k, k_end, xt, hs, stride_as, stride_ar, UPCAST, DOT_PRECISION)  # fmt: skip
                        if GATE_UP:
                            hs_u = _lora_shrink_step(lora_a1, s, rank_s, r, k, k_end, xt, hs_u, stride_as, stride_ar, UPCAST, DOT_PRECISION)  # fmt: skip
                    h += tl.where((slot_m == s)[None, :], hs, 0.0)
                    h_u += tl.where((slot_m == s)[None, :], hs_u, 0.0)
    _pdl.launch_dependents(PDL)

    if SPLIT_K == 1:
        if SHARED:
            h, h_u = _consume_shared_shrink(
                x_cols, a_g, lora_a1, s0, rank0, r, kk, sl, m, M, K, stride_as, stride_ar,
                hs_ptr, hs_counter, hs_events, slot_m, GATE_UP, SLICES, CHUNKS, CHUNK_STEPS, R,
                BLOCK_M, BLOCK_K, UPCAST, DOT_PRECISION, CONSUMER,
            )  # fmt: skip
        if LORA:
            acc += _lora_delta(b_g, sb_g, stride_bn, bt0, scale_m, col, n < N, h, slot_m, s0, others, lora_slots, lora_rank_ptr, r)  # fmt: skip
            if GATE_UP:
                acc_u += _lora_delta(lora_b1, lora_sb1, stride_bn, bt0_u, scale_m_u, n, n < N, h_u, slot_m, s0, others, lora_slots, lora_rank_ptr, r)  # fmt: skip
        y = _epilogue(
            acc, acc_u, sq, n, m, M, N, K, eps, bias_ptr, res_ptr, out_ptr, stride_rm, stride_om,
            NORM, GATE_UP, HAS_BIAS, RESIDUAL,
        )  # fmt: skip
        if NEXT > 0:
            _shrink_for_next(
                y, n, m, M, N, slot_m, s0, rank0, r, next_a0, next_a1, next_a2, next_as,
                next_ar, next_ws_ptr, next_ws_stride, NEXT, R, BLOCK_M, UPCAST, DOT_PRECISION,
            )  # fmt: skip
    else:
        # this split's partials into its own slot (tile, split); the last to arrive sums them
        ACCS: tl.constexpr = 2 if GATE_UP else 1
        HTILE: tl.constexpr = R * BLOCK_M
        h_offs = r[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        slot = tile * SPLIT_K + split
        _store_part(ws_ptr, sq_ptr, slot, acc, acc_u, sq, GATE_UP, NORM, BLOCK_N, BLOCK_M)
        if IN_LOOP:  # with H_IN every split holds the whole h already, SHARED none
            tl.store(h_ws_ptr + slot * (ACCS * HTILE) + h_offs, h)
            if GATE_UP:
                tl.store(h_ws_ptr + slot * (ACCS * HTILE) + HTILE + h_offs, h_u)
        # every thread's partial stores before the one thread's release (module docstring)
        tl.debug_barrier()
        counter = counters_ptr + tile
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this tile: every partial is visible
            tl.debug_barrier()  # the acquire (one thread) before every thread's loads
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            sq = tl.zeros([BLOCK_M], tl.float32)
            h_sum = tl.zeros([R, BLOCK_M], tl.float32)
            h_u_sum = h_sum
            for s in tl.static_range(SPLIT_K):  # split order: the bits do not depend on arrival
                acc, acc_u, sq = _add_part(
                    ws_ptr, sq_ptr, tile * SPLIT_K + s, acc, acc_u, sq, GATE_UP, NORM, BLOCK_N,
                    BLOCK_M,
                )  # fmt: skip
                if IN_LOOP:
                    h_base = (tile * SPLIT_K + s) * (ACCS * HTILE)
                    h_sum += tl.load(h_ws_ptr + h_base + h_offs, cache_modifier=".cg")
                    if GATE_UP:
                        h_u_sum += tl.load(h_ws_ptr + h_base + HTILE + h_offs, cache_modifier=".cg")
            if IN_LOOP:
                h = h_sum
                h_u = h_u_sum
            if SHARED:
                h, h_u = _consume_shared_shrink(
                    x_cols, a_g, lora_a1, s0, rank0, r, kk, sl, m, M, K, stride_as, stride_ar,
                    hs_ptr, hs_counter, hs_events, slot_m, GATE_UP, SLICES, CHUNKS, CHUNK_STEPS, R,
                    BLOCK_M, BLOCK_K, UPCAST, DOT_PRECISION, CONSUMER,
                )  # fmt: skip
            if LORA:
                acc += _lora_delta(b_g, sb_g, stride_bn, bt0, scale_m, col, n < N, h, slot_m, s0, others, lora_slots, lora_rank_ptr, r)  # fmt: skip
                if GATE_UP:
                    acc_u += _lora_delta(lora_b1, lora_sb1, stride_bn, bt0_u, scale_m_u, n, n < N, h_u, slot_m, s0, others, lora_slots, lora_rank_ptr, r)  # fmt: skip
            y = _epilogue(
                acc, acc_u, sq, n, m, M, N, K, eps, bias_ptr, res_ptr, out_ptr, stride_rm,
                stride_om, NORM, GATE_UP, HAS_BIAS, RESIDUAL,
            )  # fmt: skip
            if NEXT > 0:
                _shrink_for_next(
                    y, n, m, M, N, slot_m, s0, rank0, r, next_a0, next_a1, next_a2, next_as,
                    next_ar, next_ws_ptr, next_ws_stride, NEXT, R, BLOCK_M, UPCAST, DOT_PRECISION,
                )  # fmt: skip
            tl.store(counter, 0)  # zero again for the next launch (or graph replay)


def num_sms(device: torch.device) -> int:
    """The SMs of `device` (4 off the GPU, where the interpreter runs)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def lora_fits(lora: ProjectionLoRA, gate_up: bool, block_n: int) -> bool:
    """Whether ``lora``'s slices suit a launch with ``block_n``-column tiles: gate-up takes
    exactly two (gate, up), any other projection one to three whose boundaries fall on
    tile borders (so that a tile's columns belong to one slice)."""
    if gate_up:
        return len(lora.A) == 2
    ends = [0]
    for b in lora.B:
        ends.append(ends[-1] + b.shape[1])
    return 1 <= len(lora.A) <= MAX_LORA_SLICES and all(e % block_n == 0 for e in ends[1:-1])


def _lora_args(
    lora: ProjectionLoRA | None, x: torch.Tensor, n_out: int, gate_up: bool, block_n: int
) -> tuple[list, int]:
    """The kernel's LoRA arguments (placeholders without one) and the padded rank."""
    if lora is None:
        none = [x] * 6 + [0] * 5 + [x] * 3 + [0] * 6
        return none, 16
    assert len(lora.A) == len(lora.B), "one A and one B per slice"
    assert lora_fits(lora, gate_up, block_n), (
        f"LoRA slices {[b.shape[1] for b in lora.B]} do not fit {block_n}-column tiles"
    )
    slots, rank_max, k = lora.A[0].shape
    for a, b in zip(lora.A, lora.B, strict=True):
        assert a.shape == (slots, rank_max, k) and a.is_contiguous() and a.dtype == x.dtype
        assert b.dim() == 3 and b.shape[0] == slots and b.shape[2] == rank_max
        assert b.is_contiguous() and b.dtype == x.dtype
    assert k == x.shape[1], f"LoRA A takes K={k}, x has {x.shape[1]}"
    widths = [b.shape[1] for b in lora.B]
    assert (widths == [n_out, n_out]) if gate_up else sum(widths) == n_out, (
        f"LoRA B widths {widths} do not cover the {n_out} output columns"
    )
    slots_t, scaling, ranks = lora.slot_of_row, lora.scaling, lora.ranks
    assert slots_t.dtype == torch.int32 and slots_t.shape[0] >= x.shape[0], (
        "slot_of_row: [>= M] int32"
    )
    assert scaling.dtype == torch.float32 and scaling.shape[0] == slots, "scaling: [slots] float32"
    assert ranks.dtype == torch.int32 and ranks.shape == (slots,), "ranks: [slots] int32"
    pad = MAX_LORA_SLICES - len(lora.A)
    a = list(lora.A) + [lora.A[0]] * pad
    b = list(lora.B) + [lora.B[0]] * pad
    ends = [widths[0], widths[0] + (widths[1] if len(widths) > 1 else 0)]
    stride_si = scaling.stride(1) if scaling.dim() == 2 else 0
    args = [*a, *b, *(t.stride(0) for t in b), *ends, slots_t, ranks, scaling]
    args += [scaling.stride(0), stride_si, slots, a[0].stride(0), a[0].stride(1), b[0].stride(1)]
    return args, lora_rank_pad(rank_max)


def _check_h_in(lora: ProjectionLoRA, rows: int, rank_pad: int) -> torch.Tensor:
    """``lora.h_in``, checked: float32 rows of every slice's padded rank, at least ``rows``."""
    ws = lora.h_in
    assert ws is not None, "the projection has no h_in workspace (lora.shrink_before)"
    assert ws.dtype == torch.float32 and ws.stride(1) == 1 and ws.shape[0] >= rows
    assert ws.shape[1] >= len(lora.A) * rank_pad, "h_in holds every slice's rank"
    return ws


def _next_args(
    next_lora: ProjectionLoRA | None,
    lora: ProjectionLoRA | None,
    x: torch.Tensor,
    n_out: int,
    rank_pad: int,
) -> tuple[list, int]:
    """The kernel's arguments for the next projection's shrink (:func:`_shrink_for_next`;
    placeholders without one) and its number of slices; ``rank_pad``: this projection's
    padded rank, which the next one shares."""
    if next_lora is None:
        return [x] * 3 + [0, 0, x, 0], 0
    assert lora is not None, "next_lora= needs this projection's lora= (the rows' slots)"
    assert next_lora.slot_of_row is lora.slot_of_row and next_lora.ranks is lora.ranks, (
        "both projections read one adapter plugin's slots"
    )
    a = list(next_lora.A)
    slots, rank_max, k = a[0].shape
    assert k == n_out, f"the next projection's A takes K={k}, this one writes {n_out} columns"
    assert rank_max == lora.A[0].shape[1], "both projections pad to one rank"
    for t in a:
        assert t.shape == a[0].shape and t.is_contiguous() and t.dtype == x.dtype
    ws = _check_h_in(next_lora, x.shape[0], rank_pad)
    pad = [a[0]] * (MAX_LORA_SLICES - len(a))
    return [*a, *pad, a[0].stride(0), a[0].stride(1), ws, ws.stride(0)], len(a)


class SharedShrink(NamedTuple):
    """A launch's shared shrink: on, the slices each producer computes, the producers
    (chunks of K) and the K steps of each."""

    on: bool
    slices: int
    chunks: int
    steps: int


NO_SHARED_SHRINK = SharedShrink(False, 1, 1, 1)


def _shared_shrink(
    config: LinearConfig,
    lora: ProjectionLoRA | None,
    m: int,
    k: int,
    gate_up: bool,
    rank_pad: int,
    grid: tuple[int, int],
    h_in: bool,
    ws: SplitWorkspace,
) -> SharedShrink:
    """How a launch with ``config`` shares its LoRA's shrink (module docstring, "One shrink
    for every program"): only where the config asks, with a LoRA whose shrink is not read
    from ``h_in``, and where every tile holds at most one adapter (one row tile, and one row
    or one slot); the K steps cut into at most :data:`SHARED_MAX_CHUNKS` chunks, no more
    than the launch's programs, each one program's; off where their partials would not fit."""
    if not config.shared_shrink or lora is None or h_in or m > config.block_m:
        return NO_SHARED_SHRINK
    if m > 1 and lora.A[0].shape[0] > 1:  # a tile of several adapters: the K loop's way
        return NO_SHARED_SHRINK
    steps_total = cdiv(k, config.block_k)
    steps = cdiv(steps_total, min(SHARED_MAX_CHUNKS, grid[0] * grid[1]))
    chunks = cdiv(steps_total, steps)
    slices = 2 if gate_up else len(lora.A)
    if chunks * slices * rank_pad * config.block_m > ws.shrink_partials.numel():
        return NO_SHARED_SHRINK
    return SharedShrink(True, slices, chunks, steps)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    n_out: int,
    eps: float | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    gate_up: bool,
    config: LinearConfig | None,
    pdl_on: bool | None,
    lora: ProjectionLoRA | None = None,
    next_lora: ProjectionLoRA | None = None,
    h_in: bool = False,
) -> torch.Tensor:
    """Checks, the config, the workspace and the launch shared by the three ops."""
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K] and weight [N, K]"
    m, k = x.shape
    assert weight.shape[1] == k, f"weight {tuple(weight.shape)} does not take K={k}"
    assert weight.dtype == x.dtype, f"weight {weight.dtype} and x {x.dtype} differ"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if bias is not None:
        assert bias.shape == (weight.shape[0],), "bias has one entry per weight row"
        bias = bias.contiguous()
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == (m, n_out), "residual must be [M, N]"
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    if m == 0 or n_out == 0:
        return out
    on_gpu = x.device.type == "cuda"
    if config is None:
        config = choose_config(m, n_out, k, x.dtype, gate_up, on_gpu, num_sms(x.device))
    use_pdl = _pdl.enabled(x.device, pdl_on)
    ws = workspace(x.device)
    if config.stream_k and lora is None and next_lora is None and not h_in:
        if stream_k.launch(
            x, weight, bias, residual, out, eps, gate_up, config, ws.partials, ws.counters, use_pdl
        ):
            return out
    lora_args, rank_pad = _lora_args(lora, x, n_out, gate_up, config.block_n)
    next_args, next_slices = _next_args(next_lora, lora, x, n_out, rank_pad)
    if h_in:
        assert lora is not None, "h_in needs lora="
        ws_in = _check_h_in(lora, m, rank_pad)
        h_in_args = [ws_in, ws_in.stride(0)]
    else:
        h_in_args = [out, 0]
    if lora is not None and config.split_k > 1:  # the h partials beside: the split that fits
        kind = "cuda" if on_gpu else "cpu"
        config = fit_lora_split(config, m, n_out, k, gate_up, rank_pad, kind)
    bm, bn, bk, split, warps, stages = config[:6]
    grid = (cdiv(n_out, bn) * cdiv(m, bm), split)
    shared = _shared_shrink(config, lora, m, k, gate_up, rank_pad, grid, h_in, ws)
    if split > 1:
        tiles = grid[0]
        accs = 2 if gate_up else 1
        h_floats = accs * rank_pad * bm if lora is not None else 0
        need = tiles * split * (accs * bn * bm + bm + h_floats)
        assert need <= ws.partials.numel() and tiles <= ws.counters.numel(), (
            f"split-K workspace too small for {config} at M={m}, N={n_out}"
        )
        parts = ws.partials
        sq = ws.partials[tiles * split * accs * bn * bm :]
        h_ws = sq[tiles * split * bm :]
    else:
        parts = sq = h_ws = out  # unused
    _fused_linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else out,  # any pointer when unused
        residual if residual is not None else out,
        out,
        parts,
        sq,
        ws.counters,
        m,
        n_out,
        k,
        eps if eps is not None else 0.0,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        h_ws,
        *lora_args,
        *next_args,
        *h_in_args,
        ws.shrink_partials,
        ws.shrink_counter,
        shared.chunks + grid[0] * SHARED_CONSUMER,  # the launch's events on the counter
        NORM=eps is not None,
        GATE_UP=gate_up,
        HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None,
        LORA=lora is not None,
        R=rank_pad,
        NEXT=next_slices,
        H_IN=h_in,
        IN_LOOP=lora is not None and not h_in and not shared.on,
        SHARED=shared.on,
        SLICES=shared.slices,
        CHUNKS=shared.chunks,
        CHUNK_STEPS=shared.steps,
        CONSUMER=SHARED_CONSUMER,
        SPLIT_K=split,
        EVEN_K=k % (split * bk) == 0,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=not on_gpu and x.dtype != torch.float32,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=use_pdl,
        num_warps=warps,
        num_stages=stages,
        **_pdl.launch_kwargs(use_pdl),
    )
    return out


def norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float | None,
    bias: torch.Tensor | None = None,
    *,
    config: LinearConfig | None = None,
    pdl: bool | None = None,
    lora: ProjectionLoRA | None = None,
    h_in: bool = False,
) -> torch.Tensor:
    """``rstd(x)[:, None] * (x @ weight.T) (+ bias)``, one kernel; returns a fresh ``[M, N]``.

    ``x [M, K]`` is the un-normalized residual stream, ``weight [N, K]`` has the RMSNorm
    gain folded in; ``rstd = 1 / sqrt(mean(x.float() ** 2) + eps)`` over all of K, from the
    GEMM's own loads (``eps=None``: no norm, a plain GEMM). ``config``: a launch shape
    (default :func:`choose_config`); ``pdl``: programmatic dependent launch (default: where
    the GPU and Triton support it, :mod:`.pdl`); ``lora``: a LoRA delta added inside
    (:class:`ProjectionLoRA`; before the row scale, so its A carries the norm's gain too);
    ``h_in``: its shrink read from ``lora.h_in``, where the projection before summed it
    (``next_lora=`` of :func:`linear_residual`), not computed here.
    """
    return _launch(
        x, weight, weight.shape[0], eps, bias, None, False, config, pdl, lora, None, h_in
    )


def norm_gate_up(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float | None,
    bias: torch.Tensor | None = None,
    *,
    config: LinearConfig | None = None,
    pdl: bool | None = None,
    lora: ProjectionLoRA | None = None,
    next_lora: ProjectionLoRA | None = None,
    h_in: bool = False,
) -> torch.Tensor:
    """``silu(g) * u`` of the (normed) merged gate-up projection, one kernel; returns ``[M, F]``.

    ``weight [2F, K]`` holds the gate rows then the up rows (gain folded), ``bias [2F]``
    likewise; ``g``, ``u`` are :func:`norm_linear`'s outputs for rows ``n`` and ``F + n``,
    kept in float32 until the one rounding. ``eps=None``: no norm. ``lora``: two slices,
    gate then up, each added to its accumulator before the row scale; ``next_lora``, ``h_in``:
    as for :func:`linear_residual` and :func:`norm_linear`.
    """
    assert weight.shape[0] % 2 == 0, "the merged gate-up weight has an even number of rows"
    n_out = weight.shape[0] // 2
    return _launch(x, weight, n_out, eps, bias, None, True, config, pdl, lora, next_lora, h_in)


def linear_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: LinearConfig | None = None,
    pdl: bool | None = None,
    lora: ProjectionLoRA | None = None,
    next_lora: ProjectionLoRA | None = None,
    h_in: bool = False,
) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)`` as a fresh ``[M, N]`` tensor, one rounding (the
    float32 accumulator plus the residual, then the output dtype); ``lora``: a delta
    added before the residual. ``next_lora``: the LoRA of the projection that takes this
    output as its input; its shrink of each row of ``lora``'s lead slot is added into
    ``next_lora.h_in`` (zeroed by the adapter plugin once a step), for that projection to
    read with ``h_in=True`` instead of computing it. ``h_in``: as for :func:`norm_linear`."""
    n_out = weight.shape[0]
    return _launch(
        x, weight, n_out, None, bias, residual, False, config, pdl, lora, next_lora, h_in
    )
