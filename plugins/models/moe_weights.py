"""The mixture-of-experts models' checkpoint names and shapes.

(Qwen2-MoE names its blocks as Qwen3-MoE does and adds a shared expert:
``mlp.shared_expert.gate_proj / up_proj / down_proj.weight`` and
``mlp.shared_expert_gate.weight`` ``[1, H]``, loaded into the block's own SwiGLU.)

A sparse layer's tensors in a Hugging Face checkpoint (transformers 5 still saves
these names):

- Qwen3-MoE: ``model.layers.{i}.mlp.gate.weight`` (the router, ``[E, H]``) and
  ``model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``;
- Mixtral: ``model.layers.{i}.block_sparse_moe.gate.weight`` and
  ``model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2.weight`` (gate, up, down).

The model stacks them by rows, as the kernel set's ``moe`` op reads them through a
view: ``mlp.gate_up [E * 2F, H]`` (expert ``e``'s gate rows from ``e * 2F``, its up rows
from ``e * 2F + F``) and ``mlp.down [E * H, F]`` (expert ``e``'s rows from ``e * H``). Every
other tensor (attention, norms, embedding, a dense layer's MLP) is named as in
:mod:`.llama_weights`.
"""

from __future__ import annotations

import attrs

from pitstop.plugins.models.llama_weights import expected_weight_shapes, map_hf_name
from pitstop.plugins.models.moe_config import MoEModelConfig


@attrs.frozen
class ExpertNames:
    """How an architecture's checkpoints name a sparse block's tensors."""

    block: str  # the block's module under model.layers.{i}
    gate: str
    up: str
    down: str


EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "Qwen2MoeForCausalLM": ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
}
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def expected_moe_shapes(cfg: MoEModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor a checkpoint of ``cfg`` holds: the
    Llama family's, with each sparse layer's dense MLP replaced by its router and experts."""
    names = EXPERT_NAMES[cfg.architecture]
    h, f = cfg.hidden_size, cfg.moe_intermediate_size
    sparse = {f"model.layers.{i}." for i in cfg.sparse_layers}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_weight_shapes(cfg).items():
        prefix, _, local = name.partition("mlp.")
        if prefix not in sparse or "mlp." + local not in _DENSE_MLP:
            shapes[name] = shape
            continue
        if local != "gate_proj.weight":
            continue  # the router and experts go where the gate projection was
        block = f"{prefix}{names.block}."
        shapes[block + "gate.weight"] = (cfg.num_experts, h)
        for e in range(cfg.num_experts):
            expert = f"{block}experts.{e}."
            shapes[expert + f"{names.gate}.weight"] = (f, h)
            shapes[expert + f"{names.up}.weight"] = (f, h)
            shapes[expert + f"{names.down}.weight"] = (h, f)
        if cfg.shared_expert_intermediate_size is not None:  # Qwen2-MoE
            shared, fs = f"{block}shared_expert.", cfg.shared_expert_intermediate_size
            shapes |= {shared + f"{p}_proj.weight": (fs, h) for p in ("gate", "up")}
            shapes[shared + "down_proj.weight"] = (h, fs)
            shapes[block + "shared_expert_gate.weight"] = (1, h)
    return shapes


def map_moe_name(cfg: MoEModelConfig, merged: bool, name: str) -> tuple[str | None, int | None]:
    """HF name -> (parameter name, row offset or None); (None, None) for no place. A sparse
    layer's router and experts (of an expert id below ``num_experts``) go to its block's
    ``router``, stacked ``gate_up`` and ``down``; the rest as :func:`.llama_weights.map_hf_name`."""
    names = EXPERT_NAMES[cfg.architecture]
    parts = name.split(".")
    # model.layers.{i}.{block}.gate.weight / model.layers.{i}.{block}.experts.{e}.{proj}.weight
    if len(parts) < 6 or parts[:2] != ["model", "layers"] or parts[3] != names.block:
        return map_hf_name(cfg, merged, name)
    layer, rest = parts[2], parts[4:]
    if not layer.isdigit() or int(layer) not in cfg.sparse_layers:
        return map_hf_name(cfg, merged, name)
    target = f"layers.{layer}.mlp."
    if rest == ["gate", "weight"]:
        return target + "router", None
    if cfg.shared_expert_intermediate_size is not None and rest[0].startswith("shared_expert"):
        return _map_shared_expert(cfg, merged, target, rest)
    if len(rest) != 4 or rest[0] != "experts" or rest[3] != "weight" or not rest[1].isdigit():
        return None, None
    e, proj = int(rest[1]), rest[2]
    f, h = cfg.moe_intermediate_size, cfg.hidden_size
    if e >= cfg.num_experts:
        return None, None
    offsets = {
        names.gate: ("gate_up", e * 2 * f),
        names.up: ("gate_up", e * 2 * f + f),
        names.down: ("down", e * h),
    }
    if proj not in offsets:
        return None, None
    param, offset = offsets[proj]
    return target + param, offset


def _map_shared_expert(
    cfg: MoEModelConfig, merged: bool, target: str, rest: list[str]
) -> tuple[str | None, int | None]:
    """Qwen2-MoE's ``shared_expert_gate.weight`` and ``shared_expert.{gate,up,down}_proj.weight``
    (``rest``, after the block's name) -> the block's ``shared_gate`` and its shared expert's
    parameters (a SwiGLU of :mod:`.llama`, merged gate-up or not)."""
    if rest == ["shared_expert_gate", "weight"]:
        return target + "shared_gate", None
    fs = cfg.shared_expert_intermediate_size
    table = {
        "down_proj": ("down_proj", None),
        "gate_proj": ("gate_up_proj", 0) if merged else ("gate_proj", None),
        "up_proj": ("gate_up_proj", fs) if merged else ("up_proj", None),
    }
    if len(rest) != 3 or rest[0] != "shared_expert" or rest[2] != "weight" or rest[1] not in table:
        return None, None
    param, offset = table[rest[1]]
    return f"{target}shared_expert.{param}", offset
