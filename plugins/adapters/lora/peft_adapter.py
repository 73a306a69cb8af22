"""Reading a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

:func:`read_adapter` checks the adapter against what the ``lora`` plugin serves and the base
model's shapes, and returns its weights on the host: ``{(layer, module): (A [r, in], B [out, r])}``
with ``module`` one of q, k, v, o, gate, up, down. Everything else is refused with an
:class:`~pitstop.errors.InvalidRequestError` naming it: DoRA (``use_dora``),
``modules_to_save``, embedding or lm-head targets, trained biases (``bias`` other than
``"none"``, ``lora_bias``), per-module ``rank_pattern`` / ``alpha_pattern``, a rank over
``max_lora_rank``, a tensor whose shape does not match the base model, a bad path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import torch

from pitstop.errors import InvalidRequestError
from pitstop.ground.model_config import ModelConfig
from pitstop.plugins.kernels.lora_reference import scaling_of

MODULES = ("q", "k", "v", "o", "gate", "up", "down")
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_([AB])\.weight$"
)
_REFUSED_TARGETS = ("embed_tokens", "lm_head", "lora_embedding")


@attrs.frozen
class LoRAWeights:
    """One adapter on the host: its rank, scaling and (A, B) per (layer, module)."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _refuse(name: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {name!r}: {why}")


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    """``adapter_config.json``, or the refusal that names the bad path."""
    if not folder.is_dir():
        raise _refuse(name, f"lora_path {str(folder)!r} is not a folder")
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise _refuse(name, f"no adapter_config.json in {str(folder)!r}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(name, f"cannot read {str(path)!r}: {exc}") from exc


def check_config(name: str, cfg: dict[str, Any], max_rank: int) -> None:
    """Refuse, naming it, what the ``lora`` plugin does not serve."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(name, f"peft_type {peft_type!r} is not LoRA")
    if cfg.get("use_dora"):
        raise _refuse(name, "DoRA (use_dora=true) is not supported")
    if cfg.get("modules_to_save"):
        raise _refuse(name, f"modules_to_save {cfg['modules_to_save']!r} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise _refuse(name, f"trained biases (bias={cfg.get('bias')!r}) are not supported")
    for key in ("rank_pattern", "alpha_pattern", "layer_replication"):
        if cfg.get(key):
            raise _refuse(name, f"{key} is not supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for target in targets:
        if any(t in target for t in ("embed_tokens", "lm_head")):
            raise _refuse(
                name, f"target {target!r}: embedding and lm-head adapters are not supported"
            )
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _refuse(name, f"rank r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise _refuse(name, f"rank r={rank} is over max_lora_rank={max_rank}")


def expected_shapes(mc: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of the base model."""
    q, kv = mc.num_heads * mc.head_size, mc.num_kv_heads * mc.head_size
    h, f = mc.hidden_size, mc.intermediate_size
    return {
        "q": (q, h),
        "k": (kv, h),
        "v": (kv, h),
        "o": (h, q),
        "gate": (f, h),
        "up": (f, h),
        "down": (h, f),
    }


def _load_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise _refuse(name, f"no adapter_model.safetensors in {str(folder)!r}")
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # a truncated or foreign file
        raise _refuse(name, f"cannot read {str(path)!r}: {exc}") from exc


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], dict[str, Any]]:
    """{(layer, module): {"A": tensor, "B": tensor}}; an unknown tensor is refused by name."""
    found: dict[tuple[int, str], dict[str, Any]] = {}
    for key, tensor in tensors.items():
        if any(t in key for t in _REFUSED_TARGETS):
            raise _refuse(name, f"tensor {key!r}: embedding and lm-head adapters are not supported")
        m = _KEY.search(key)
        if m is None:
            raise _refuse(name, f"tensor {key!r} is not a LoRA A/B weight of q/k/v/o/gate/up/down")
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    return found


def _checked_pair(
    name: str, where: tuple[int, str], pair: dict[str, Any], rank: int, mc: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one module, checked against the rank and the base model's shapes."""
    layer, module = where
    if layer >= mc.num_layers:
        raise _refuse(name, f"layer {layer} is past the base model's {mc.num_layers} layers")
    if set(pair) != {"A", "B"}:
        raise _refuse(name, f"layer {layer} {module}_proj has lora_A or lora_B missing")
    out, inp = expected_shapes(mc)[module]
    a, b = pair["A"], pair["B"]
    if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
        raise _refuse(
            name,
            f"layer {layer} {module}_proj: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
            f"not match the base model (expected {(rank, inp)} / {(out, rank)}): a different "
            "base model",
        )
    return a, b


def read_adapter(name: str, path: str, max_rank: int, mc: ModelConfig) -> LoRAWeights:
    """The adapter at ``path``, checked (see the module docstring), its tensors on the host."""
    folder = Path(path).expanduser()
    cfg = _read_config(name, folder)
    check_config(name, cfg, max_rank)
    rank = int(cfg["r"])
    pairs = _pairs(name, _load_tensors(name, folder))
    if not pairs:
        raise _refuse(name, "the adapter holds no LoRA weights")
    weights = {
        where: _checked_pair(name, where, pair, rank, mc) for where, pair in sorted(pairs.items())
    }
    alpha = float(cfg.get("lora_alpha", rank))
    scale = scaling_of(alpha, rank, bool(cfg.get("use_rslora", False)))
    return LoRAWeights(name, rank, scale, weights)


def rank_part(adapter: LoRAWeights, shard: Any) -> LoRAWeights:
    """``adapter`` cut to one tensor-parallel rank's part of the base model (``shard``: the
    executor's weight cutter). A column-parallel projection (q, k, v, gate, up) keeps A whole
    and the rows of B its weight's rows are cut to; a row-parallel one (o, down) keeps B
    whole and the columns of A its weight's columns are cut to, so its partial delta joins
    the partial output before the all-reduce sums both."""
    shapes = expected_shapes(shard.model_config)
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        block = "self_attn" if module in ("q", "k", "v", "o") else "mlp"
        name = f"model.layers.{layer}.{block}.{module}_proj.weight"
        region = shard.region(name, shapes[module])
        if region is not None and region.dim == 0:
            b = b.narrow(0, region.start, region.stop - region.start).contiguous()
        elif region is not None:
            a = a.narrow(1, region.start, region.stop - region.start).contiguous()
        weights[(layer, module)] = (a, b)
    return attrs.evolve(adapter, weights=weights)
