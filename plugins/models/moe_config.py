"""How the mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) read a ``config.json``.

Their attention, norms, rope and special tokens are the Llama family's, read by
:func:`.llama_config.shared_fields` with every field decided; this module reads the
experts' fields into a :class:`MoEModelConfig` and decides the rest:

- Qwen3-MoE (``qwen3_moe``): ``num_experts`` (transformers 5 spells it
  ``num_local_experts``), ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``norm_topk_prob``, and which layers are sparse: layer ``i`` is unless it is in
  ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (a dense SwiGLU of
  ``intermediate_size`` then); the routing weights are cast to the activations' dtype.
- Qwen2-MoE (``qwen2_moe``): Qwen3-MoE's fields, Qwen2's attention (no q/k norm) with
  biases on q, k and v when ``qkv_bias``, and a shared expert in every sparse block (a
  SwiGLU of ``shared_expert_intermediate_size``, scaled by ``sigmoid(shared_expert_gate(x))``
  and added to the routed experts' sum).
- Mixtral (``mixtral``): ``num_local_experts``, ``num_experts_per_tok``, every layer
  sparse with ``intermediate_size`` per expert, the top-k always renormalized and the
  routing weights kept in float32; a ``sliding_window`` shorter than ``max_model_len`` is
  refused when the engine is built (:meth:`ModelConfig.check_max_model_len`).

Training-only fields have no effect (``router_aux_loss_coef``, ``output_router_logits``,
Mixtral's ``router_jitter_noise``, applied only in training mode).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from pitstop.errors import ModelLoadError
from pitstop.ground.model_config import MAX_DIM, MAX_LAYERS, ModelConfig, positive_int
from pitstop.plugins.models.llama_config import (
    HF_SHAPE_LIMITS,
    check_rope,
    shared_fields,
    transformers_config,
)

# model_type of a config.json -> the architecture it describes
MOE_MODEL_TYPES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

# the most experts a layer may claim, and the most a token may choose
MAX_EXPERTS = 4096

# Fields of the MoE config classes read here (each implemented or refused below).
MOE_FIELDS_READ = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "qkv_bias",
    "shared_expert_intermediate_size",
)
# Fields of theirs that do not change what inference computes.
MOE_FIELDS_WITHOUT_EFFECT = {
    "router_aux_loss_coef": "the load-balancing loss (training only)",
    "output_router_logits": "returns the router's logits for that loss (training only)",
    "router_jitter_noise": "multiplicative noise on the router's input in training mode only",
}
MOE_SHAPE_LIMITS = {
    **HF_SHAPE_LIMITS,
    "num_experts": MAX_EXPERTS,
    "num_local_experts": MAX_EXPERTS,
    "num_experts_per_tok": MAX_EXPERTS,
    "moe_intermediate_size": MAX_DIM,
    "shared_expert_intermediate_size": MAX_DIM,
}


@attrs.frozen(kw_only=True)
class MoEModelConfig(ModelConfig):
    """A decoder whose feed-forward blocks are (some or all) sparse mixtures of experts.

    ``intermediate_size`` stays the dense layers' width; each expert is a SwiGLU of
    ``moe_intermediate_size``.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    # transformers' norm_topk_prob: the k kept probabilities divided by their sum
    norm_topk_prob: bool
    # the layers whose feed-forward block is sparse (the others are dense SwiGLU)
    sparse_layers: tuple[int, ...]
    # Mixtral keeps the routing weights in float32; Qwen3-MoE casts them to the activations'
    routing_weights_float32: bool = False
    # Qwen2-MoE's shared expert in every sparse block (its width), gated by a sigmoid
    shared_expert_intermediate_size: int | None = None

    # the widths a tensor-parallel rank holds 1/n of besides intermediate_size: every rank
    # holds every expert, cut by its intermediate rows (pitstop.plugins.executors.tensor_parallel)
    tensor_parallel_widths: ClassVar[tuple[str, ...]] = (
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    )

    @property
    def num_params(self) -> int:
        """Parameter count, every expert included (all of them are resident)."""
        h = self.hidden_size
        dense_mlp = 3 * h * self.intermediate_size
        sparse_mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)
        if self.shared_expert_intermediate_size is not None:
            sparse_mlp += 3 * h * self.shared_expert_intermediate_size + h
        return super().num_params + len(self.sparse_layers) * (sparse_mlp - dense_mlp)

    @property
    def active_params(self) -> int:
        """Parameters one token reads: the dense ones and ``num_experts_per_tok`` experts
        (and the router) of every sparse layer."""
        h = self.hidden_size
        unread = (self.num_experts - self.num_experts_per_tok) * 3 * h * self.moe_intermediate_size
        return self.num_params - len(self.sparse_layers) * unread


