"""Shared memory of fused_linear's LoRA launch shapes, compiled ahead of time for sm_90.

Run as a script (``python tests/helpers/sm90_shared.py``) in a process without
``TRITON_INTERPRET``: compiles ``_fused_linear_kernel`` for an H100/H200 (``GPUTarget("cuda",
90, 32)``, no GPU needed) with the constants and the 16-byte alignment the real launch
gives its pointers, strides and sizes (as Triton specializes them at run time), and prints
one JSON line per distinct launch: the op, the shape and the shared memory it needs.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pitstop.plugins.kernels.triton_ops import fused_linear as fl

# the models whose LoRA launch shapes are checked: (hidden, q|k|v width, intermediate)
MODELS = {"qwen3-0.6b": (1024, 4096, 3072), "llama3-8b": (4096, 6144, 14336)}
ROWS = (1, 17, 64, 65)  # row tiles of 16, 32 and 64 rows, then the wide tiles (65..256)
FLOAT_BUFFERS = ("ws_ptr", "sq_ptr", "h_ws_ptr", "lora_scale_ptr", "next_ws_ptr", "h_in_ptr")
FLOAT_BUFFERS += ("hs_ptr",)
INT_BUFFERS = ("counters_ptr", "lora_slot_ptr", "lora_rank_ptr", "hs_counter")
ALIGNED = ("M", "N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om", "stride_as")
ALIGNED += ("stride_ar", "stride_bn", "lora_sb0", "lora_sb1", "lora_sb2", "next_as", "next_ar")
# lora.shrink_before: the next projection's slices whose shrink each op's epilogue sums (the
# down GEMM: the next layer's q|k|v; gate-up: down), the largest epilogue each op can have
NEXT_SLICES = {"qkv": 0, "gate_up": 1, "down": 3}
SLICES = {"qkv": 3, "gate_up": 2, "down": 1}  # the slices a shared shrink's producer computes


def shared_bytes(config: fl.LinearConfig, op: str) -> int:
    """The shared memory one program of ``config`` needs for ``op`` (``qkv``, ``gate_up`` or
    ``down``) with a rank-16 LoRA inside, compiled for sm_90."""
    fn = fl._fused_linear_kernel
    params = list(inspect.signature(fn.fn).parameters)
    consts = _op_consts(config, op) | {
        "LORA": True,
        "R": 16,
        "NEXT": NEXT_SLICES[op],
        "H_IN": False,
        "IN_LOOP": not config.shared_shrink,
        "SHARED": bool(config.shared_shrink),
        "SLICES": SLICES[op],
        "CHUNKS": fl.SHARED_MAX_CHUNKS,
        "CHUNK_STEPS": 2,
        "CONSUMER": fl.SHARED_CONSUMER,
        "SPLIT_K": config.split_k,
    }
    return _compiled_shared(fn, params, consts, config)


def _compiled_shared(fn, params: list[str], consts: dict, config: fl.LinearConfig) -> int:
    """``fn`` compiled for sm_90 with ``consts``, its pointers and :data:`ALIGNED` sizes
    16-byte aligned: the shared memory one program needs."""
    signature = {}
    for p in params:
        if p in consts:
            signature[p] = "constexpr"
        elif p in FLOAT_BUFFERS:
            signature[p] = "*fp32"
        elif p in INT_BUFFERS:
            signature[p] = "*i32"
        elif p.endswith("_ptr") or p.startswith(("lora_a", "lora_b", "next_a")) and p[-1].isdigit():
            signature[p] = "*bf16"
        else:
            signature[p] = "fp32" if p == "eps" else "i32"
    aligned = [p for p in params if signature[p].startswith("*") or p in ALIGNED]
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(params.index(p),): v for p, v in consts.items()},
        attrs={(params.index(p),): [["tt.divisibility", 16]] for p in aligned},
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared


def wide_lora_launches() -> list[tuple[str, fl.LinearConfig]]:
    """Every distinct (op, launch shape) wider or taller than 64, or deeper than 4 stages, or
    with the shrink shared, that the fused layer times with an adapter for :data:`MODELS` at
    :data:`ROWS`, one per K split (it needs no shared memory)."""
    seen: dict[tuple, tuple[str, fl.LinearConfig]] = {}
    for hidden, qkv, inter in MODELS.values():
        ops = {"qkv": (qkv, hidden, False), "gate_up": (inter, hidden, True)}
        ops["down"] = (hidden, inter, False)
        for m in ROWS:
            for op, (n, k, gate_up) in ops.items():
                for c in fl.tile_candidates(m, n, k, torch.bfloat16, gate_up, 132, lora_rank=16):
                    wide = c.block_n > 64 or c.block_m > 64 or c.num_stages > 4
                    if wide or c.shared_shrink:  # down's epilogue sums q|k|v's shrink
                        key = (op, c._replace(split_k=1))
                        seen.setdefault(key, (op, c))
    return list(seen.values())


def stream_k_bytes(config: fl.LinearConfig, op: str) -> int:
    """The shared memory one program of ``config`` under stream-K needs for ``op`` (no LoRA),
    compiled for sm_90."""
    from pitstop.plugins.kernels.triton_ops import fused_linear_stream_k as sk

    fn = sk._stream_k_kernel
    params = list(inspect.signature(fn.fn).parameters)
    return _compiled_shared(fn, params, _op_consts(config, op) | {"PARTS": 3}, config)


def _op_consts(config: fl.LinearConfig, op: str) -> dict:
    """The constants both kernels take for ``op`` and ``config``'s tiles (bf16 on sm_90, PDL)."""
    return {
        "NORM": op != "down",
        "GATE_UP": op == "gate_up",
        "HAS_BIAS": False,
        "RESIDUAL": op == "down",
        "EVEN_K": True,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "UPCAST": False,
        "DOT_PRECISION": "tf32",
        "PDL": True,
    }


def stream_k_launches() -> list[tuple[str, fl.LinearConfig]]:
    """Every distinct (op, stream-K launch shape) the fused layer times without an adapter for
    :data:`MODELS` at 1 and 16 rows."""
    seen: dict[tuple, tuple[str, fl.LinearConfig]] = {}
    for hidden, qkv, inter in MODELS.values():
        ops = {"qkv": (qkv, hidden, False), "gate_up": (inter, hidden, True)}
        ops["down"] = (hidden, inter, False)
        for m in (1, 16):
            for op, (n, k, gate_up) in ops.items():
                for c in fl.tile_candidates(m, n, k, torch.bfloat16, gate_up, 132):
                    if c.stream_k:
                        seen.setdefault((op, c._replace(stream_k=132)), (op, c))
    return list(seen.values())


def _row(launch: tuple[str, fl.LinearConfig]) -> str:
    op, config = launch
    return json.dumps({"op": op, "config": list(config), "shared": shared_bytes(config, op)})


def _stream_k_row(launch: tuple[str, fl.LinearConfig]) -> str:
    op, config = launch
    return json.dumps({"op": op, "config": list(config), "shared": stream_k_bytes(config, op)})


if __name__ == "__main__":  # one process a core: most of a compile is ptxas and LLVM
    stream_k = sys.argv[1:] == ["stream-k"]  # the stream-K kernel's shapes, else LoRA's
    row, launches = (_stream_k_row, stream_k_launches) if stream_k else (_row, wide_lora_launches)
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for line in pool.map(row, launches()):
            print(line)
