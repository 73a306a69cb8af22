"""`fp8` weights: e4m3 linear weights with one float32 scale per output channel.

Each linear weight is quantized once, at load, from the dense tensor the model
hands over (a bf16 checkpoint, a GGUF file dequantized, or a ``dummy:`` preset):
row ``n`` gets the scale ``amax(|W[n]|) / 448`` and is stored as
``W[n] / scale[n]`` rounded to e4m3 (nearest, ties to even: torch's cast),
half the bytes of bf16. At run time every linear quantizes its input the same
way, per token (one scale per row of ``x``) or per tensor (one for the whole
step, ``fp8.activation_scale``), and computes

    out[m, n] = x_scale[m] * w_scale[n] * sum_k xq[m, k] * wq[n, k]  (+ bias[n])

with the sum in float32 and one rounding to the activation dtype. Two GEMMs
compute exactly that:

- ``scaled-mm``: ``torch._scaled_mm`` with row-wise scales (``scale_a`` ``[M, 1]``,
  ``scale_b`` ``[1, N]``, float32) on the fp8 tensor cores of an sm89+ GPU (Ada,
  Hopper, Blackwell). Its output is bf16, and it needs ``in_features`` and
  ``out_features`` to be multiples of 16: a weight that is not runs the reference
  GEMM instead (``describe()`` counts them).
- ``reference``: both operands widened to float32 (exact: every e4m3 value is a
  float32), multiplied, scaled; the numerical reference, and what runs on CPU.

On the GPU the activations are quantized by a Triton kernel in one launch
(:mod:`~pitstop.plugins.weight_formats.fp8_gemm`), and a step of up to
``fp8.skinny_rows`` tokens (decoding a small batch) runs each linear as one
skinny Triton kernel that is **weight-only**: the activations stay in their
dtype and the e4m3 weights are widened in registers, ``out = (x @ wq.T) *
w_scale``. There the time is the weight bytes, which fp8 halves; quantizing the
activations too would only add work and rounding. So with ``fp8.skinny_rows >
0`` small steps skip the activation rounding that larger ones have (they are
the more accurate); ``fp8.skinny_rows = 0`` quantizes every step's activations.

``fp8.gemm = "auto"`` takes ``scaled-mm`` on a GPU of compute capability 8.9 or
more with ``dtype = bfloat16``, and ``reference`` on CPU; a GPU below 8.9 is
refused with its capability named (``fp8.gemm = "reference"`` runs there anyway,
at no saving of time). Nothing in :meth:`Fp8Weights.linear` reads the device from
the host, so it runs inside CUDA graphs.

The output head stays dense unless ``fp8.lm_head = true`` (vLLM keeps it
unquantized too: its error goes straight into the logits).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from pitstop.config import EngineConfig
from pitstop.errors import ConfigError
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.protocols import KernelSet
from pitstop.plugin_system.settings import setting
from pitstop.plugins.weight_formats.dense import tensor_bytes

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_AMAX = 1e-12  # the scale of an all-zero row or token: any positive value keeps zeros zero
FAST_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
ALIGNMENT = 16  # _scaled_mm's requirement on in_features and out_features
# the skinny Triton GEMM's tile of rows (fp8_gemm.SKINNY_MAX_ROWS, repeated here so that
# this module imports no Triton; tests/plugins/weight_formats/test_fp8_gemm.py keeps the two equal)
SKINNY_MAX_ROWS = 16


@attrs.frozen
class Fp8Settings:
    """The settings of the ``fp8`` weight format (``fp8.activation_scale``, ...)."""

    activation_scale: str = setting(
        "per-token",
        type=str,
        choices=("per-token", "per-tensor"),
        help="how each linear's input is quantized: one scale per token (row) or one per step "
        "(steps the skinny kernel takes, up to fp8.skinny_rows tokens, are weight-only)",
    )
    lm_head: bool = setting(
        False,
        type=bool,
        help="quantize an untied output head too (default: it stays dense, as in vLLM)",
    )
    gemm: str = setting(
        "auto",
        type=str,
        choices=("auto", "scaled-mm", "reference"),
        help="the fp8 GEMM: torch._scaled_mm (sm89+ GPUs), the float32 reference, or auto "
        "(scaled-mm on a GPU with fp8 tensor cores and bfloat16 activations, else reference)",
    )
    skinny_rows: int = setting(
        SKINNY_MAX_ROWS,
        type=int,
        minimum=0,
        help="steps of up to this many tokens run each linear as one skinny weight-only Triton "
        "kernel, activations unquantized (GPU only; 0: always quantize + torch._scaled_mm; "
        f"at most {SKINNY_MAX_ROWS})",
    )
    skinny_tiles: str = setting(
        "auto",
        type=str,
        help="the skinny kernel's tiles: 'auto', or 'BN,BK,WARPS,STAGES' for one row, "
        "optionally ';BN,BK,WARPS,STAGES' for several (benchmarks/fp8_gemm_bench.py --sweep "
        "measures them)",
    )

    def __attrs_post_init__(self) -> None:
        parse_skinny_tiles(self.skinny_tiles)
        if self.skinny_rows > SKINNY_MAX_ROWS:
            raise ConfigError(
                f"fp8.skinny_rows is at most {SKINNY_MAX_ROWS} (the skinny kernel's "
                f"tile); got {self.skinny_rows}. Larger steps run torch._scaled_mm"
            )


Tile = tuple[int, int, int, int]  # the skinny kernel's BLOCK_N, BLOCK_K, warps, stages


def parse_skinny_tiles(text: str) -> tuple[Tile | None, Tile | None]:
    """``fp8.skinny_tiles`` as (one row's tile, several rows'); ``None`` where ``auto`` decides.

    Raises a ConfigError naming the problem for a malformed value.
    """
    parts = text.split(";")
    problem = "more than two tiles" if len(parts) > 2 else ""
    tiles: list[Tile | None] = [None, None]
    for i, part in enumerate(parts[:2]):
        if part.strip() in ("", "auto"):
            continue
        try:
            values = tuple(int(v) for v in part.split(","))
        except ValueError:
            values = ()
        if len(values) != 4 or any(v <= 0 for v in values):
            problem = problem or f"{part!r} is not four positive integers"
        elif any(v & (v - 1) for v in values[:3]):
            problem = problem or f"{part!r}: BN, BK and WARPS must be powers of two"
        elif i == 1 and values[0] < 16:
            problem = problem or f"{part!r}: several rows' BN is at least 16 (a tensor-core tile)"
        else:
            tiles[i] = values  # type: ignore[assignment]
    if problem:
        raise ConfigError(
            f"fp8.skinny_tiles={text!r}: {problem}. Give 'auto', 'BN,BK,WARPS,STAGES' (one "
            "row's tile) or 'BN,BK,WARPS,STAGES;BN,BK,WARPS,STAGES' (one row's; several rows')"
        )
    return tiles[0], tiles[1]


@attrs.frozen(eq=False)
class Fp8Weight:
    """One resident fp8 weight: ``qweight`` ``[N, K]`` e4m3 and ``scale`` ``[1, N]`` float32."""

    qweight: torch.Tensor
    scale: torch.Tensor
    fast: bool  # whether _scaled_mm multiplies it (both dimensions multiples of 16)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return tuple(self.qweight.shape)  # type: ignore[return-value]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[R, C]`` as e4m3 with one float32 scale per row: ``(q [R, C], scale [R, 1])``,
    ``x ~= q * scale``, ``scale = amax(|row|) / 448``."""
    wide = x.float()
    scale = wide.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[R, C]`` as e4m3 with one float32 scale for all of it, repeated per row
    (``scale`` ``[R, 1]``, the shape ``_scaled_mm``'s row-wise scaling takes)."""
    wide = x.float()
    scale = wide.abs().amax().clamp(min=MIN_AMAX) / FP8_MAX
    q = (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


def reference_gemm(
    xq: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, dtype: torch.dtype
) -> torch.Tensor:
    """The fp8 product in float32: ``(xq @ wq.T) * x_scale * w_scale``, rounded once to ``dtype``."""
    acc = F.linear(xq.float(), w.qweight.float())
    return (acc * x_scale * w.scale).to(dtype)


def weight_only_reference(
    x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The skinny (weight-only) product in float32: ``(x @ wq.T) * w_scale``, rounded once."""
    return (F.linear(x.float(), qweight.float()) * w_scale).to(dtype)


def scaled_mm_gemm(
    xq: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, dtype: torch.dtype
) -> torch.Tensor:
    """The same product on fp8 tensor cores (``torch._scaled_mm``, row-wise scales)."""
    out = torch._scaled_mm(xq, w.qweight.t(), scale_a=x_scale, scale_b=w.scale, out_dtype=dtype)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 also returned amax


class Fp8Weights:
    """Per-channel e4m3 weights, activations quantized per token (or per tensor) at run time."""

    name = "fp8"

    def __init__(
        self, settings: Fp8Settings, kernels: KernelSet, fast: bool, why: str, out_dtype: Any
    ) -> None:
        self.settings = settings
        self.kernels = kernels  # the dense head's linear
        self.fast = fast
        self.why = why
        self.out_dtype = out_dtype  # what _scaled_mm writes (bf16 on CUDA); None: x's dtype
        per_token = settings.activation_scale == "per-token"
        self.quantize_input = quantize_rows if per_token else quantize_tensor
        self.skinny = None  # the Triton kernels (fp8_gemm), on CUDA only
        self.tiles: tuple[Any, Any] = (None, None)  # fp8_gemm.SkinnyTiles for 1 row, several
        if fast and out_dtype is not None:
            from pitstop.plugins.weight_formats import fp8_gemm

            self.skinny = fp8_gemm
            self.tiles = tuple(  # type: ignore[assignment]
                None if t is None else fp8_gemm.SkinnyTiles(*t)
                for t in parse_skinny_tiles(settings.skinny_tiles)
            )
            if per_token:  # one Triton launch instead of eight torch operations
                self.quantize_input = fp8_gemm.quantize_rows
        self.skinny_rows = settings.skinny_rows if self.skinny is not None else 0
        self.num_fp8 = 0
        self.num_slow = 0  # fp8 weights the reference GEMM multiplies (dimensions not aligned)
        self.num_dense = 0

    def prepare(self, name: str, weight: torch.Tensor) -> Any:
        """The weight as e4m3 rows and their scales; the head stays dense unless ``lm_head``."""
        if name == "lm_head" and not self.settings.lm_head:
            self.num_dense += 1
            return weight
        qweight, scale = quantize_rows(weight)
        out_features, in_features = weight.shape
        aligned = out_features % ALIGNMENT == 0 and in_features % ALIGNMENT == 0
        self.num_fp8 += 1
        self.num_slow += self.fast and not aligned
        return Fp8Weight(
            qweight.contiguous(), scale.reshape(1, -1).contiguous(), self.fast and aligned
        )

    def linear(self, x: torch.Tensor, resident: Any, bias: torch.Tensor | None = None) -> Any:
        """``x @ W.T + bias`` with ``x`` quantized as the settings say (no host sync)."""
        if isinstance(resident, torch.Tensor):  # a weight kept dense (the head)
            return self.kernels.linear(x, resident, bias)
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if resident.fast and rows.shape[0] <= self.skinny_rows:
            out = self.skinny.skinny_linear(
                rows.contiguous(),
                resident.qweight,
                resident.scale,
                bias,
                out_dtype=x.dtype,
                tiles=self.tiles[rows.shape[0] > 1],
            )
            return out.reshape(*lead, out.shape[-1])
        xq, x_scale = self.quantize_input(rows.contiguous())
        if resident.fast:
            out = scaled_mm_gemm(xq, x_scale, resident, self.out_dtype or x.dtype).to(x.dtype)
        else:
            out = reference_gemm(xq, x_scale, resident, x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*lead, out.shape[-1])

    def reference_linear(
        self, x: torch.Tensor, resident: Any, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """What :meth:`linear` computes, in float32 (the tests' reference): the weight-only
        product for a step the skinny kernel takes, else the per-token fp8 product."""
        if isinstance(resident, torch.Tensor):
            return self.kernels.linear(x, resident, bias)
        rows = x.reshape(-1, x.shape[-1])
        if resident.fast and rows.shape[0] <= self.skinny_rows:
            out = weight_only_reference(rows, resident.qweight, resident.scale, x.dtype)
            out = out if bias is None else out + bias
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return self.linear(x, attrs.evolve(resident, fast=False), bias)

    def resident_bytes(self, resident: Any) -> int:
        """e4m3 weights (one byte each) plus a float32 scale per row; a dense head's tensor."""
        if isinstance(resident, torch.Tensor):
            return tensor_bytes(resident)
        return tensor_bytes(resident.qweight) + tensor_bytes(resident.scale)

    def describe(self) -> dict[str, str]:
        """Which GEMM runs, why, and how many weights are fp8, slow or dense."""
        gemm = "torch._scaled_mm (row-wise scales)" if self.fast else "reference (float32)"
        if self.skinny_rows:
            gemm += (
                f", the skinny weight-only Triton kernel for steps of up to {self.skinny_rows} "
                "tokens"
            )
        counts = f"; {self.num_fp8} fp8 weights" if self.num_fp8 or self.num_dense else ""
        if self.num_slow:
            counts += f", {self.num_slow} of them on the reference (dimensions not multiples of 16)"
        if self.num_dense:
            counts += f", {self.num_dense} dense (the output head)"
        return {
            "linear": f"fp8 e4m3 per-channel weights, {self.settings.activation_scale} "
            f"activations, {gemm}: {self.why}{counts}"
        }


def choose_gemm(
    settings: Fp8Settings, device: torch.device, dtype: torch.dtype
) -> tuple[bool, str]:
    """(whether ``_scaled_mm`` runs, why), or a :class:`ConfigError` for a GPU without fp8."""
    if device.type != "cuda":
        if settings.gemm == "scaled-mm":
            return True, f"fp8.gemm='scaled-mm' asked for on {device.type}"
        return False, f"fp8.gemm={settings.gemm!r} on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FAST_MIN_CAPABILITY and settings.gemm != "reference":
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"weights='fp8' needs fp8 tensor cores (compute capability 8.9 or more: Ada, Hopper, "
            f"Blackwell); {name} has {capability[0]}.{capability[1]}. Use weights='dense', or "
            "fp8.gemm='reference' for the float32 reference GEMM (no faster than dense)"
        )
    if settings.gemm == "reference":
        return False, "fp8.gemm='reference'"
    if dtype != torch.bfloat16:
        if settings.gemm == "scaled-mm":
            raise ConfigError(
                f"fp8.gemm='scaled-mm' writes bfloat16 on CUDA, but dtype is {dtype}; use "
                "dtype='bfloat16' or fp8.gemm='reference'"
            )
        return False, f"dtype {dtype} (the row-wise fp8 GEMM writes bfloat16 only)"
    return True, f"compute capability {capability[0]}.{capability[1]}"


def make_fp8(
    config: EngineConfig,
    kernels: KernelSet,
    device: torch.device,
    dtype: torch.dtype,
    *,
    settings: Fp8Settings,
) -> Fp8Weights:
    """Per-channel e4m3 weights quantized at load; activations per token; _scaled_mm on sm89+."""
    del config
    fast, why = choose_gemm(settings, device, dtype)
    out_dtype = torch.bfloat16 if fast and device.type == "cuda" else None
    return Fp8Weights(settings, kernels, fast, why, out_dtype)


@hookimpl
def register_weight_formats(register: Any) -> None:
    """Register ``fp8``."""
    register("fp8", make_fp8, settings=Fp8Settings)
