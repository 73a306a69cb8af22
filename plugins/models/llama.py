"""The Llama family (Llama, Qwen2, Qwen3) written against a kernel set.

One module serves the three architectures: Qwen2 adds a bias to the q, k and
v projections, Qwen3 an RMSNorm on every head of q and k; Llama (and Qwen3)
checkpoints may carry biases on every attention projection (``attention_bias``)
and Llama ones on the MLP (``mlp_bias``). Every op goes
through the selected kernel set; the model never calls a kernel library
directly. Weight names are Hugging Face's; the model maps them onto its own
(merged q/k/v and gate/up weights when the kernel set asks for them).

The family's loading rules live beside it: :mod:`.llama_config` reads a
``config.json``, :mod:`.llama_gguf` a GGUF file, :mod:`.llama_rope` computes the
rotary frequencies; :func:`register_models` hands them to the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pitstop.errors import ModelLoadError
from pitstop.ground.attention import AttentionMetadata
from pitstop.ground.model_config import ModelConfig
from pitstop.plugin_system.architecture import Architecture
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.protocols import (
    KeepsBlocks,
    KernelSet,
    KernelSetBase,
    RotaryCache,
    WeightFormat,
)
from pitstop.plugins.kernels.lora_reference import NEXT_LAYER_QKV
from pitstop.plugins.model_sources.gguf.quantized import QuantizedWeight, RowMerger
from pitstop.plugins.models.llama_config import HF_MODEL_TYPES, config_from_hf
from pitstop.plugins.models.llama_gguf import gguf_rules
from pitstop.plugins.models.llama_presets import PRESETS
from pitstop.plugins.models.llama_rope import rotary_cache
from pitstop.plugins.models.llama_weights import (
    _same_tensor,
    check_tied_head,
    dummy_weights,
    expected_weight_shapes,
    ignored_checkpoint_tensor,
    map_hf_name,
)
from pitstop.plugins.weight_formats.dense import DenseWeights

Linear = Callable[..., torch.Tensor]  # a weight format's linear(x, resident, bias=None)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Attention(nn.Module):
    """Self-attention over the paged KV cache."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, merged: bool, linear: Linear) -> None:
        super().__init__()
        self.cfg, self.kernels, self.merged = cfg, kernels, merged
        self.linear = linear  # the weight format's: every projection's weight is its resident
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
        self.o_bias = _param(cfg.hidden_size) if cfg.o_proj_bias else None
        if cfg.qk_norm:
            self.q_norm, self.k_norm = _param(d), _param(d)
        # Qwen3's q/k norm handed to rope_and_store (normalized and rotated in one pass) when the
        # kernel set declares it fuses them; else two rms_norm calls first.
        self.fuse_qk_norm = cfg.qk_norm and bool(KernelSetBase.of(kernels, "fuses_qk_norm"))
        # a fused layer's input norm + QKV, which may leave the row scale to rope_and_store
        self.norm_qkv = KernelSetBase.of(kernels, "norm_linear_deferred")
        self.scale = d**-0.5
        # The K and V scales of an fp8 KV cache (stored value = value / scale); unused by
        # wider caches. A buffer, so it follows the model's device; 1.0 (see docs/configuration.md).
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32), persistent=False)
        # tensor parallelism (pitstop.plugins.executors.tensor_parallel): sums o_proj's partial
        # outputs over the ranks
        self.all_reduce = getattr(kernels, "all_reduce", None)

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Project, normalize (Qwen3), rotate and store, attend, project back."""
        q = self.project(x, rotary, k_cache, v_cache, meta)
        return self.output(self.attend(q, k_cache, v_cache, meta))

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of the rotated q over the paged cache (this layer's softmax and KV scales)."""
        return self.kernels.attention(
            q, k_cache, v_cache, meta, self.scale, **self._scales(k_cache)
        )

    def _scales(self, cache: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ``kv_scale`` argument of the cache ops for an fp8 cache; none for a wider one
        (so a kernel set without fp8 support keeps working with the model's dtype)."""
        return {"kv_scale": self.kv_scale} if cache.element_size() == 1 else {}

    def project(
        self,
        x: torch.Tensor,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        norm_eps: float | None = None,
        lora: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Everything before attention: q/k/v, q/k norms, rotary and the K/V store; returns q.

        ``norm_eps`` (a fused layer, :class:`DecoderLayer`): ``x`` is the un-normalized
        residual stream and the input norm runs inside the QKV projection
        (the kernel set's ``norm_linear_deferred``; its gain was folded into ``qkv_proj`` at
        load), or its row scale inside ``rope_and_store`` where the set defers it; ``lora``
        (``{"lora": delta}`` or empty): an adapter's delta the QKV projection adds inside.

        The q/k norms (Qwen3) run inside ``rope_and_store`` when the kernel set
        declares ``fuses_qk_norm`` (:class:`~pitstop.plugin_system.protocols.KernelSetBase`),
        else through its ``rms_norm`` first.

        Reads only ``meta.positions`` and ``meta.slot_mapping`` (device tensors),
        so it can be captured in a CUDA graph for any batch shape.
        """
        kn, cfg, linear = self.kernels, self.cfg, self.linear
        t = x.shape[0]
        row_scale = None
        if norm_eps is not None and cfg.qk_norm and not self.fuse_qk_norm:
            # the q/k norms run before rope_and_store: the row scale cannot wait for it
            qkv = kn.norm_linear(x, self.qkv_proj, norm_eps, self.qkv_bias, **(lora or {}))
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        elif norm_eps is not None:
            qkv, row_scale = self.norm_qkv(
                x, self.qkv_proj, norm_eps, self.qkv_bias, **(lora or {})
            )
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        elif self.merged:
            qkv = linear(x, self.qkv_proj, self.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q = linear(x, self.q_proj, self.q_bias)
            k = linear(x, self.k_proj, self.k_bias)
            v = linear(x, self.v_proj, self.v_bias)
        q = q.reshape(t, cfg.num_heads, cfg.head_size)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_size)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_size)
        norm: dict[str, Any] = {}
        if self.fuse_qk_norm:
            norm = {"qk_norm": (self.q_norm, self.k_norm), "qk_norm_eps": cfg.rms_norm_eps}
        elif cfg.qk_norm:
            q = kn.rms_norm(q, self.q_norm, cfg.rms_norm_eps)[0]
            k = kn.rms_norm(k, self.k_norm, cfg.rms_norm_eps)[0]
        if row_scale is not None:  # the QKV GEMM left its rows' norm scale to this op
            norm["row_scale"] = row_scale
        scales = self._scales(k_cache)
        q, _ = kn.rope_and_store(q, k, v, rotary, k_cache, v_cache, meta, **scales, **norm)
        return q

    def linear_weights(self) -> tuple[str, ...]:
        """The attribute names of its linear weights."""
        return ("qkv_proj", "o_proj") if self.merged else ("q_proj", "k_proj", "v_proj", "o_proj")

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of attention's result ``[T, heads, head_size]``."""
        out = self.linear(o.reshape(o.shape[0], self.q_size), self.o_proj, self.o_bias)
        return out if self.all_reduce is None else self.all_reduce(out)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet, merged: bool, linear: Linear) -> None:
        super().__init__()
        self.kernels, self.merged, self.linear = kernels, merged, linear
        f, bias = cfg.intermediate_size, cfg.mlp_bias
        if merged:
            self.gate_up_proj = _param(2 * f, cfg.hidden_size)
            self.gate_up_bias = _param(2 * f) if bias else None
        else:
            self.gate_proj = _param(f, cfg.hidden_size)
            self.up_proj = _param(f, cfg.hidden_size)
            self.gate_bias = _param(f) if bias else None
            self.up_bias = _param(f) if bias else None
        self.down_proj = _param(cfg.hidden_size, f)
        self.down_bias = _param(cfg.hidden_size) if bias else None
        self.all_reduce = getattr(kernels, "all_reduce", None)  # tensor parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gate, up, SiLU-and-mul, down."""
        linear = self.linear
        if self.merged:
            gate_up = linear(x, self.gate_up_proj, self.gate_up_bias)
        else:
            gate = linear(x, self.gate_proj, self.gate_bias)
            gate_up = torch.cat([gate, linear(x, self.up_proj, self.up_bias)], dim=-1)
        out = linear(self.kernels.silu_and_mul(gate_up), self.down_proj, self.down_bias)
        return out if self.all_reduce is None else self.all_reduce(out)

    def linear_weights(self) -> tuple[str, ...]:
        """The attribute names of its linear weights."""
        return (
            ("gate_up_proj", "down_proj") if self.merged else ("gate_proj", "up_proj", "down_proj")
        )


FOLD_ROWS = 1 << 14  # DecoderLayer.fold_norms widens this many weight rows at a time


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each with a residual connection.

    Fused (``fused=True``, a kernel set with ``fuses_layer``): the layer reads and writes
    the residual stream itself and runs as six ops, the norms inside the projections
    after them (their gains folded into those weights by :meth:`fold_norms`) and the
    residual adds inside the projections before them (``linear_residual``); its
    :meth:`before_attention` and :meth:`after_attention` then pass no separate residual.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        kernels: KernelSet,
        merged: bool,
        linear: Linear,
        fused: bool = False,
        mlp: nn.Module | None = None,
    ) -> None:
        """``mlp``: the feed-forward block (default the SwiGLU :class:`MLP`; a sparse
        mixture of experts in :mod:`.moe`, whose layer, :class:`.moe.SparseDecoderLayer`,
        fuses only its attention half)."""
        super().__init__()
        self.cfg, self.kernels, self.fused = cfg, kernels, fused
        self.self_attn = Attention(cfg, kernels, merged, linear)
        self.mlp = mlp if mlp is not None else MLP(cfg, kernels, merged, linear)
        self.input_layernorm = _param(cfg.hidden_size)
        self.post_attention_layernorm = _param(cfg.hidden_size)
        # fused: an adapter plugin's delta of each projection (by attribute name: qkv_proj,
        # o_proj, gate_up_proj, down_proj), added inside the fused ops (``lora=``)
        self.projection_lora: dict[str, Any] = {}

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
        q, residual = self.before_attention(x, residual, rotary, k_cache, v_cache, meta)
        o = self.self_attn.attend(q, k_cache, v_cache, meta)
        return self.after_attention(o, residual)

    def before_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (with the deferred residual add) and attention's projections: (q, residual)."""
        eps, kn = self.cfg.rms_norm_eps, self.kernels
        if self.fused:  # x is the residual stream; the norm runs inside the QKV projection
            stream = x if residual is None else x + residual
            lora = self._lora("qkv_proj")
            q = self.self_attn.project(stream, rotary, k_cache, v_cache, meta, eps, lora)
            return q, stream
        if residual is None:
            h, _ = kn.rms_norm(x, self.input_layernorm, eps)
            residual = x
        else:
            h, residual = kn.rms_norm(x, self.input_layernorm, eps, residual)
        return self.self_attn.project(h, rotary, k_cache, v_cache, meta), residual

    def after_attention(
        self, o: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, post-attention norm and the MLP: (output, residual).

        Fused: ``residual`` is the stream ``before_attention`` returned; the result is the
        new stream and no residual (``(stream, None)``).
        """
        if self.fused:
            return self._fused_after_attention(o, residual), None
        h = self.self_attn.output(o)
        h, residual = self.kernels.rms_norm(
            h, self.post_attention_layernorm, self.cfg.rms_norm_eps, residual
        )
        return self.mlp(h), residual

    def _fused_after_attention(self, o: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """O projection + residual add, norm + gate-up + SiLU·mul, down + residual add."""
        mlp, kn = self.mlp, self.kernels
        stream = self._fused_output(o, stream, **self._next("gate_up_proj"))
        eps, lora = self.cfg.rms_norm_eps, self._lora("gate_up_proj")
        act = kn.norm_gate_up(
            stream, mlp.gate_up_proj, eps, mlp.gate_up_bias, **lora, **self._next("down_proj")
        )
        return kn.linear_residual(
            act, mlp.down_proj, stream, mlp.down_bias, **self._lora("down_proj"),
            **self._next(NEXT_LAYER_QKV),
        )  # fmt: skip

    def _fused_output(self, o: torch.Tensor, stream: torch.Tensor, **after: Any) -> torch.Tensor:
        """A fused layer's O projection of attention's ``o``, added into ``stream``; ``after``:
        the gate-up projection's ``next_lora`` (:meth:`_next`), if any."""
        attn = self.self_attn
        o2 = o.reshape(o.shape[0], attn.q_size)
        return self.kernels.linear_residual(
            o2, attn.o_proj, stream, attn.o_bias, **self._lora("o_proj"), **after
        )

    def _lora(self, name: str) -> dict[str, Any]:
        """``{"lora": delta}`` for a projection an adapter plugin adapts, else empty (so that a
        kernel set without adapter support is called as before)."""
        delta = self.projection_lora.get(name)
        return {} if delta is None else {"lora": delta}

    def _next(self, name: str) -> dict[str, Any]:
        """``{"next_lora": delta}`` where the projection ``name`` (``NEXT_LAYER_QKV``: the next
        layer's QKV) reads its shrink from the op before it (its ``h_in``), else empty."""
        delta = self.projection_lora.get(name)
        return {} if getattr(delta, "h_in", None) is None else {"next_lora": delta}

    def fold_norms(self) -> None:
        """Multiply each RMSNorm's gain into the projection after it (``W' = W * g``), once.

        In float32, rounded once to the weight's dtype, for each pair of
        :meth:`norms_to_fold` (a block of rows at a time: an MoE layer's experts are large);
        the norm weights stay as loaded (nothing else reads them in a fused layer).
        """
        for weight, gain in self.norms_to_fold():
            g = gain.data.float()[None, :]
            for rows in weight.data.split(FOLD_ROWS):
                rows.copy_(rows.float() * g)

    def norms_to_fold(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """``(projection weight, norm gain)`` pairs of :meth:`fold_norms`: the input norm's
        gain into ``qkv_proj``, the post-attention norm's into ``gate_up_proj``."""
        return (
            (self.self_attn.qkv_proj, self.input_layernorm),
            (self.mlp.gate_up_proj, self.post_attention_layernorm),
        )


class LlamaForCausalLM(nn.Module):
    """Llama, Qwen2 and Qwen3: token ids in, hidden states out; logits for chosen rows."""

    # built from one rank's shard_model_config, it runs that rank's part
    # (pitstop.plugins.executors.tensor_parallel)
    supports_tensor_parallel = True
    # load_weights takes QuantizedWeight items (a GGUF file's blocks, for weights=gguf)
    loads_quantized_weights = True

    def __init__(
        self, cfg: ModelConfig, kernels: KernelSet, weights: WeightFormat | None = None
    ) -> None:
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        # how each linear weight is held and multiplied (pitstop.plugin_system.protocols.WeightFormat)
        self.weights = weights if weights is not None else DenseWeights(kernels)
        self.linear = self.weights.linear
        merged = bool(kernels.merge_projections)
        self.merged = merged
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        # tensor parallelism: the vocabulary-parallel embedding and head (None: the whole vocabulary)
        self.vocab_embed = getattr(kernels, "embed", None)
        self.gather_logits = getattr(kernels, "gather_logits", None)
        self.fused_layers = self._fuses_layers(kernels)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        # True once the weight format holds the embedding (a KeepsBlocks format, given the
        # embedding's quantized blocks): it then also is the tied head
        self.embed_held = False

    shapes_of = staticmethod(expected_weight_shapes)  # config -> {HF name: shape} (moe.py: own)
    name_map = staticmethod(map_hf_name)  # (config, merged, HF name) -> (parameter, row offset)

    def make_layer(self, index: int) -> nn.Module:
        """Decoder layer ``index`` (every one alike here)."""
        del index
        return DecoderLayer(self.cfg, self.kernels, self.merged, self.linear, self.fused_layers)

    def _fuses_layers(self, kernels: KernelSet) -> bool:
        """Whether the layers run fused (:class:`DecoderLayer`): the kernel set declares
        ``fuses_layer``, the weights are dense and merged (the gains fold into the
        checkpoint's values), and no tensor-parallel all-reduce sits between a projection
        and its residual add."""
        return (
            bool(KernelSetBase.of(kernels, "fuses_layer"))
            and self.merged
            and isinstance(self.weights, DenseWeights)
            and getattr(kernels, "all_reduce", None) is None
            and self.vocab_embed is None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        rotary: RotaryCache,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm. ``kv_cache``: ``[L, 2, pages, page, Hkv, D]``."""
        x = self.embed(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rotary, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``input_ids`` ``[T, hidden]``."""
        if self.embed_held:
            return self.weights.embedding(self.embed_tokens, input_ids)
        if self.vocab_embed is None:
            return self.embed_tokens[input_ids]
        return self.vocab_embed(self.embed_tokens, input_ids)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last norm (with the deferred residual add): hidden states ``[T, hidden]``."""
        return self.kernels.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` of the given hidden rows, in the model's dtype: the sampler
        widens what it computes on (a greedy batch's argmax needs no float32 copy: at
        ``nano``'s 256 rows of ``qwen3-0.6b`` the copy and a float32 argmax took 178 µs of a
        5.8 ms step on the H200, 2026-12-06)."""
        if self.lm_head is None:  # tied: the embedding, dense unless the format holds it
            linear = self.linear if self.embed_held else self.kernels.linear
            logits = linear(hidden, self.embed_tokens)
        else:
            logits = self.linear(hidden, self.lm_head)
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        return logits

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, merging q/k/v and gate/up when the model is merged.

        Each tensor arrives in the checkpoint's dtype and is cast once, by the copy into
        its parameter. A :class:`~pitstop.plugins.model_sources.gguf.quantized.QuantizedWeight` (a GGUF
        file's blocks, which the weight format takes) is kept as it is, the parts of a
        merged weight stacked by rows, and handed to the format whole. A tensor that
        maps to nothing is an error (listing the first few), as is a missing one, a
        wrong shape, or a tied ``lm_head.weight`` that differs from the embedding.
        """
        params = dict(self.named_parameters())
        expected = self.shapes_of(self.cfg)
        loaded: set[str] = set()
        unknown: list[str] = []
        tied_head: torch.Tensor | None = None
        cfg = self.cfg
        merger = RowMerger(self._parts_per_weight(expected))
        blocks: dict[str, QuantizedWeight] = {}
        for name, tensor in weights:
            if ignored_checkpoint_tensor(name):
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                tied_head = tensor  # checked against the embedding once that is loaded
                continue
            target, offset = self.name_map(self.cfg, self.merged, name)
            if target is None or target not in params or name not in expected:
                unknown.append(name)
                del tensor
                continue
            if tuple(tensor.shape) != expected[name]:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {expected[name]}"
                )
            param = params[target]
            if isinstance(tensor, QuantizedWeight):
                self._keep_blocks(target, offset, tensor, merger, blocks, param)
            elif offset is None:
                param.data.copy_(tensor)
            else:
                param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(name)
            del tensor  # so the source allocates the next one only after this one is freed
        if unknown:
            raise ModelLoadError(
                f"checkpoint has {len(unknown)} tensor(s) a {cfg.architecture} model of this "
                f"config has no place for, e.g. {unknown[:5]}; pitstop refuses rather than skips "
                "them (they would change the output)"
            )
        missing = [n for n in expected if n not in loaded]
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks {len(missing)} tensor(s) a {cfg.architecture} model needs, e.g. {missing[:3]}"
            )
        for target, offset, part in merger.take_unfinished():  # some parts came dense
            params[target].data[offset : offset + part.shape[0]].copy_(part.dequantize())
        if tied_head is not None and "embed_tokens" not in blocks:  # GGUF never has both
            check_tied_head(tied_head, self.embed_tokens)
        if self.fused_layers:
            for layer in self.layers:
                layer.fold_norms()
        self.prepare_weights(blocks)

    def _parts_per_weight(self, expected: dict[str, tuple[int, ...]]) -> dict[str, int]:
        """Model weight -> how many checkpoint tensors fill it (3 for a merged q/k/v)."""
        parts: dict[str, int] = {}
        for name in expected:
            target, _ = self.name_map(self.cfg, self.merged, name)
            if target is not None and name.endswith(".weight"):
                parts[target] = parts.get(target, 0) + 1
        return parts

    def _keep_blocks(
        self,
        target: str,
        offset: int | None,
        weight: QuantizedWeight,
        merger: RowMerger,
        blocks: dict[str, QuantizedWeight],
        param: nn.Parameter,
    ) -> None:
        """Keep a weight's quantized blocks for the format (whole once all its parts are
        in); an embedding the format cannot hold is dequantized into its parameter."""
        if target == "embed_tokens" and not self._format_holds_embedding():
            param.data.copy_(weight.dequantize())
            return
        merged = merger.add(target, offset, weight)
        if merged is not None:
            blocks[target] = merged

    def _format_holds_embedding(self) -> bool:
        return self.vocab_embed is None and isinstance(self.weights, KeepsBlocks)

    def linear_slots(self) -> Iterator[tuple[nn.Module, str, str]]:
        """(module, attribute, name) of every linear weight: the projections of each layer
        (merged or not, as loaded) and an untied output head; the embedding is no linear."""
        for i, layer in enumerate(self.layers):
            for part, module in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                for attr in module.linear_weights():
                    yield module, attr, f"layers.{i}.{part}.{attr}"
        if not self.cfg.tie_word_embeddings:
            yield self, "lm_head", "lm_head"

    def prepare_weights(self, blocks: dict[str, QuantizedWeight] | None = None) -> None:
        """Hand each loaded linear weight to the weight format once and keep what it returns.

        A format that keeps the tensor (``dense``) leaves the parameter as it is; any
        other resident replaces it, and the dense tensor is freed as soon as its resident
        exists (the peak is the dense model plus one prepared weight). ``blocks``: the
        weights loaded as quantized blocks (by model name), handed over instead of their
        (never written) parameters; ``"embed_tokens"`` among them goes to the format too.
        Called at the end of :meth:`load_weights`; the weights load once.
        """
        blocks = blocks or {}
        slots = list(self.linear_slots())
        if "embed_tokens" in blocks:
            slots.append((self, "embed_tokens", "embed_tokens"))
        for module, attr, name in slots:
            weight = getattr(module, attr)
            if not isinstance(weight, nn.Parameter):
                raise ModelLoadError(
                    f"the {self.cfg.architecture} model's weights were already prepared for "
                    f"weights={self.weights.name!r}; load a model's weights once"
                )
            resident = self.weights.prepare(name, blocks.pop(name, weight.data))
            if _same_tensor(resident, weight):
                continue
            delattr(module, attr)
            del weight
            object.__setattr__(module, attr, resident)
            self.embed_held = self.embed_held or name == "embed_tokens"

    def weight_bytes(self) -> int:
        """Device bytes of the weights as held: dense parameters and buffers, plus the
        weight format's ``resident_bytes`` of every linear weight it replaced."""
        tensors = [*self.parameters(), *self.buffers()]
        total = sum(t.numel() * t.element_size() for t in tensors)
        held = [getattr(module, attr) for module, attr, _ in self.linear_slots()]
        if self.embed_held:
            held.append(self.embed_tokens)
        for resident in held:
            if not isinstance(resident, nn.Parameter):
                total += self.weights.resident_bytes(resident)
        return total

    def expected_weight_names(self) -> list[str]:
        """The Hugging Face tensor names a checkpoint of this shape must contain."""
        return list(self.shapes_of(self.cfg))

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor name -> shape, for every tensor a checkpoint of this model holds."""
        return self.shapes_of(self.cfg)

    def init_dummy(self, seed: int = 0, shard: Any = None) -> None:
        """Random weights (speed does not depend on them), drawn per Hugging Face tensor.

        Drawing per checkpoint tensor, not per parameter, gives the same model
        whether or not this kernel set merges q/k/v and gate/up; a tensor-parallel
        ``shard`` (:class:`~pitstop.plugins.executors.tensor_parallel.sharding.WeightShard`)
        keeps this rank's part of each, so the values are the same whatever the
        tensor-parallel size.
        """
        param = self.embed_tokens
        if shard is None:
            self.load_weights(dummy_weights(self.weight_shapes(), seed, param.device, param.dtype))
            return
        # a tensor-parallel rank: the whole model's tensors drawn (one at a time), its parts kept
        whole = self.shapes_of(shard.model_config)
        self.load_weights(shard.take_all(dummy_weights(whole, seed, param.device, param.dtype)))


def make_llama(
    model_config: ModelConfig, kernels: KernelSet, *, weights: WeightFormat | None = None
) -> LlamaForCausalLM:
    """A Llama-family model (Llama, Qwen2, Qwen3) running on ``kernels``, its linear
    weights held by ``weights`` (default: dense)."""
    return LlamaForCausalLM(model_config, kernels, weights)


@hookimpl
def register_models(register) -> None:
    """Register the Llama family under the architecture names checkpoints use: one
    reader of config.json (llama_config) and of GGUF files (llama_gguf) for all three;
    llama.cpp names each member's GGUF architecture as config.json names its model_type."""
    for model_type, arch in HF_MODEL_TYPES.items():
        rules = Architecture(
            config_from_hf=config_from_hf,
            weight_shapes=expected_weight_shapes,
            rotary=rotary_cache,
            ignored_tensor=ignored_checkpoint_tensor,
            model_types=(model_type,),
            gguf=gguf_rules(model_type),
            presets={name: c for name, c in PRESETS.items() if c.architecture == arch},
        )
        register(arch, make_llama, architecture=rules)
