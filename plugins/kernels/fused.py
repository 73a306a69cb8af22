"""`fused` kernels: Triton kernels for the memory-bound ops, each falling back to `reference`.

Ops and where they run:

- ``rms_norm``: residual add + RMSNorm in one pass (Triton; flag ``fused_rmsnorm``);
  also Qwen3's per-head q/k norm, on the strided q/k views without a copy, when
  ``rope_and_store`` runs the reference;
- ``linear``: always ``torch.nn.functional.linear`` (cuBLAS is the fastest GEMM);
  with ``fused_qkv`` the model concatenates the q/k/v and gate/up weights at
  load (:attr:`FusedKernels.merge_projections`) so each is one GEMM;
- ``silu_and_mul``: one pass over the merged gate-up output (``fused_silu``);
- ``rope_and_store``: rotary embedding plus the K/V cache store in one kernel
  (``fused_attention``), quantizing to an fp8 cache (``kv_cache_dtype``), and
  Qwen3's per-head q/k RMSNorm before the rotation
  (:attr:`FusedKernels.fuses_qk_norm`, set while this op runs Triton: two
  launches fewer per layer);
- ``attention``: split-K flash-decoding for decodes, and GQA-packed varlen
  causal flash attention for prefills, chunks over a cached prefix and
  drafts; both read K/V page-wise through the block table, with tile shapes
  kept in code per head size and GQA ratio (``fused_attention``; see
  :mod:`pitstop.plugins.kernels.triton_ops.paged_attention`);
- ``moe``: a sparse mixture-of-experts block's experts (``fused.moe``): top-k routing in one
  kernel, rows grouped by expert (routing and grouping one launch at decode), a grouped
  gate-up GEMM with SiLU·mul and a grouped down GEMM with the routing weights (at batch
  1..4 a token-major down GEMM that also sums the k slots: three launches in all), tiles
  autotuned once per shape and cached on disk
  (:mod:`pitstop.plugins.kernels.triton_ops.moe`); the reference loop over experts for
  more than 16 experts a token. With ``fused.moe`` off the reference loop runs, which
  reads the experts hit on the host, so decode then runs without CUDA graphs.

Each op is resolved once, when the kernel set is built: to its Triton kernel,
or to the reference op with one log line that names the op and the reason
(config flag off, Triton not importable, no CUDA device and
``TRITON_INTERPRET`` not set, an unsupported dtype, an fp8 KV cache on a GPU
older than compute capability 8.9, where the reference ops' torch casts
run). The head size is only known at the first attention call: an
unsupported one (not a power of two in 16..256) switches ``rope_and_store``
and ``attention`` to the reference once, again with one log line (the
reference ``rope_and_store`` takes the q/k norm too, so a model built while
:attr:`FusedKernels.fuses_qk_norm` was set keeps its results). :meth:`FusedKernels.describe` says what runs where.

Triton is imported lazily, only when the kernel set is built, so that loading
this plugin costs nothing on a machine that never uses it and so that a test
can set ``TRITON_INTERPRET=1`` before the first import.

CUDA graphs (the runner's job): every op is free of host synchronization; the
decode attention grid is ``(num_decodes, Hkv, splits)`` where ``splits``
depends only on ``num_decodes`` and ``max_model_len``, so a graph captured at
one batch size stays valid for any context lengths. Launch arguments baked
into a graph: the tensors' addresses and strides (keep static input buffers,
and a block-table buffer of fixed width), ``num_prefills`` /
``num_prefill_tokens`` (0 in a pure decode batch) and ``page_size``. Padding
rows of a captured batch: give them slot -1 (``rope_and_store`` skips the
store) and context length 0 (attention writes zeros for them).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import attrs
import torch

from pitstop.config import EngineConfig
from pitstop.errors import ConfigError
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.settings import setting
from pitstop.plugins.kernels import reference
from pitstop.plugins.kernels.fused_layer import FusedLayer

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPS = reference.OPS


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` here, or None when they can."""
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
            return "no CUDA device and TRITON_INTERPRET not set"
    elif device.type != "cuda":
        return f"device {device.type!r} is neither CUDA nor CPU"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton not importable ({type(exc).__name__}: {exc})"
    return None


