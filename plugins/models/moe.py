"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) on the Llama family's decoder.

Attention, norms, rotary, the embedding and the output head are
:mod:`.llama`'s (Qwen3-MoE's attention is Qwen3's, with the per-head q/k norm;
Mixtral's is Llama's). What differs is the feed-forward block of the sparse layers,
:class:`SparseMoeBlock`: the router's projection through the kernel set's ``linear``,
then its ``moe`` op (:class:`~pitstop.plugin_system.protocols.MoEOps`): softmax,
top-k, optional renormalisation and the weighted sum of each token's experts, as
transformers computes them. A kernel set without a ``moe`` op gets the reference loop
over experts (:func:`pitstop.plugins.kernels.reference.moe`). Qwen2-MoE adds a shared
expert to every sparse block, a dense SwiGLU gated by a sigmoid.

The config is read by :mod:`.moe_config`, the checkpoint names by :mod:`.moe_weights`,
the ``dummy:`` shapes live in :mod:`.moe_presets`.

Under tensor parallelism every rank holds every expert, cut by its intermediate rows
(:mod:`pitstop.plugins.executors.tensor_parallel.sharding`); the router is whole, so every
rank chooses the same experts, and one all-reduce after the block (routed experts and the
shared expert together) sums the ranks' parts.

Weight formats: ``dense``, and ``fp8``, under which every expert is held in e4m3 with one
float32 scale per output row (quantized once at load, as the format quantizes linear
weights) and the kernel set's ``moe`` op runs weight-only GEMMs over them; the router, the
attention and the shared expert go through the format as any linear layer would (the
router stays dense, as in vLLM). Refused: ``gguf`` and GGUF files.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from pitstop.errors import ConfigError
from pitstop.plugin_system.architecture import Architecture
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.protocols import KernelSet, KernelSetBase, WeightFormat
from pitstop.plugins.kernels import reference
from pitstop.plugins.models.llama import MLP, DecoderLayer, Linear, LlamaForCausalLM
from pitstop.plugins.models.llama_rope import rotary_cache
from pitstop.plugins.models.llama_weights import ignored_checkpoint_tensor
from pitstop.plugins.models.moe_config import MOE_MODEL_TYPES, MoEModelConfig, moe_config_from_hf
from pitstop.plugins.models.moe_presets import PRESETS
from pitstop.plugins.models.moe_weights import expected_moe_shapes, map_moe_name
from pitstop.plugins.weight_formats.dense import DenseWeights
from pitstop.plugins.weight_formats.fp8 import Fp8Weights


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """A sparse layer's feed-forward block: the router and the experts, stacked by rows.

    ``router [E, H]``; ``gate_up [E * 2F, H]`` and ``down [E * H, F]`` (the layout of
    :mod:`.moe_weights`), handed to the kernel set's ``moe`` as ``[E, 2F, H]`` and
    ``[E, H, F]`` views. The router and the experts stay dense, whatever the weight format.
    """

    def __init__(
        self, cfg: MoEModelConfig, kernels: KernelSet, merged: bool, linear: Linear
    ) -> None:
        """``merged``, ``linear``: as the dense :class:`~.llama.MLP` takes them, for
        Qwen2-MoE's shared expert."""
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = _param(e, h)
        self.gate_up = _param(e * 2 * f, h)
        self.down = _param(e * h, f)
        self.moe = KernelSetBase.of(kernels, "moe") or reference.moe
        # the set's moe takes the router's weight and projects x itself, and adds a residual
        # (MoEOps.moe; the latter only where nothing else joins the block's output)
        own_op = bool(KernelSetBase.of(kernels, "moe"))
        self.moe_takes_router = own_op and bool(KernelSetBase.of(kernels, "moe_takes_router"))
        self.adds_residual = (
            own_op
            and bool(KernelSetBase.of(kernels, "moe_adds_residual"))
            and cfg.shared_expert_intermediate_size is None
            and getattr(kernels, "all_reduce", None) is None
        )
        # ... and applies the RMSNorm before it, its gain folded into router and gate_up (a
        # fused layer's post-attention norm: SparseDecoderLayer); the op projects x itself
        self.takes_norm = (
            self.adds_residual
            and self.moe_takes_router
            and bool(KernelSetBase.of(kernels, "moe_takes_norm"))
        )
        # tensor parallelism: this rank's experts' part summed over the ranks, once a block
        self.all_reduce = getattr(kernels, "all_reduce", None)
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_intermediate_size is not None:
            width = attrs.evolve(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert = MLP(width, kernels, merged, linear)
            self.shared_expert.all_reduce = None  # its part joins the block's one all-reduce
            self.shared_gate = _param(1, h)

    def quantize_experts(self) -> None:
        """Hold the experts in e4m3 with a float32 scale per output row (``weights="fp8"``):
        ``gate_up``/``down`` become float8 parameters of the same shape, the scales
        buffers ``[E, 2F]`` and ``[E, H]``. Called once, after the weights load."""
        from pitstop.plugins.weight_formats.fp8 import quantize_rows

        e = self.cfg.num_experts
        for name in ("gate_up", "down"):
            q, scale = quantize_rows(getattr(self, name).data)
            delattr(self, name)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            self.register_buffer(f"{name}_scale", scale.reshape(e, -1).contiguous())

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm_eps: float | None = None,
    ) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``: router logits, then the routed experts' weighted sum;
        ``residual`` (only where :attr:`adds_residual`): that sum added to it, by the op;
        ``norm_eps`` (only where :attr:`takes_norm`, the gain folded into ``router`` and
        ``gate_up``): ``x`` is the norm's input, normalized by the op."""
        cfg = self.cfg
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        scales = getattr(self, "gate_up_scale", None)
        if self.moe_takes_router:  # the op projects x itself (it may fuse it with the routing)
            logits, router = None, {"router": self.router}
        else:
            logits, router = self.kernels.linear(x, self.router), {}
        out = self.moe(
            x,
            logits,
            self.gate_up.view(e, 2 * f, h),
            self.down.view(e, h, f),
            cfg.num_experts_per_tok,
            renormalize=cfg.norm_topk_prob,
            weights_dtype=None if cfg.routing_weights_float32 else x.dtype,
            scales=None if scales is None else (scales, self.down_scale),
            **router,
            **({} if residual is None else {"residual": residual}),
            **({} if norm_eps is None else {"norm_eps": norm_eps}),
        )
        if self.shared_expert is not None:
            # Qwen2-MoE, as transformers: experts + sigmoid(shared_expert_gate(x)) * shared_expert(x)
            gate = torch.sigmoid(self.kernels.linear(x, self.shared_gate))
            out = out + gate * self.shared_expert(x)
        return out if self.all_reduce is None else self.all_reduce(out)

    def linear_weights(self) -> tuple[str, ...]:
        """None goes through the weight format: the experts are no linear layers of it."""
        return ()


class SparseDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward block is a :class:`SparseMoeBlock`.

    Fused (``fused.layer``): the attention half runs as a dense fused layer's does, the input
    norm inside the QKV projection (its gain folded into ``qkv_proj``, :meth:`norms_to_fold`) and
    the residual add inside the O projection (``linear_residual``); then the sparse block
    on the stream with the post-attention norm inside its op where the kernel set's ``moe``
    takes it (``moe_takes_norm``, :attr:`SparseMoeBlock.takes_norm`: the norm's gain
    folded into the router's and the experts' gate-up weights at load, each token's
    ``1/rms`` applied in the router and the gate-up GEMM), else after a norm launch of its
    own. The block adds its output to the stream inside its op where the set's ``moe`` can
    (``moe_adds_residual``; the layer returns ``(new stream, None)``), else returns it
    beside the stream, ``(block output, stream)``, the add left to the next layer (a fused
    layer adds its input to the stream first) or to the final norm. Unfused:
    :class:`~.llama.DecoderLayer`'s path.
    """

    def after_attention(
        self, o: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """O projection (+ the residual add, fused), post-attention norm, the sparse block."""
        if not self.fused:
            return super().after_attention(o, residual)
        stream = self._fused_output(o, residual)
        if self.mlp.takes_norm:  # norm, experts and the residual add inside the op
            return self.mlp(stream, residual=stream, norm_eps=self.cfg.rms_norm_eps), None
        h, _ = self.kernels.rms_norm(stream, self.post_attention_layernorm, self.cfg.rms_norm_eps)
        if self.mlp.adds_residual:  # the stream plus the block's output, from the op's last kernel
            return self.mlp(h, residual=stream), None
        return self.mlp(h), stream

    def norms_to_fold(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The input norm's gain into ``qkv_proj``; the post-attention norm's into the
        router and the experts' gate-up rows where the op takes the norm
        (:attr:`SparseMoeBlock.takes_norm`), else it keeps its own."""
        attention = ((self.self_attn.qkv_proj, self.input_layernorm),)
        if not self.mlp.takes_norm:
            return attention
        post = self.post_attention_layernorm
        return (*attention, (self.mlp.router, post), (self.mlp.gate_up, post))


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE, Qwen2-MoE and Mixtral: the Llama decoder with sparse feed-forward blocks."""

    supports_tensor_parallel = True  # each expert cut by its intermediate rows (module doc)
    loads_quantized_weights = False
    shapes_of = staticmethod(expected_moe_shapes)
    name_map = staticmethod(map_moe_name)

    def __init__(
        self, cfg: MoEModelConfig, kernels: KernelSet, weights: WeightFormat | None = None
    ) -> None:
        if weights is not None and not isinstance(weights, DenseWeights | Fp8Weights):
            raise ConfigError(
                f"weights={weights.name!r}: the {cfg.architecture} model holds its experts "
                "dense or in fp8 (the MoE op reads 16/32-bit or e4m3 expert weights); "
                "use weights='dense' or weights='fp8'"
            )
        super().__init__(cfg, kernels, weights)

    def prepare_weights(self, blocks: dict | None = None) -> None:
        """The format's linear weights (:meth:`LlamaForCausalLM.prepare_weights`), then,
        under ``fp8``, every sparse block's experts in e4m3 (module doc)."""
        super().prepare_weights(blocks)
        if isinstance(self.weights, Fp8Weights):
            for layer in self.layers:
                if isinstance(layer.mlp, SparseMoeBlock):
                    layer.mlp.quantize_experts()

    def make_layer(self, index: int) -> nn.Module:
        """Decoder layer ``index``: sparse when the config lists it, else a dense SwiGLU; both
        fused where the model fuses its layers (:meth:`~.llama.LlamaForCausalLM._fuses_layers`:
        ``fused.layer``, merged dense weights, no tensor parallelism)."""
        cfg = self.cfg
        assert isinstance(cfg, MoEModelConfig)
        args = (cfg, self.kernels, self.merged, self.linear, self.fused_layers)
        if index not in cfg.sparse_layers:
            return DecoderLayer(*args)
        return SparseDecoderLayer(*args, mlp=SparseMoeBlock(*args[:4]))


def make_moe(
    model_config: MoEModelConfig, kernels: KernelSet, *, weights: WeightFormat | None = None
) -> MoEForCausalLM:
    """A Qwen3-MoE, Qwen2-MoE or Mixtral model running on ``kernels`` (weights: ``dense`` only)."""
    return MoEForCausalLM(model_config, kernels, weights)


@hookimpl
def register_models(register) -> None:
    """Register ``Qwen3MoeForCausalLM`` (model_type ``qwen3_moe``), ``Qwen2MoeForCausalLM``
    (``qwen2_moe``) and ``MixtralForCausalLM`` (``mixtral``), with their ``dummy:`` presets;
    no GGUF reader."""
    for model_type, arch in MOE_MODEL_TYPES.items():
        rules = Architecture(
            config_from_hf=moe_config_from_hf,
            weight_shapes=expected_moe_shapes,
            rotary=rotary_cache,
            ignored_tensor=ignored_checkpoint_tensor,
            model_types=(model_type,),
            presets={name: c for name, c in PRESETS.items() if c.architecture == arch},
        )
        register(arch, make_moe, architecture=rules)
