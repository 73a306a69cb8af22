"""``lora``: PEFT LoRA adapters served per request on the base weights, many in one batch.

Selected by ``adapter="lora"`` (vLLM's ``enable_lora=True``). A request names its
adapter with vLLM's :class:`~pitstop.entrypoints.lora_request.LoRARequest`; the adapter folder is read
at ``add_request`` (:mod:`.peft_adapter`, which lists what is refused), held in a host
cache, copied into one of ``max_loras`` device slots when a step needs it, and applied
to each row of that adapter by the kernel ops (:mod:`.slots`); a fused decoder layer
(``fused.layer``) takes each projection's delta inside its own GEMMs instead.

Settings (:class:`LoRASettings`; vLLM's names, top-level keywords and flags):

``max_loras``
    device slots: the most adapters one step runs (default 1, as vLLM).
``max_lora_rank``
    the largest rank served; each slot is allocated at it (default 16, as vLLM).
``max_cpu_loras``
    adapters kept read on the host, LRU (default: ``max_loras``).
``lora.kernel``
    how a projection's delta runs. ``stacked`` (default): the projections of unfused layers
    over ``dense`` weights keep the slots' B as extra columns of the base weight
    (``[W | B']``), and a step of at most 512 rows runs one launch a projection,
    :func:`~pitstop.plugins.kernels.triton_ops.lora_pack.lora_pack` (``[x | h']``, h' the
    rows' scaled rank-r products in their slot's columns), before a base GEMM that adds every
    row's delta itself: no expand launch, for ``max_loras * slices * max_lora_rank`` more
    columns of K in the GEMM. Larger steps (prefill chunks) pack too where the projection's
    N is at least its K (q|k|v, gate|up: the pack's copy of x is the narrower extra pass),
    else run the base GEMM and add the delta by two library GEMMs over the slots the step
    runs (everywhere, CPU too). Fused layers
    (``fused.layer``) and other weight formats take ``shrink_expand``'s way. On an H100
    (2026-12-07, docs/benchmarks.md) ``stacked`` served `nano` over 8 adapters at 0.92x the
    base model, ``shrink_expand`` at 0.78x. ``shrink_expand``: a shrink, split over K where
    the tiles are few, then an expand adding into the output (two launches a projection,
    their float32 workspace zeroed once a step for all of them). ``fused``: one launch,
    :func:`~pitstop.plugins.kernels.triton_ops.lora.lora_add` (slower at every shape
    measured on the H200, 2026-12-05).
``lora.large_steps``
    ``auto`` (that rule), ``pack`` or ``gemms``: how a stacked projection takes a step of
    more than 512 rows.
``lora.overlap``
    with ``lora.kernel=shrink_expand`` (refused with another kernel) on CUDA: a small
    step's shrink (at most 512 rows: decode and what CUDA graphs capture) runs on a second
    stream beside its projection's base GEMM, forked and joined inside the captured graph,
    so that only the expand follows the GEMM (default off until measured on the H200).
"""

from __future__ import annotations

from typing import Any

import attrs

from pitstop.config import EngineConfig
from pitstop.errors import ConfigError
from pitstop.plugin_system.adapter import AdapterContext
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.settings import setting
from pitstop.plugins.adapters.lora.slots import LoRASlots


@attrs.frozen
class LoRASettings:
    """The settings of the ``lora`` adapter plugin."""

    max_loras: int = setting(
        1, type=int, minimum=1, alias="max_loras", help="device slots: most adapters per step"
    )
    max_lora_rank: int = setting(
        16,
        type=int,
        minimum=1,
        alias="max_lora_rank",
        help="largest adapter rank served (each slot's size)",
    )
    max_cpu_loras: int | None = setting(
        None,
        type=int,
        minimum=1,
        optional=True,
        alias="max_cpu_loras",
        help="adapters kept read on the host, LRU (unset: max_loras)",
    )
    kernel: str = setting(
        "stacked",
        type=str,
        choices=("stacked", "shrink_expand", "fused"),
        help="a projection's delta: stacked (default): the slots' B beside the base weight, one "
        "GEMM over [x | h'] adding every row's delta; shrink then expand; or one fused launch",
    )
    pack_split: bool = setting(
        True,
        type=bool,
        help="stacked on CUDA: the pack launch splits K across programs (their sums meet in a "
        "float32 workspace); off: one program a tile runs the whole K",
    )
    large_steps: str = setting(
        "auto",
        type=str,
        choices=("auto", "pack", "gemms"),
        help="stacked: a step over 512 rows (a prefill chunk) packs [x | h'] into the base GEMM "
        "(pack), or adds the delta by two library GEMMs after it (gemms); auto: pack where the "
        "projection's N is at least its K (q|k|v, gate|up)",
    )
    overlap: bool = setting(
        False,
        type=bool,
        help="lora.kernel=shrink_expand on CUDA: a small step's shrinks on a second stream, beside "
        "the base GEMMs (forked and joined inside the CUDA graph); only the expands follow them",
    )
    shrink_before: bool = setting(
        False,
        type=bool,
        help="with fused.layer: each projection's shrink (x A^T) summed in the epilogue of the "
        "Triton GEMM that writes its input (the next layer's QKV in the down GEMM, gate-up in "
        "the O GEMM, down in the gate-up GEMM), where both run in Triton, instead of every "
        "column program of its own GEMM reading the whole of A; off: measured slower on an H100 "
        "(single with one adapter 0.852x its base against 0.895x without it)",
    )


def create_lora(
    config: EngineConfig, context: AdapterContext, *, settings: LoRASettings
) -> LoRASlots:
    """PEFT LoRA adapters in ``max_loras`` device slots, applied per row."""
    if settings.overlap and settings.kernel != "shrink_expand":
        raise ConfigError(
            f"lora.overlap runs the shrinks of lora.kernel=shrink_expand on a second stream; "
            f"lora.kernel={settings.kernel} has none: set lora.kernel=shrink_expand too, or "
            "leave lora.overlap off"
        )
    stacked_only = {
        "lora.large_steps": settings.large_steps != "auto",
        "lora.pack_split": not settings.pack_split,
    }
    for key, set_ in stacked_only.items():
        if set_ and settings.kernel != "stacked":
            raise ConfigError(
                f"{key} shapes lora.kernel=stacked's launches; lora.kernel={settings.kernel} has "
                f"none: leave {key} at its default, or use lora.kernel=stacked"
            )
    cpu = settings.max_cpu_loras if settings.max_cpu_loras is not None else settings.max_loras
    return LoRASlots(
        context,
        settings.max_loras,
        settings.max_lora_rank,
        cpu,
        fused=settings.kernel == "fused",
        overlap=settings.overlap,
        stacked=settings.kernel == "stacked",
        pack_split=settings.pack_split,
        large_steps=settings.large_steps,
        shrink_before=settings.shrink_before,
    )


@hookimpl
def register_adapters(register: Any) -> None:
    """Register the ``lora`` adapter plugin."""
    register("lora", create_lora, settings=LoRASettings)
