"""The Llama family (Llama, Qwen2, Qwen3) written against a kernel set.

One module serves the three architectures: Qwen2 adds a bias to the q, k and
v projections, Qwen3 an RMSNorm on every head of q and k. Every op goes
through the selected kernel set; the model never calls a kernel library
directly. Weight names are Hugging Face's; the model maps them onto its own
(merged q/k/v and gate/up weights when the kernel set asks for them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pitstop.attention import AttentionMetadata
from pitstop.errors import ModelLoadError
from pitstop.hookspecs import hookimpl
from pitstop.model_config import ModelConfig
from pitstop.protocols import KernelSet, RotaryCache


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def rotary_cache(cfg: ModelConfig, max_positions: int, device: torch.device) -> RotaryCache:
    """cos/sin tables ``[max_positions, head_size/2]`` in float32 (with Llama 3 scaling if set)."""
    dim = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    return RotaryCache(cos=freqs.cos().to(device), sin=freqs.sin().to(device))


class Attention(nn.Module):
    """Self-attention over the paged KV cache."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, merged: bool) -> None:
        super().__init__()
        self.cfg, self.kernels, self.merged = cfg, kernels, merged
        d, hq, hkv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
        self.q_size, self.kv_size = hq * d, hkv * d
        if merged:
            self.qkv_proj = _param(self.q_size + 2 * self.kv_size, cfg.hidden_size)
            self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        else:
            self.q_proj = _param(self.q_size, cfg.hidden_size)
            self.k_proj = _param(self.kv_size, cfg.hidden_size)
            self.v_proj = _param(self.kv_size, cfg.hidden_size)
            if cfg.attention_bias:
                self.q_bias, self.k_bias, self.v_bias = (
                    _param(self.q_size),
                    _param(self.kv_size),
                    _param(self.kv_size),
                )
            else:
                self.q_bias = self.k_bias = self.v_bias = None
        self.o_proj = _param(cfg.hidden_size, self.q_size)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = _param(d), _param(d)
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Project, normalize (Qwen3), rotate and store, attend, project back."""
        kn, cfg = self.kernels, self.cfg
        t = x.shape[0]
        if self.merged:
            qkv = kn.linear(x, self.qkv_proj, self.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q = kn.linear(x, self.q_proj, self.q_bias)
            k = kn.linear(x, self.k_proj, self.k_bias)
            v = kn.linear(x, self.v_proj, self.v_bias)
        q = q.reshape(t, cfg.num_heads, cfg.head_size)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_size)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_size)
        if cfg.qk_norm:
            q = kn.rms_norm(q, self.q_norm, cfg.rms_norm_eps)[0]
            k = kn.rms_norm(k, self.k_norm, cfg.rms_norm_eps)[0]
        q, _ = kn.rope_and_store(q, k, v, rotary, k_cache, v_cache, meta)
        o = kn.attention(q, k_cache, v_cache, meta, self.scale)
        return kn.linear(o.reshape(t, self.q_size), self.o_proj)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, merged: bool) -> None:
        super().__init__()
        self.kernels, self.merged = kernels, merged
        if merged:
            self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size)
        else:
            self.gate_proj = _param(cfg.intermediate_size, cfg.hidden_size)
            self.up_proj = _param(cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gate, up, SiLU-and-mul, down."""
        kn = self.kernels
        if self.merged:
            gate_up = kn.linear(x, self.gate_up_proj)
        else:
            gate_up = torch.cat([kn.linear(x, self.gate_proj), kn.linear(x, self.up_proj)], dim=-1)
        return kn.linear(kn.silu_and_mul(gate_up), self.down_proj)


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each with a residual connection."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, merged: bool) -> None:
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        self.self_attn = Attention(cfg, kernels, merged)
        self.mlp = MLP(cfg, kernels, merged)
        self.input_layernorm = _param(cfg.hidden_size)
        self.post_attention_layernorm = _param(cfg.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream), the add deferred to the next norm."""
        eps, kn = self.cfg.rms_norm_eps, self.kernels
        if residual is None:
            h, _ = kn.rms_norm(x, self.input_layernorm, eps)
            residual = x
        else:
            h, residual = kn.rms_norm(x, self.input_layernorm, eps, residual)
        h = self.self_attn(h, rotary, k_cache, v_cache, meta)
        h, residual = kn.rms_norm(h, self.post_attention_layernorm, eps, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama, Qwen2 and Qwen3: token ids in, hidden states out; logits for chosen rows."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet) -> None:
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        merged = bool(getattr(kernels, "merge_projections", False))
        self.merged = merged
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, kernels, merged) for _ in range(cfg.num_layers)
        )
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        rotary: RotaryCache,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm. ``kv_cache``: ``[L, 2, pages, page, Hkv, D]``."""
        x = self.embed_tokens[input_ids]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rotary, kv_cache[i, 0], kv_cache[i, 1], meta)
        x, _ = self.kernels.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` of the given hidden rows, in float32."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.kernels.linear(hidden, head).float()

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, merging q/k/v and gate/up when the model is merged."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.cfg
        for name, tensor in weights:
            target, offset = self._map_name(name)
            if target is None:
                continue
            if target not in params:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has no place in a {cfg.architecture} model"
                )
            param = params[target]
            if offset is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
            else:
                param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(name)
        missing = [n for n in self.expected_weight_names() if n not in loaded]
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks {len(missing)} tensor(s) a {cfg.architecture} model needs, e.g. {missing[:3]}"
            )

    def expected_weight_names(self) -> list[str]:
        """The Hugging Face tensor names a checkpoint of this shape must contain."""
        cfg = self.cfg
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if cfg.attention_bias:
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if cfg.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def _map_name(self, name: str) -> tuple[str | None, int | None]:
        """HF name -> (parameter name, row offset into a merged weight or None)."""
        cfg = self.cfg
        if name == "model.embed_tokens.weight":
            return "embed_tokens", None
        if name == "model.norm.weight":
            return "norm", None
        if name == "lm_head.weight":
            return (None, None) if cfg.tie_word_embeddings else ("lm_head", None)
        if not name.startswith("model.layers."):
            return None, None  # e.g. rotary inv_freq buffers
        rest = name[len("model.layers.") :]
        idx, _, local = rest.partition(".")
        p = f"layers.{idx}."
        q_size = cfg.num_heads * cfg.head_size
        kv_size = cfg.num_kv_heads * cfg.head_size
        table = {
            "input_layernorm.weight": ("input_layernorm", None),
            "post_attention_layernorm.weight": ("post_attention_layernorm", None),
            "self_attn.o_proj.weight": ("self_attn.o_proj", None),
            "self_attn.q_norm.weight": ("self_attn.q_norm", None),
            "self_attn.k_norm.weight": ("self_attn.k_norm", None),
            "mlp.down_proj.weight": ("mlp.down_proj", None),
        }
        if self.merged:
            table |= {
                "self_attn.q_proj.weight": ("self_attn.qkv_proj", 0),
                "self_attn.k_proj.weight": ("self_attn.qkv_proj", q_size),
                "self_attn.v_proj.weight": ("self_attn.qkv_proj", q_size + kv_size),
                "self_attn.q_proj.bias": ("self_attn.qkv_bias", 0),
                "self_attn.k_proj.bias": ("self_attn.qkv_bias", q_size),
                "self_attn.v_proj.bias": ("self_attn.qkv_bias", q_size + kv_size),
                "mlp.gate_proj.weight": ("mlp.gate_up_proj", 0),
                "mlp.up_proj.weight": ("mlp.gate_up_proj", cfg.intermediate_size),
            }
        else:
            table |= (
                {f"self_attn.{x}_proj.weight": (f"self_attn.{x}_proj", None) for x in "qkv"}
                | {f"self_attn.{x}_proj.bias": (f"self_attn.{x}_bias", None) for x in "qkv"}
                | {f"mlp.{x}_proj.weight": (f"mlp.{x}_proj", None) for x in ("gate", "up")}
            )
        if local not in table:
            return None, None
        target, offset = table[local]
        return p + target, offset

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor name -> shape, for every tensor a checkpoint of this model holds."""
        cfg = self.cfg
        h, d, f = cfg.hidden_size, cfg.head_size, cfg.intermediate_size
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {}
        for name in self.expected_weight_names():
            local = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else name
            shapes[name] = {
                "model.embed_tokens.weight": (cfg.vocab_size, h),
                "lm_head.weight": (cfg.vocab_size, h),
                "model.norm.weight": (h,),
                "q_proj": (q, h) if name.endswith("weight") else (q,),
                "k_proj": (kv, h) if name.endswith("weight") else (kv,),
                "v_proj": (kv, h) if name.endswith("weight") else (kv,),
                "o_proj": (h, q),
                "gate_proj": (f, h),
                "up_proj": (f, h),
                "down_proj": (h, f),
                "q_norm": (d,),
                "k_norm": (d,),
                "input_layernorm": (h,),
                "post_attention_layernorm": (h,),
            }[local]
        return shapes

    def init_dummy(self, seed: int = 0) -> None:
        """Random weights (speed does not depend on them), drawn per Hugging Face tensor.

        Drawing per checkpoint tensor, not per parameter, gives the same model
        whether or not this kernel set merges q/k/v and gate/up.
        """
        device = self.embed_tokens.device
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = self.embed_tokens.dtype

        def tensors():
            for name, shape in self.weight_shapes().items():
                if len(shape) == 1 and not name.endswith("bias"):
                    yield name, torch.ones(shape, dtype=dtype, device=device)  # norm weights
                else:
                    t = torch.empty(shape, dtype=dtype, device=device)
                    yield name, t.normal_(0.0, 0.02, generator=gen)

        self.load_weights(tensors())


def make_llama(model_config: ModelConfig, kernels: KernelSet) -> LlamaForCausalLM:
    """A Llama-family model (Llama, Qwen2, Qwen3) running on ``kernels``."""
    return LlamaForCausalLM(model_config, kernels)


@hookimpl
def register_models(register) -> None:
    """Register the Llama family under the architecture names checkpoints use."""
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        register(arch, make_llama)