def fp8_unsupported_reason(kv_cache_dtype: str, device: torch.device) -> str | None:
    """Why Triton cannot read or write this fp8 KV cache on ``device``, or None (not fp8, or fine).

    Triton converts to and from fp8 in hardware from compute capability 8.9
    (Ada, Hopper) on; the interpreter emulates the conversions on the CPU.
    """
    if not kv_cache_dtype.startswith("fp8") or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (
            f"kv_cache_dtype={kv_cache_dtype} needs compute capability 8.9 or newer in Triton, "
            f"this GPU has {major}.{minor}"
        )
    return None


def head_size_supported(head_size: int) -> bool:
    """Attention and rotary kernels take a power-of-two head size in 16..256."""
    return 16 <= head_size <= 256 and head_size & (head_size - 1) == 0


def layer_wanted(layer: bool | None, gpu_triton: bool) -> tuple[bool, str]:
    """Whether to fuse the decoder layer, and the reason where not: ``fused.layer`` where
    set; unset, on where its ops run in Triton on a GPU (``gpu_triton``), with or without an
    adapter plugin (since LoRA's stacked packs run inside the layer's cuBLAS steps it is
    faster with adapters too: docs/benchmarks.md, sixteenth session); off on the CPU, where
    the layer's ops are the reference's and no faster."""
    if layer is not None:
        return layer, "config flag fused.layer is off"
    if not gpu_triton:
        return False, "fused.layer unset: its ops would not run in Triton on a GPU"
    return True, ""


