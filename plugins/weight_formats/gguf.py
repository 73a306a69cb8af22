"""`gguf` weights: a GGUF file's linear weights kept in their quantized blocks, as llama.cpp runs them.

``weights=gguf`` (``--weights gguf``) with a ``.gguf`` model: the loader offers each
block-quantized matrix as a :class:`~pitstop.plugins.model_sources.gguf.quantized.QuantizedWeight`
(:class:`~pitstop.plugin_system.weight_format.KeepsBlocks`), its rows already
un-permuted where llama.cpp permuted them (a row gather, exact on blocks), the parts
of merged q/k/v and gate/up stacked by rows. This format keeps every matrix whose
type :mod:`~pitstop.plugins.weight_formats.gguf_blocks` reads (F32, F16, BF16, Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K) as a
:class:`~pitstop.plugins.weight_formats.gguf_linear.GGUFLinear` per run of one type,
and the token embedding too (``gguf.embedding``, default on: it is also the tied
output head of SmolLM2 and many small models). So the resident weights are the
file's tensor bytes, plus the dense norms and biases.

How a linear multiplies (:meth:`GGUFLinear.forward`):

- CPU: tile by tile, each tile dequantized by the exact torch decoder and multiplied:
  the same values as the default path's (``gguf.quants``, then float32), so greedy
  output matches the dequantized path (bit for bit on one thread; see gguf_linear);
- CUDA: the Triton kernel of :mod:`~pitstop.plugins.weight_formats.gguf_gemv` for batches
  of up to 16 rows of Q8_0, Q4_0, Q4_1, Q4_K or Q6_K (it never materializes the weight),
  else the whole matrix dequantized and one matmul. Both run inside CUDA graphs.

A merged weight whose parts the file stores in different types (a Q4_K_M file's
``attn_v`` in Q6_K) keeps one run per type and concatenates their outputs. A type
this format cannot read is declined and arrives dequantized (dense, the kernel set's
linear). ``check_weights`` checks every kept block's f16 scales for NaN and infinity
(:func:`~pitstop.plugins.weight_formats.gguf_blocks.nonfinite_blocks`).
"""

from __future__ import annotations

import collections
from typing import Any

import attrs
import torch

from pitstop.config import EngineConfig
from pitstop.errors import ConfigError, ModelLoadError
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.protocols import KernelSet
from pitstop.plugin_system.settings import setting
from pitstop.plugins.model_sources.gguf.quantized import QuantizedWeight
from pitstop.plugins.weight_formats.dense import tensor_bytes
from pitstop.plugins.weight_formats.gguf_blocks import (
    UnsupportedQuantType,
    nonfinite_blocks,
    quant_type,
)
from pitstop.plugins.weight_formats.gguf_linear import GGUFLinear

EMBEDDING = "model.embed_tokens.weight"


@attrs.frozen
class GGUFSettings:
    """The settings of the ``gguf`` weight format (``gguf.embedding``)."""

    embedding: bool = setting(
        True,
        type=bool,
        help="keep the token embedding (and a tied output head) in its blocks too; false: "
        "dequantized, dense in the model's dtype",
    )


