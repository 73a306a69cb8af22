"""The weight format protocol: how a model holds and multiplies its linear layers' weights.

Its own module only to keep :mod:`pitstop.plugin_system.protocols` short; that module
imports it, so ``pitstop.plugin_system.protocols.WeightFormat`` is the name to use.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class WeightFormat(Protocol):
    """How a model holds and multiplies the weight of each linear layer (``weights=NAME``).

    The model hands every linear weight to :meth:`prepare` once, at load, as a dense
    ``[out_features, in_features]`` tensor in the model's dtype on its device (or, for a
    format that also implements :class:`KeepsBlocks`, as a checkpoint's quantized blocks; after
    the merge of q/k/v and gate/up, when the kernel set merges them; one rank's shard
    under tensor parallelism), and keeps what it returns, the *resident* weight, in
    place of the tensor. Every forward pass then calls :meth:`linear` with it. The
    embedding and the norms stay dense; a tied output head is the embedding and is
    never prepared, an untied one is prepared under the name ``"lm_head"``.
    """

    name: str

    def prepare(self, name: str, weight: torch.Tensor) -> Any:
        """The resident form of the linear weight ``name`` (the model's parameter name,
        ``"layers.3.self_attn.qkv_proj"``, ``"lm_head"``). Called once per weight at
        load; may return ``weight`` itself to keep it dense."""
        ...

    def linear(self, x: torch.Tensor, resident: Any, bias: torch.Tensor | None = None) -> Any:
        """``x @ W.T + bias`` for the weight ``resident`` holds, in ``x``'s dtype. Runs
        inside CUDA graphs: no host synchronisation, no allocation that depends on data."""
        ...

    def resident_bytes(self, resident: Any) -> int:
        """Device bytes ``resident`` holds (what a decode step reads of this weight)."""
        ...

    def describe(self) -> dict[str, str]:
        """What runs here (``"linear"`` -> the GEMM and why), for ``pitstop plugins --check``."""
        ...


@runtime_checkable
class KeepsBlocks(Protocol):
    """Optional, beside :class:`WeightFormat`: a format that holds a checkpoint's quantized blocks.

    A format with these methods (``weights=gguf``) is offered every block-quantized
    tensor a model source keeps in its blocks (the ``gguf`` source: every 2-D one of a
    GGUF file, as a ``QuantizedWeight`` of
    :mod:`pitstop.plugins.model_sources.gguf.quantized`: its raw bytes row by row, ggml
    type and logical shape, rows already in the model's order) instead of the dequantized
    tensor: :meth:`takes_blocks` says, per checkpoint tensor, whether it keeps it; a
    declined one arrives dense (its ``dequantize()``), as from any other source
    (:func:`pitstop.loading.checkpoint.weight_stream`). The model stacks the parts of a
    merged weight (q/k/v, gate/up) by rows and hands the whole to
    :meth:`WeightFormat.prepare`, which then receives either a tensor or the blocks. Such
    a format needs a source that offers blocks: with any other model the engine refuses it
    (a ConfigError in the words of the format's ``blocks_of`` and ``blocks_model``,
    :class:`~pitstop.plugin_system.protocols.KeepsBlocksBase`).

    It may hold the embedding too: the model hands it ``"embed_tokens"`` (blocks
    only) and looks rows up with :meth:`embedding`; a tied output head then is
    ``linear(hidden, resident_of_the_embedding)``.
    """

    def takes_blocks(self, name: str, weight: Any) -> bool:
        """Whether the checkpoint tensor ``name`` (Hugging Face name, e.g.
        ``"model.layers.0.self_attn.q_proj.weight"``) is kept as the blocks ``weight``
        (the source's block type) holds; False: it arrives dequantized to float32."""
        ...

    def embedding(self, resident: Any, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the embedding ``resident`` holds, ``[*ids.shape, hidden]``, in
        the model's dtype (runs inside CUDA graphs, like :meth:`WeightFormat.linear`)."""
        ...