@attrs.frozen
class FusedSettings:
    """The settings of the ``fused`` kernel set (``fused.qkv``, or the article's ``fused_qkv``)."""

    rmsnorm: bool = setting(
        True, type=bool, alias="fused_rmsnorm", help="fused residual-add + RMSNorm"
    )
    qkv: bool = setting(
        True, type=bool, alias="fused_qkv", help="merged QKV and gate-up projections"
    )
    silu: bool = setting(True, type=bool, alias="fused_silu", help="fused SiLU-and-mul")
    attention: bool = setting(
        True, type=bool, alias="fused_attention", help="Triton paged attention"
    )
    precision: str = setting(
        "fp32",
        type=str,
        choices=("fp32", "fast"),
        alias="fused_precision",
        help="fp32 accumulation everywhere, or the fastest safe choice",
    )
    fp8_widen: str = setting(
        "fp16",
        type=str,
        choices=("fp16", "query", "qk-fp8"),
        help="how attention reads an fp8 KV cache for bf16 queries: widened to fp16 (one hardware "
        "conversion; the query goes to fp16, pre-scaled by a power of two), to the query's dtype, "
        "or qk-fp8 (e4m3 caches: the query rounded to e4m3 per row, q.k on fp8 tensor cores, V "
        "widened to fp16)",
    )
    decode_merge: str = setting(
        "separate",
        type=str,
        choices=("separate", "last-program"),
        help="how split-K decode merges its splits: a second kernel, or the last split program "
        "to finish (one launch; an arrival counter per sequence and KV head)",
    )
    qk_norm: bool = setting(
        True,
        type=bool,
        help="Qwen3's per-head q/k RMSNorm inside rope_and_store (one launch instead of three); "
        "false: two rms_norm launches first, as before",
    )
    layer: bool | None = setting(
        None,
        type=bool,
        optional=True,
        help="a decoder layer in six ops: each RMSNorm folded into the projection after it (its "
        "gain multiplied into the weight at load), SiLU-and-mul into the gate-up GEMM, the residual "
        "adds into the O and down GEMMs (needs qkv; dense weights, no tensor parallelism). Unset: "
        "on where its ops run in Triton on a GPU and no adapter plugin is selected (LoRA's "
        "stacked packs run the unfused layer faster over several adapters: docs/benchmarks.md), "
        "off elsewhere (on the CPU its ops are the reference's, no faster)",
    )
    layer_rows: int = setting(
        64,
        type=int,
        help="with layer, where nothing is timed (layer_tune off, the CPU): steps of at most this "
        "many rows run the Triton GEMMs (norm, activation and residual inside), longer ones "
        "cuBLAS with the row scale inside rotary and SiLU-and-mul and the residual added in "
        "place (on the H200 a qwen3-0.6b layer's four GEMMs in Triton's 64-row tiles beat "
        "cuBLAS at 16 rows and lost at 64)",
    )
    layer_tune: bool = setting(
        True,
        type=bool,
        help="with layer, on a GPU: time each op's cuBLAS way and Triton launch shapes once per "
        "shape (at the first eager call, on its own inputs; cached on disk) and run the fastest "
        "that matches the reference; false: the layer_rows rule",
    )
    layer_tune_rows: int = setting(
        256,
        type=int,
        help="with layer_tune: the most rows whose choice is timed; longer steps take cuBLAS",
    )
    cudnn_prefill: int = setting(
        2048,
        type=int,
        help="a step whose prefill sequences all have at least this many tokens (a chunk over "
        "cached tokens in a context of 4x this many) attends them with cuDNN's attention (torch "
        "SDPA; bf16/fp16 caches, outside CUDA graphs) instead of the Triton prefill kernel: on "
        "the H200 1.2-1.35x its rate for long prompts and chunks; 0: never",
    )
    moe: bool = setting(
        True,
        type=bool,
        help="the Triton mixture-of-experts op (fused top-k routing, grouped gate-up and down "
        "GEMMs, autotuned tiles cached on disk); false: the reference loop over experts, and no "
        "CUDA graphs",
    )
    moe_router: bool = setting(
        True,
        type=bool,
        help="the Triton MoE op takes the router's weight and, for steps of one or two tokens, "
        "projects, routes and groups in one launch (triton_ops/moe_router.py); false: the "
        "router's logits from the linear op first (three launches), for comparison",
    )
    moe_early_down: bool = setting(
        False,
        type=bool,
        help="decode steps of one token: the MoE op's down GEMM launches as soon as the gate-up "
        "GEMM's programs start and each of its programs holds its whole weight tile before it "
        "waits for the gate-up, so that the down's weight reads overlap the gate-up's (experts "
        "of up to 4,096 intermediate rows); off: measured slower on an H100 (batch 1 41.6 us "
        "against 40.0; moe-single 256.8 against 261.0 tok/s)",
    )
    decode_prefix_share: int = setting(
        0,
        type=int,
        help="decodes that share at least this many tokens of cached pages (a system prompt hit "
        "in the prefix cache, the n samples of one prompt) read those pages once a group a step, "
        "all the group's query heads in one tile, instead of once a sequence; 0: off (refused "
        "with decode_merge=last-program, and with fp8_widen=qk-fp8 over an e4m3 cache); on an "
        "H100 1.5-1.9x a layer's attention at 4-8k shared tokens, 0.74-0.96x at 1k",
    )
    decode_split_tokens: int = setting(
        0,
        type=int,
        help="a decode batch large enough for one split a sequence (about 64 sequences on an "
        "H100) has each context cut into pieces of this many tokens instead (a multiple of the "
        "tile; the pieces past a context's end exit at once, a second kernel merges the rest), "
        "so that ragged contexts do not leave the SMs that drew the longest ones working alone; "
        "0: off (not with decode_merge=last-program or decode_prefix_share)",
    )
    decode_tiles: str = setting(
        "fixed",
        type=str,
        choices=("fixed", "by-batch"),
        help="decode attention's tiles: one per head size, or the H200 sweep's best for the "
        "launch's batch and KV-cache dtype (smaller tiles from 128 decodes, others for fp8)",
    )


def _check_decode_settings(settings: FusedSettings, kv_cache_dtype: str) -> None:
    """Refuse the decode settings that cannot apply together (each would otherwise leave the
    other unused without a word): ``fused.decode_split_tokens`` below zero or beside the
    one-launch merge or the shared pass, the shared pass beside the one-launch merge or
    ``qk-fp8`` over an e4m3 cache."""
    share = settings.decode_prefix_share
    if share and settings.decode_merge == "last-program":
        raise ConfigError(
            "fused.decode_prefix_share merges its shared pass with the separate kernel: not with "
            "fused.decode_merge='last-program'; leave one of them at its default"
        )
    if share and settings.fp8_widen == "qk-fp8" and kv_cache_dtype in ("fp8", "fp8_e4m3"):
        raise ConfigError(
            "fused.decode_prefix_share has no qk-fp8 shared pass: with an e4m3 KV cache leave "
            "fused.fp8_widen at 'fp16' or fused.decode_prefix_share at 0"
        )
    tokens = settings.decode_split_tokens
    if tokens < 0:
        raise ConfigError(f"fused.decode_split_tokens must be >= 0 (0: off), not {tokens}")
    if tokens and settings.decode_merge == "last-program":
        raise ConfigError(
            "fused.decode_split_tokens merges its pieces with the separate kernel: not with "
            "fused.decode_merge='last-program'; leave one of them at its default"
        )
    if tokens and settings.decode_prefix_share:
        raise ConfigError(
            "fused.decode_split_tokens does not cut the shared pass of fused.decode_prefix_share "
            "into pieces; leave one of them at 0"
        )