def moe_config_from_hf(raw: Mapping[str, Any], where: str = "config.json") -> MoEModelConfig:
    """The :class:`MoEModelConfig` of a Qwen3-MoE, Qwen2-MoE or Mixtral ``config.json`` (a dict),
    read through transformers' config class and decided field by field (module doc)."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in MOE_MODEL_TYPES:
        raise ModelLoadError(
            f"{where} describes model_type={model_type!r}; pitstop's mixture-of-experts models "
            f"read {', '.join(MOE_MODEL_TYPES)} ({', '.join(MOE_MODEL_TYPES.values())})"
        )
    return moe_config_from_transformers(transformers_config(raw, where, MOE_SHAPE_LIMITS), where)


def moe_config_from_transformers(hf: Any, where: str = "config.json") -> MoEModelConfig:
    """The :class:`MoEModelConfig` of a transformers ``Qwen3MoeConfig``, ``Qwen2MoeConfig`` or
    ``MixtralConfig``."""
    model_type = getattr(hf, "model_type", "")
    decided = (*MOE_FIELDS_READ, *MOE_FIELDS_WITHOUT_EFFECT)
    fields = shared_fields(hf, where, MOE_MODEL_TYPES[model_type], decided)
    experts = positive_int(
        getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None),
        "num_local_experts" if model_type == "mixtral" else "num_experts",
        where,
        MAX_EXPERTS,
    )
    top_k = positive_int(
        getattr(hf, "num_experts_per_tok", None), "num_experts_per_tok", where, MAX_EXPERTS
    )
    if top_k > experts:
        raise ModelLoadError(
            f"{where}: num_experts_per_tok={top_k} is more than the {experts} experts a layer "
            "has; a token chooses at most all of them"
        )
    if model_type == "mixtral":
        moe = dict(
            moe_intermediate_size=fields["intermediate_size"],
            norm_topk_prob=True,
            sparse_layers=tuple(range(fields["num_layers"])),
            routing_weights_float32=True,
        )
    else:
        moe = _qwen_moe_fields(hf, where, fields["num_layers"])
    if model_type == "qwen2_moe":  # Qwen2's attention: q/k/v biases when qkv_bias, no o bias
        fields.update(attention_bias=bool(getattr(hf, "qkv_bias", True)), o_proj_bias=False)
        moe["shared_expert_intermediate_size"] = positive_int(
            getattr(hf, "shared_expert_intermediate_size", None),
            "shared_expert_intermediate_size",
            where,
            MAX_DIM,
        )
    config = MoEModelConfig(**fields, num_experts=experts, num_experts_per_tok=top_k, **moe)
    check_rope(config, where)
    return config


def _qwen_moe_fields(hf: Any, where: str, num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's (and Qwen2-MoE's) expert width, ``norm_topk_prob`` and sparse layers."""
    width = positive_int(
        getattr(hf, "moe_intermediate_size", None), "moe_intermediate_size", where, MAX_DIM
    )
    norm = getattr(hf, "norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ModelLoadError(f"{where}: norm_topk_prob={norm!r} is not true or false")
    step = positive_int(
        getattr(hf, "decoder_sparse_step", 1), "decoder_sparse_step", where, MAX_LAYERS
    )
    dense = getattr(hf, "mlp_only_layers", None) or []
    if not isinstance(dense, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise ModelLoadError(f"{where}: mlp_only_layers={dense!r} is not a list of layer indices")
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return dict(moe_intermediate_size=width, norm_topk_prob=norm, sparse_layers=sparse)
