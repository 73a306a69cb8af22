"""The fused MoE op's launch shapes: tile configs, the launch plan per batch, and the
autotune with its on-disk cache (no shipped tuning tables).

:class:`MoEConfig` is one launch shape of both grouped GEMMs; :func:`launch_plan` says
which kernels a batch runs (:mod:`.moe` has the kernels); :func:`known_config` gives the
tiles where nothing need be timed (cached, or :func:`heuristic_config` in Triton's
interpreter and inside a CUDA-graph capture), and :func:`autotune` times candidates
(:func:`candidates`, with :func:`.tuning.time_replays`) and caches the winner in
:class:`ConfigCache` (JSON in ``$PITSTOP_CACHE_DIR`` or ``~/.cache/pitstop/moe``, keyed
by the shape bucket, dtype, device name and Triton version). :func:`.moe.choose_config`
ties them to the op's own inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import triton

from pitstop.plugins.kernels.triton_ops import tuning
from pitstop.plugins.kernels.triton_ops.launch_math import cdiv, next_power_of_2
from pitstop.plugins.kernels.triton_ops.moe_routing import counts_needed

logger = logging.getLogger(__name__)


class MoEConfig(NamedTuple):
    """Tile rows (the align block), tile columns, K step, warps and stages of the gate-up
    GEMM, the split-K count (``split_k``, default 1: no split; module doc), and the down
    GEMM's own columns, K step, warps and stages (``down_*``; 0: the gate-up's).

    Both GEMMs read one grouping, so they share ``block_m``; their other tiles differ
    where their shapes do (Qwen3-30B-A3B: the gate-up's ``K`` is H = 2,048 over 2 x 768
    columns, the down's F = 768 over 2,048), so the autotune picks the down's apart
    (:func:`down_candidates`). ``split_k`` is an upper bound: a GEMM whose ``K`` has fewer
    ``BLOCK_K`` chunks, or whose chunks do not divide evenly, runs :func:`effective_split`
    splits, none of them empty.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    down_block_n: int = 0
    down_block_k: int = 0
    down_warps: int = 0
    down_stages: int = 0

    @property
    def down(self) -> MoEConfig:
        """The down GEMM's tiles as a config of their own (the same ``block_m`` and
        ``split_k``)."""
        return MoEConfig(
            self.block_m,
            self.down_block_n or self.block_n,
            self.down_block_k or self.block_k,
            self.down_warps or self.num_warps,
            self.down_stages or self.num_stages,
            self.split_k,
        )

    def with_down(self, down: MoEConfig) -> MoEConfig:
        """This config with ``down``'s columns, K step, warps and stages for the down GEMM."""
        return self._replace(
            down_block_n=down.block_n,
            down_block_k=down.block_k,
            down_warps=down.num_warps,
            down_stages=down.num_stages,
        )


# The autotune's candidates (16-bit activations on a GPU), by rows an expert gets on
# average (T * k / E): small tiles for decode (memory-bound: many programs streaming
# weights), large ones once every expert has a full tile of rows.
#
# Batch 1 of Qwen3-30B-A3B on an H100 (2026-12-06, moe_bench --candidates, each run after a
# 256 MB read: :func:`.tuning.cold_median_ms`): the op 41-42 us with any unsplit tile of 16
# rows and 64 or 128 columns (gate-up 22 us, 50 MB at 2.3 TB/s; down 11.5 us), 45-49 us
# with K split 2 or 4 (the split summed in the gate-up's own launch since 2026-12-06, by the
# last program of a tile, instead of in the down GEMM's loads: splits lost by less, 47
# against 60-121 us on the H200 before) and 45-48 us for 32-row or 32-column tiles; batch 8
# the same order (183 against 191-212 us). So no split is a candidate; ``split_k`` stays
# for ``moe_bench --split``.
ROWS_16 = MoEConfig(16, 64, 128, 4, 4)  # the heuristic's up to 16 rows an expert
ROWS_32 = MoEConfig(32, 64, 128, 4, 4)  # and up to 32
NARROW_DEEP = MoEConfig(16, 32, 256, 4, 3)
FEW_ROWS = (
    MoEConfig(16, 128, 128, 4, 3),
    ROWS_16,
    ROWS_32,
    NARROW_DEEP,
    MoEConfig(16, 16, 128, 4, 4),
)
# Part of every cache key: raised when the kernels, the candidates or their timing change, so
# that a tile cached from older timings is timed again (2: the in-launch split sum, and the
# timing after a read that leaves L2 clean; 3: timed on spread routing, spread_routing; 4: the
# down GEMM's own tiles, down_candidates; 5: DOWN_TILES and the 32 x 128 gate-up tile)
KERNEL_REVISION = 5
# The down GEMM's tiles (columns, K step, warps, stages) that round two also tries with the
# winner's rows, whatever its ``block_m`` (:func:`down_candidates`). On one H200 on
# 2026-12-06 (moe_bench, Qwen3-30B-A3B, the down's K = F = 768 over H = 2,048 columns) the
# down GEMM read its 403 MB at batch 256 in 132 us (71% of copy) in the 32-row winner's own
# 64-column tile, the only one of that height among the candidates, while at batch 64 it read
# 95% of copy in a 16 x 128 x 128 tile: the down's short K wants wide column tiles at any
# height.
DOWN_TILES = ((128, 128, 4, 3), (128, 64, 4, 4), (256, 64, 8, 3), (64, 128, 4, 4))
MANY_ROWS = (
    MoEConfig(64, 64, 64, 4, 3),
    MoEConfig(64, 128, 64, 4, 3),
    MoEConfig(128, 128, 64, 8, 3),
    MoEConfig(128, 64, 64, 4, 3),
    MoEConfig(64, 128, 128, 8, 3),
)
FP32_CONFIGS = (
    MoEConfig(16, 64, 32, 4, 3),
    MoEConfig(32, 64, 32, 4, 3),
    MoEConfig(64, 64, 32, 4, 3),
)
INTERPRETER_CONFIG = MoEConfig(16, 16, 16, 1, 1)  # small: test shapes cross tile borders

# At most this many tokens, the down GEMM runs token-major and sums the k slots itself
# (:func:`launch_plan`)
TOKEN_MAJOR_TOKENS = 4


class LaunchPlan(NamedTuple):
    """Which kernels a :func:`fused_moe` call runs (:func:`launch_plan` decides).

    ``route_with_align``: routing and grouping in one launch
    (:func:`.moe_routing.route_and_align`), else :func:`.moe_routing.route` and
    :func:`.moe_routing.align` (and, past ``ONE_PROGRAM_ROWS`` rows, two memsets);
    ``down_with_slot_sum``: the token-major down GEMM that sums each token's k slots
    itself (:func:`_down_slot_sum_kernel`), else the grouped down GEMM and the slot sum.
    ``early_down`` (one token, where :func:`early_down_columns` is not 0; else ignored):
    the gate-up GEMM lets the down GEMM's programs launch as soon as its own have waited
    for the grouping, and each down program holds its whole weight tile in registers
    before it waits for the gate-up (:func:`.moe._down_early_kernel`), so that the down's
    weight reads overlap the gate-up's instead of following them; the same launches.
    Measured slower on an H100 on 2026-12-07 (Qwen3-30B-A3B, batch 1: 41.6 us against
    40.0, the gate-up 26.5 against 21.1 beside the down's early programs; ``moe-single``
    -1.6%), so :func:`launch_plan` never sets it (``fused.moe_early_down`` does).
    """

    route_with_align: bool
    down_with_slot_sum: bool
    early_down: bool = False

    @property
    def launches(self) -> int:
        """Kernel launches of the op for more than one token: 3 to 5 (not counting the two
        memsets of the routing counters past ``ONE_PROGRAM_ROWS`` rows)."""
        return (1 if self.route_with_align else 2) + 1 + (1 if self.down_with_slot_sum else 2)

    def launches_for(self, num_tokens: int, down_splits: int = 1) -> int:
        """:attr:`launches` for a call of ``num_tokens`` tokens whose grouped down GEMM
        splits its K ``down_splits`` ways (:func:`effective_split` of the config's): one
        fewer for a single token's unsplit grouped down, which sums the slots in its own
        last program (``.moe``)."""
        one_token = num_tokens == 1 and down_splits == 1 and not self.down_with_slot_sum
        return self.launches - (1 if one_token else 0)


# route, align, gate-up, grouped down, slot sum: the five launches of every batch before
GROUPED = LaunchPlan(route_with_align=False, down_with_slot_sum=False)

# Elements of the [F, columns] down-weight tile an early down program holds in registers
# before its wait (16K: 32 KB of bf16, 64 registers a thread of 4 warps), and the columns a
# program takes at most
EARLY_DOWN_ELEMENTS = 1 << 14
EARLY_DOWN_MAX_COLUMNS = 64


def early_down_columns(inter: int) -> int:
    """The columns of ``H`` an early down program takes (:attr:`LaunchPlan.early_down`) for
    experts of ``inter`` (F) intermediate rows: its ``[next_power_of_2(F), columns]`` weight
    tile within :data:`EARLY_DOWN_ELEMENTS`, at most :data:`EARLY_DOWN_MAX_COLUMNS`; 0 where
    fewer than 4 columns fit (F over 4,096: the plan's ordinary down GEMM runs)."""
    columns = min(EARLY_DOWN_ELEMENTS // next_power_of_2(max(inter, 1)), EARLY_DOWN_MAX_COLUMNS)
    return columns if columns >= 4 else 0


def launch_plan(num_tokens: int, top_k: int, config: MoEConfig | None = None) -> LaunchPlan:
    """The kernels a :func:`.moe.fused_moe` call runs when none is named: :data:`GROUPED`
    at every batch (five launches; four for one token, whose down GEMM sums the slots:
    :meth:`LaunchPlan.launches_for`).

    Measured on an H100 on 2026-12-05 (``benchmarks/moe_bench.py``, Qwen3-30B-A3B's
    shape, bf16, each path replayed from a CUDA graph): batch 1, the three launches of
    :func:`fewest_launches` 53.7 us against the grouped path's 50.8; batch 8, its four
    launches 207.9 us against 185.9. Launches chained by programmatic dependent launch
    cost less than the slower kernels that merge them (one program routes and groups
    all rows; the token-major down GEMM reads a token's k experts for that token
    alone), so the fewer-launch paths stay selectable (``plan=``, ``moe_bench``) but are
    not the default. ``num_tokens``, ``top_k`` and ``config`` are kept so that a later
    measurement can move the choice here, the one place that decides.
    """
    del num_tokens, top_k, config
    return GROUPED


def fewest_launches(num_tokens: int, top_k: int) -> LaunchPlan:
    """The fewest kernels that can run ``num_tokens`` tokens at top-``top_k``.

    - Routing and grouping in one launch while one program groups the rows anyway, at
      most :data:`.moe_routing.ONE_PROGRAM_ROWS` flat rows ``T * k`` (``not
      counts_needed``): that program then also routes, and no counts are needed.
    - The down GEMM token-major with the k-slot sum inside, at most
      :data:`TOKEN_MAJOR_TOKENS` (4) tokens (after any gate-up, split or not: both write
      ``h``). It reads each of a
      token's k experts for that token alone, so it reads ``T * k`` expert matrices where
      the grouped GEMM reads the distinct experts hit: the same bytes at batch 1, and at
      most ``T`` times as many (every token picking the same experts).

    Batch 1..4: three launches; up to ``ONE_PROGRAM_ROWS`` rows: four; above: five and two
    memsets. Slower than :data:`GROUPED` where measured (:func:`launch_plan`).
    """
    return LaunchPlan(
        route_with_align=not counts_needed(num_tokens * top_k),
        down_with_slot_sum=num_tokens <= TOKEN_MAJOR_TOKENS,
    )


class TokenMajorTiles(NamedTuple):
    """The token-major down kernel's column tile, K step and warps (:func:`token_major_tiles`)."""

    block_n: int
    block_k: int
    num_warps: int


def token_major_tiles(top_k: int, on_gpu: bool) -> TokenMajorTiles:
    """A fixed rule, not tuned (the kernel is memory-bound at ``T <= 4``): 16 columns a
    program (Qwen3-30B-A3B, H 2048: 128 programs a token, about one per SM at batch 1), a
    K step of up to 128 that keeps the ``[k, 16, BLOCK_K]`` slot tile at 8192 elements
    (top-8: 64; top-2: 128), 8 warps. The interpreter: 16 x 16, 1 warp (test shapes cross
    tile borders)."""
    if not on_gpu:
        return TokenMajorTiles(16, 16, 1)
    k_pad = next_power_of_2(top_k)
    return TokenMajorTiles(16, max(16, min(128, 8192 // (k_pad * 16))), 8)


def bucket_rows(num_tokens: int) -> int:
    """The shape bucket of ``num_tokens``: the next power of two (1 for 0 or 1)."""
    return next_power_of_2(max(num_tokens, 1))


def candidates(
    num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype
) -> list[MoEConfig]:
    """The configs the autotune times for this bucket (:data:`FEW_ROWS` / :data:`MANY_ROWS`)."""
    if dtype == torch.float32:
        return list(FP32_CONFIGS)
    per_expert = bucket_rows(num_tokens) * top_k / num_experts
    if per_expert <= 8:
        return list(FEW_ROWS)
    if per_expert <= 48:
        return [NARROW_DEEP, ROWS_32, MoEConfig(32, 128, 128, 4, 3), *MANY_ROWS[:2]]
    return list(MANY_ROWS)


def down_candidates(
    best: MoEConfig,
    configs: list[MoEConfig],
    down_tiles: Sequence[tuple[int, int, int, int]] = (),
) -> list[MoEConfig]:
    """The configs that differ from ``best`` only in the down GEMM's tiles, one for each
    other tile of ``configs`` with ``best``'s ``block_m`` (the grouping both GEMMs read),
    then one for each of ``down_tiles`` (columns, K step, warps, stages: :data:`DOWN_TILES`
    for 16-bit activations) not among them: what the autotune times second, the gate-up's
    tiles fixed."""
    own = [c._replace(split_k=best.split_k).down for c in configs if c.block_m == best.block_m]
    extra = [MoEConfig(best.block_m, *tiles, split_k=best.split_k) for tiles in down_tiles]
    seen = {best.down}
    out = []
    for tiles in own + extra:
        if tiles not in seen:
            seen.add(tiles)
            out.append(best.with_down(tiles))
    return out


def heuristic_config(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    dtype: torch.dtype,
    on_gpu: bool,
) -> MoEConfig:
    """The config used where no timing is possible and the bucket is not cached.

    Interpreter: :data:`INTERPRETER_CONFIG`. GPU: float32 takes ``FP32_CONFIGS[0]``;
    16-bit takes ``BLOCK_M`` 16 while experts average at most 16 rows, 32 up to 32, then
    64 (``MANY_ROWS[0]``): a tile never much taller than an expert's rows. No split of K
    (measured splits have not yet won on a GPU).
    """
    if not on_gpu:
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return FP32_CONFIGS[0]
    per_expert = bucket_rows(num_tokens) * top_k / num_experts
    if per_expert <= 16:
        return ROWS_16
    if per_expert <= 32:
        return ROWS_32
    return MANY_ROWS[0]


def effective_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(splits, k_per_split)`` of a GEMM over ``k``: ``k``'s ``block_k`` chunks in at most
    ``split_k`` runs of equal length (the last may be shorter), none empty."""
    chunks = cdiv(k, block_k)
    per = cdiv(chunks, max(1, min(split_k, chunks)))
    return cdiv(chunks, per), per * block_k


def cache_dir() -> Path:
    """``$PITSTOP_CACHE_DIR`` (used as is) or ``~/.cache/pitstop/moe``."""
    return tuning.cache_dir("moe")


class ConfigCache:
    """Autotuned configs in memory and in ``<directory>/moe_configs.json`` (a
    :class:`.tuning.JsonStore`: atomic rewrites, an unreadable file counts as empty)."""

    FILE = "moe_configs.json"

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()
        self._store = tuning.JsonStore(self.directory, self.FILE)
        self._memory: dict[str, MoEConfig] = {}

    @staticmethod
    def key(
        num_tokens: int,
        num_experts: int,
        top_k: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        device_name: str,
        triton_version: str = triton.__version__,
        weight_dtype: torch.dtype | None = None,
    ) -> str:
        """``T<bucket>-E-k-H-F|dtype|device name|triton version|kernels <revision>``
        (``dtype`` followed by ``/<weight dtype>`` when the experts are held in another,
        e.g. fp8; :data:`KERNEL_REVISION`: a winner timed on older kernels is not reused)."""
        shape = f"T{bucket_rows(num_tokens)}-E{num_experts}-k{top_k}-H{hidden}-F{inter}"
        types = str(dtype).removeprefix("torch.")
        if weight_dtype is not None and weight_dtype != dtype:
            types += "/" + str(weight_dtype).removeprefix("torch.")
        return f"{shape}|{types}|{device_name}|triton {triton_version}|kernels {KERNEL_REVISION}"

    def get(self, key: str) -> MoEConfig | None:
        """The cached config of ``key`` (memory first, then the file), or None."""
        if key in self._memory:
            return self._memory[key]
        entry = self._store.read().get(key)
        # an entry from before split-K has 5 fields (split_k 1), one from before the down
        # GEMM's own tiles 6 (the gate-up's)
        if isinstance(entry, list) and len(entry) in (5, 6, len(MoEConfig._fields)):
            self._memory[key] = MoEConfig(*(int(v) for v in entry))
            return self._memory[key]
        return None

    def put(self, key: str, config: MoEConfig) -> None:
        """Remember ``config`` for ``key`` in memory and on disk (a failed write is logged)."""
        self._memory[key] = config
        self._store.write(key, list(config))


_default_cache: ConfigCache | None = None


def default_cache() -> ConfigCache:
    """The process's config cache (in memory and on disk), made at the first call."""
    global _default_cache
    if _default_cache is None:
        _default_cache = ConfigCache()
    return _default_cache


_logged: set[str] = set()


def _log_once(reason: str, message: str, *args: object) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.warning(message, *args)


def spread_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    weights_dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing to time tiles on: each token's ``top_k`` experts distinct and drawn uniformly
    (a fixed seed, so every process times the same), weights ``1 / top_k``; ``(weights [T,
    k], ids [T, k] int32)``.

    Not the call's own routing: the first call of a batch size is the runner's warm-up
    before its graph capture, whose rows are all the same token, so all of them pick the
    same ``k`` experts -- ``T`` rows an expert, where served traffic spreads about ``T * k /
    E``, and tiles timed on it are the wrong ones (at batch 256 of Qwen3-30B-A3B a 64-row
    tile, 46% slower than the 32-row one on spread rows: an H100, 2026-12-06).
    """
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, dtype=weights_dtype)
    return weights.to(device), ids.to(device)


def autotune(
    key: str,
    configs: list[MoEConfig],
    measure: Callable[[MoEConfig], float],
    cache: ConfigCache,
    down_tiles: Sequence[tuple[int, int, int, int]] = (),
) -> MoEConfig:
    """The cached config of ``key``, or the fastest of ``configs`` by ``measure`` (seconds or
    any unit; an exception, e.g. too much shared memory, rules a config out), then cached.

    Two rounds: each config with the same tiles in both GEMMs, then the winner with the
    down GEMM's tiles taken from the other configs of its ``block_m`` and from
    ``down_tiles`` (:func:`down_candidates`), kept where faster."""
    hit = cache.get(key)
    if hit is not None:
        return hit
    first = _timings(configs, measure)
    if not first:
        raise RuntimeError(f"fused MoE: no tile configuration runs for {key}")
    best_ms, _, best = min(first)  # the first on a tie
    # the winner itself ranks before its variants (index -1): it keeps a tie
    best = min(
        [(best_ms, -1, best), *_timings(down_candidates(best, configs, down_tiles), measure)]
    )[2]
    logger.info("fused MoE: tuned %s -> %s", key, best)
    cache.put(key, best)
    return best


def _timings(
    configs: list[MoEConfig], measure: Callable[[MoEConfig], float]
) -> list[tuple[float, int, MoEConfig]]:
    """``(time, index, config)`` of each of ``configs`` that runs; one whose run raises is
    skipped and logged."""
    timings: list[tuple[float, int, MoEConfig]] = []
    for i, cfg in enumerate(configs):
        try:
            timings.append((float(measure(cfg)), i, cfg))
        except Exception as err:  # noqa: BLE001 - a config that cannot run is skipped
            logger.info("fused MoE: %s failed to run (%s): skipped", cfg, err)
    return timings


def config_key(x: torch.Tensor, num_tokens: int, top_k: int, gate_up: torch.Tensor) -> str:
    """The cache key of this call's bucket on ``x``'s GPU."""
    e, two_f, h = gate_up.shape
    name = torch.cuda.get_device_name(x.device)
    return ConfigCache.key(
        num_tokens, e, top_k, h, two_f // 2, x.dtype, name, weight_dtype=gate_up.dtype
    )


def known_config(
    x: torch.Tensor,
    num_tokens: int,
    top_k: int,
    gate_up: torch.Tensor,
    cache: ConfigCache | None = None,
) -> MoEConfig | None:
    """The tiles for this call where no timing is needed: cached, else the heuristic in
    Triton's interpreter and while a CUDA graph is being captured (logged once per reason);
    ``None`` where :func:`choose_config` must autotune (a GPU bucket's first eager call)."""
    if cache is None:
        cache = default_cache()
    e = gate_up.shape[0]
    on_gpu = x.device.type == "cuda"
    if not on_gpu:
        _log_once("interpreter", "fused MoE: Triton interpreter, no autotune: heuristic tiles")
        return heuristic_config(num_tokens, e, top_k, x.dtype, False)
    key = config_key(x, num_tokens, top_k, gate_up)
    hit = cache.get(key)
    if hit is not None:
        return hit
    if torch.cuda.is_current_stream_capturing():
        _log_once(
            "capture",
            "fused MoE: %s first seen inside a CUDA graph capture: heuristic tiles, not tuned "
            "(run each batch size once before capturing)",
            key,
        )
        return heuristic_config(num_tokens, e, top_k, x.dtype, True)
    return None