class FusedKernels(reference.DispatchKernels):
    """Triton ops where they can run, the reference ops elsewhere; resolved once at construction."""

    name = "fused"

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        *,
        settings: FusedSettings,
    ) -> None:
        """``settings``: this kernel set's, as the plugin manager resolved them (built alone:
        ``plugins.create("kernels", "fused", config, device, dtype)`` reads them)."""
        self.config, self.device, self.dtype = config, device, dtype
        _check_decode_settings(settings, config.kv_cache_dtype)
        # The model merges q/k/v and gate/up weights at load when this is set.
        self.merge_projections = bool(settings.qkv)
        self.precision = settings.precision
        self.fp8_widen = settings.fp8_widen
        self.decode_merge = settings.decode_merge
        self.decode_tile_rule = settings.decode_tiles
        self._status: dict[str, str] = {}
        triton_reason = triton_unavailable_reason(device)
        if triton_reason is None and dtype not in SUPPORTED_DTYPES:
            triton_reason = f"unsupported dtype {dtype}"
        cache_reason = fp8_unsupported_reason(config.kv_cache_dtype, device)
        wanted = {
            "rms_norm": ("fused_rmsnorm", settings.rmsnorm),
            "silu_and_mul": ("fused_silu", settings.silu),
            "rope_and_store": ("fused_attention", settings.attention),
            "attention": ("fused_attention", settings.attention),
            "moe": ("fused.moe", settings.moe),
        }
        use: dict[str, bool] = {}
        for op, (flag, on) in wanted.items():
            reason = None if on else f"config flag {flag} is off"
            reason = reason or triton_reason
            if op in ("rope_and_store", "attention"):  # the ops that touch the KV cache
                reason = reason or cache_reason
            use[op] = reason is None
            if reason is not None:
                self._fallback(op, reason)
        self._status["linear"] = "torch (cuBLAS GEMM)" + (
            "; q/k/v and gate/up merged at load"
            if self.merge_projections
            else "; fused_qkv off: separate GEMMs"
        )

        self._resolve_layer(settings, triton_reason)
        self._layer: FusedLayer | None = None
        self._head_size_checked = not (use["rope_and_store"] or use["attention"])
        if use["rms_norm"]:
            from pitstop.plugins.kernels.triton_ops import rmsnorm

            self._rms_norm = rmsnorm.rms_norm
            self._status["rms_norm"] = "triton"
        if use["silu_and_mul"]:
            from pitstop.plugins.kernels.triton_ops import silu

            self._silu = silu.silu_and_mul
            self._status["silu_and_mul"] = "triton"
        if use["rope_and_store"]:
            from pitstop.plugins.kernels.triton_ops import rope_store

            self._rope = rope_store.rope_and_store
            self._status["rope_and_store"] = "triton"
        if self.fuses_layer and triton_reason is None:
            self._layer = self._fused_layer(settings, use["silu_and_mul"])
        # The model hands Qwen3's q/k norm weights to rope_and_store (one kernel) only while the
        # Triton kernel runs it; with the reference rotary it calls rms_norm (maybe Triton) first.
        self.fuses_qk_norm = use["rope_and_store"] and settings.qk_norm
        cudnn_off = self._long_prefill_off(settings.cudnn_prefill, use["attention"])
        if use["attention"]:
            from pitstop.plugins.kernels.cudnn_prefill import CudnnPrefill
            from pitstop.plugins.kernels.triton_ops import paged_attention

            self._attn = paged_attention.PagedAttention(
                device,
                dtype,
                max_context=config.max_model_len or 4096,
                precision=self.precision,
                fp8_widen=self.fp8_widen,
                decode_merge=self.decode_merge,
                decode_tile_rule=self.decode_tile_rule,
                long_prefill=None if cudnn_off else CudnnPrefill(settings.cudnn_prefill),
                prefix_share_tokens=settings.decode_prefix_share,
                split_tokens=settings.decode_split_tokens,
            )
            self._status["attention"] = "triton"
        self._status["long_prefill"] = (
            f"unused ({cudnn_off})"
            if cudnn_off
            else f"cuDNN (torch SDPA) for steps whose prefills all have >= "
            f"{settings.cudnn_prefill} tokens"
        )
        if use["moe"]:
            self._moe = functools.partial(_triton_moe, early_down=settings.moe_early_down)
            # the router's projection fused with the routing (fused.moe_router)
            self.moe_takes_router = settings.moe_router
            self.moe_adds_residual = True  # the residual add inside the slot sum
            # a fused layer's post-attention norm inside the op (with the one-launch router)
            self.moe_takes_norm = settings.moe_router
            self._status["moe"] = "triton"

    def _long_prefill_off(self, min_tokens: int, triton_attention: bool) -> str | None:
        """Why cuDNN does not take long prefills (``fused.cudnn_prefill``); None where it does:
        CUDA, a bf16/fp16 model and cache, the Triton attention on (it owns the fallback)."""
        if min_tokens <= 0:
            return "fused.cudnn_prefill is 0"
        if not triton_attention:
            return "the Triton attention is off"
        if self.device.type != "cuda":
            return "no CUDA device"
        if self.dtype not in (torch.bfloat16, torch.float16):
            return f"dtype {self.dtype} (bf16/fp16 only)"
        if self.config.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
            return f"KV cache {self.config.kv_cache_dtype} (bf16/fp16 only)"
        return None

    # ------------------------------------------------------------------ fused layer
    def _resolve_layer(self, settings: FusedSettings, triton_reason: str | None) -> None:
        """Whether the layer is fused (``fused.layer``, or its rule where unset) and where its
        ops run (:meth:`describe`)."""
        wanted, why_not = layer_wanted(
            settings.layer, self.device.type == "cuda" and triton_reason is None
        )
        self.fuses_layer = wanted and self.merge_projections
        if not self.fuses_layer:
            reason = why_not if not wanted else "fused_qkv is off"
            where = f"unused ({reason})"
        elif triton_reason is None:
            if settings.layer_tune and self.device.type == "cuda":
                chosen = f"the fastest of triton and cuBLAS, timed per shape, up to {settings.layer_tune_rows} rows"
            else:
                chosen = f"triton up to {settings.layer_rows} rows"
            where = (
                f"{chosen}, else cuBLAS (row scale in rope_and_store / silu_and_mul, "
                "residual added in place)"
            )
        else:
            where = f"reference ({triton_reason})"
        for op in reference.LAYER_OPS:
            self._status[op] = where

    def _fused_layer(self, settings: FusedSettings, triton_silu: bool) -> FusedLayer:
        """The layer's ops on Triton and cuBLAS (:mod:`.fused_layer`)."""
        from pitstop.plugins.kernels.triton_ops import fused_linear, silu
        from pitstop.plugins.kernels.triton_ops.layer_choice import LayerChoice

        choice = LayerChoice(
            settings.layer_rows, settings.layer_tune_rows, bool(settings.layer_tune)
        )
        return FusedLayer(
            fused_linear, choice, self._row_scaled, silu if triton_silu else None, self._silu
        )

    def _row_scaled(self, x: torch.Tensor, eps: float | None) -> torch.Tensor:
        """``x`` times each row's ``1/rms`` (the norm without its gain), one Triton pass."""
        if eps is None:
            return x
        from pitstop.plugins.kernels.triton_ops.rmsnorm import unit_gain  # the layer runs Triton

        return self._rms_norm(x, unit_gain(x.shape[-1], x.dtype, x.device), eps)[0]

    def norm_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None = None,
        lora: Any = None,
    ) -> torch.Tensor:
        """``rstd(x) * x @ weight.T (+ bias)`` (:class:`.fused_layer.FusedLayer`)."""
        if self._layer is None:
            return reference.norm_linear(x, weight, eps, bias, lora)
        return self._layer.norm_linear(x, weight, eps, bias, lora)

    def norm_linear_deferred(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None = None,
        lora: Any = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, float] | None]:
        """The QKV projection, its row scale perhaps left to ``rope_and_store``
        (:meth:`KernelSetBase.norm_linear_deferred`, :class:`.fused_layer.FusedLayer`)."""
        if self._layer is None:
            return reference.norm_linear(x, weight, eps, bias, lora), None
        return self._layer.norm_linear_deferred(x, weight, eps, bias, lora)

    def norm_gate_up(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None = None,
        lora: Any = None,
        next_lora: Any = None,
    ) -> torch.Tensor:
        """``silu(gate) * up`` of the normed gate-up projection (:class:`.fused_layer.FusedLayer`)."""
        if self._layer is None:
            return reference.norm_gate_up(x, weight, eps, bias, lora)
        return self._layer.norm_gate_up(x, weight, eps, bias, lora, next_lora)

    def linear_residual(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        bias: torch.Tensor | None = None,
        lora: Any = None,
        next_lora: Any = None,
    ) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``, a new tensor or ``residual`` updated in place
        (:class:`.fused_layer.FusedLayer`)."""
        if self._layer is None:
            return reference.linear_residual(x, weight, residual, bias, lora)
        return self._layer.linear_residual(x, weight, residual, bias, lora, next_lora)

    # ------------------------------------------------------------------ resolution
    def _fallback(self, op: str, reason: str) -> None:
        self._status[op] = f"reference ({reason})"
        log.info("fused kernels: %s falls back to reference: %s", op, reason)

    def _check_head_size(self, head_size: int) -> None:
        """Once, at the first rotary/attention call: fall back if the head size has no kernel."""
        self._head_size_checked = True
        if head_size_supported(head_size):
            return
        reason = f"unsupported head size {head_size} (needs a power of two in 16..256)"
        if self._status.get("rope_and_store") == "triton":
            self._rope = reference.rope_and_store
            self._fallback("rope_and_store", reason)
        if self._status.get("attention") == "triton":
            self._attn = reference.paged_attention
            self._fallback("attention", reason)

    def cuda_graph_safe(self, head_size: int) -> bool:
        """Whether a decode step can be captured in a CUDA graph (no op synchronizes with the host).

        The reference rotary and attention read lengths on the host, so both must run in Triton;
        the reference MoE loop reads the experts hit there (``fused.moe`` off: no graphs).
        """
        if not self._head_size_checked:
            self._check_head_size(head_size)
        return self._status["moe"] == "triton" and all(
            self._status[op] == "triton" for op in ("rope_and_store", "attention")
        )

    def describe(self) -> dict[str, str]:
        """Op name -> ``"triton"`` or ``"reference (reason)"`` (``linear`` is always a torch GEMM);
        the fused layer's ops say where they run, or why they are unused, and ``long_prefill``
        whether cuDNN takes long prefills."""
        return {op: self._status[op] for op in (*OPS, *reference.LAYER_OPS, "long_prefill")}


# the most experts a token the Triton routing kernel takes (its top-k runs in registers)
MAX_TRITON_TOP_K = 16


def _triton_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    weights_dtype: torch.dtype | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    router: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_eps: float | None = None,
    early_down: bool = False,
) -> torch.Tensor:
    """The fused MoE op (:func:`.triton_ops.moe.fused_moe`, which projects ``x`` by ``router``
    itself where no logits are given, adds ``residual`` inside its last kernel and applies
    a folded norm's row scale, ``norm_eps``, inside the router and the gate-up GEMM;
    ``early_down``: ``fused.moe_early_down``), or the reference loop for more than
    :data:`MAX_TRITON_TOP_K` experts a token."""
    kw = dict(renormalize=renormalize, weights_dtype=weights_dtype, scales=scales)
    if top_k > MAX_TRITON_TOP_K:
        if norm_eps is not None:
            x = (x.float() * reference.rms_scale(x, norm_eps)).to(x.dtype)
        if router_logits is None:
            router_logits = torch.nn.functional.linear(x, router)
        out = reference.moe(x, router_logits, gate_up, down, top_k, **kw)
        return out if residual is None else residual + out
    from pitstop.plugins.kernels.triton_ops import moe

    return moe.fused_moe(
        x, router_logits, gate_up, down, top_k, router=router, residual=residual,
        norm_eps=norm_eps, early_down=early_down, **kw,
    )  # fmt: skip


def make_fused_kernels(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    settings: FusedSettings,
) -> FusedKernels:
    """Triton kernels where this machine runs them, the reference ops elsewhere."""
    return FusedKernels(config, device, dtype, settings=settings)


@hookimpl
def register_kernels(register) -> None:
    """Register the ``fused`` kernel set (``kernels="auto"``'s choice on CUDA)."""
    register("fused", make_fused_kernels, settings=FusedSettings, auto_devices=("cuda",))