@attrs.frozen(eq=False)
class GGUFWeight:
    """One resident weight: a :class:`GGUFLinear` per run of rows of one type, in row order."""

    parts: tuple[GGUFLinear, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return (sum(p.out_features for p in self.parts), self.parts[0].in_features)


def _readable(qtype: str) -> bool:
    try:
        quant_type(qtype)
    except UnsupportedQuantType:
        return False
    return True


class GGUFWeights:
    """Linear weights (and the embedding) held as a GGUF file's blocks, dequantized on the fly."""

    name = "gguf"
    # whose blocks it keeps and what to pass instead (KeepsBlocksBase: the refusal's words)
    blocks_of = "a GGUF file"
    blocks_model = "a .gguf model (e.g. smollm2-135m)"

    def __init__(
        self,
        settings: GGUFSettings,
        kernels: KernelSet,
        device: torch.device,
        dtype: torch.dtype,
        check_finite: bool,
    ) -> None:
        self.settings = settings
        self.kernels = kernels  # the linear of a weight that arrived dense
        self.device, self.dtype = device, dtype
        self.check_finite = check_finite
        self.kept: collections.Counter[str] = collections.Counter()  # ggml type -> weights
        self.num_dense = 0
        self.num_split = 0  # merged weights of parts in different types (one matmul per run)

    # ------------------------------------------------------------------ KeepsBlocks
    def takes_blocks(self, name: str, weight: QuantizedWeight) -> bool:
        """Every matrix of a type gguf_blocks reads; the embedding when ``gguf.embedding``."""
        if name == EMBEDDING and not self.settings.embedding:
            return False
        return all(_readable(q) for q in weight.qtypes)

    def embedding(self, resident: GGUFWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the embedding, dequantized (only the rows asked for)."""
        return resident.parts[0].rows(ids, self.dtype)

    # ------------------------------------------------------------------ WeightFormat
    def prepare(self, name: str, weight: torch.Tensor | QuantizedWeight) -> Any:
        """A :class:`GGUFWeight` of the blocks on the device; a dense tensor stays as it is."""
        if isinstance(weight, torch.Tensor):
            self.num_dense += 1
            return weight
        parts = []
        for run in weight.parts:
            if self.check_finite:
                bad = nonfinite_blocks(run.raw, run.qtype)
                if bad:
                    raise ModelLoadError(
                        f"GGUF weight {name!r} ({run.qtype}) has {bad} block(s) whose scales "
                        "are NaN or infinite: the file is broken (a failed conversion); the "
                        "model would generate garbage. Fix or re-download it "
                        "(check_weights=false loads it anyway)"
                    )
            raw = run.raw.to(self.device)
            parts.append(GGUFLinear(raw, run.qtype, (run.rows, weight.in_features)))
            self.kept[run.qtype] += 1
        self.num_split += len(parts) > 1
        return GGUFWeight(tuple(parts))

    def linear(self, x: torch.Tensor, resident: Any, bias: torch.Tensor | None = None) -> Any:
        """``x @ W.T + bias``, each run of blocks dequantized on the fly (no host sync)."""
        if isinstance(resident, torch.Tensor):
            return self.kernels.linear(x, resident, bias)
        parts = resident.parts
        out = parts[0](x) if len(parts) == 1 else torch.cat([p(x) for p in parts], dim=-1)
        return out if bias is None else out + bias

    def resident_bytes(self, resident: Any) -> int:
        """The blocks' bytes (the file's, for these rows); a dense weight's tensor bytes."""
        if isinstance(resident, torch.Tensor):
            return tensor_bytes(resident)
        return sum(p.resident_bytes() for p in resident.parts)

    def describe(self) -> dict[str, str]:
        """Which matmul runs where, and how many weights are kept in which type."""
        if self.device.type == "cuda":
            how = (
                "CUDA: the gguf_gemv Triton kernel for batches of up to 16 rows of "
                "Q8_0/Q4_0/Q4_1/Q4_K/Q6_K, else the weight dequantized and one matmul"
            )
        else:
            how = f"{self.device.type}: tiles dequantized exactly (torch) and multiplied"
        kept = ", ".join(f"{n} {q}" for q, n in sorted(self.kept.items()))
        counts = f"; kept: {kept}" if kept else ""
        if self.num_split:
            counts += f"; {self.num_split} merged of parts in different types (a matmul each)"
        if self.num_dense:
            counts += f"; {self.num_dense} dense (stored unquantized or of a type it cannot read)"
        return {"linear": f"GGUF blocks kept quantized, {how}{counts}"}


def make_gguf(
    config: EngineConfig,
    kernels: KernelSet,
    device: torch.device,
    dtype: torch.dtype,
    *,
    settings: GGUFSettings,
) -> GGUFWeights:
    """A GGUF file's blocks kept quantized; matmuls dequantize on the fly (Triton on CUDA)."""
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            f"weights='gguf' keeps each weight's blocks whole on one device; with "
            f"tensor_parallel_size={config.tensor_parallel_size} use weights='dense' (the file "
            "dequantized) or tensor_parallel_size=1"
        )
    return GGUFWeights(settings, kernels, device, dtype, config.check_weights)


@hookimpl
def register_weight_formats(register: Any) -> None:
    """Register ``gguf``."""
    register("gguf", make_gguf, settings=GGUFSettings)
