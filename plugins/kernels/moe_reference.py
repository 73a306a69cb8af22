"""Mixture-of-experts reference: transformers' sparse-MoE arithmetic, a plain loop over experts.

The numerical reference of :mod:`pitstop.plugins.kernels.triton_ops.moe`, written to
follow ``transformers`` 5's ``Qwen3MoeTopKRouter`` / ``Qwen3MoeExperts`` and
``MixtralTopKRouter`` / ``MixtralExperts`` operation for operation:

- routing: ``softmax(logits, dtype=float32)``, ``torch.topk``, then (``norm_topk_prob``,
  always on for Mixtral) division by the sum of the k kept probabilities, in float32;
  Qwen3-MoE casts the weights to the logits' dtype, Mixtral keeps them in float32
  (``weights_dtype=None``);
- experts: for every expert hit, in expert order, ``linear(x, gate_up[e]).chunk(2)``,
  ``silu(gate) * up``, ``linear(., down[e])``, times the routing weight (a float32
  weight promotes the product to float32), cast to ``x``'s dtype and ``index_add_``-ed
  into a zero output.

Weights keep the checkpoints' layout: ``gate_up [E, 2F, H]`` (gate rows, then up rows)
and ``down [E, H, F]``. fp8 experts (``weights="fp8"``) come as e4m3 tensors of that layout
with one float32 scale per output row (``scales = (gate_up_scale [E, 2F], down_scale [E, H])``);
the loop widens each expert it runs to ``q * scale`` in ``x``'s dtype first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    router_logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    weights_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights ``[T, k]`` and expert ids ``[T, k]`` (int64) of ``router_logits [T, E]``.

    ``weights_dtype``: the dtype the weights are cast to at the end (Qwen3-MoE: the
    logits' dtype); ``None`` keeps float32 (Mixtral).
    """
    probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        values /= values.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        values = values.to(weights_dtype)
    return values, ids


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 expert's weight ``q [N, K]`` (e4m3) times its row scales ``scale [N]``, in ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))``, ``e = ids[t, j]``.

    ``x [T, H]``, ``weights``/``ids [T, k]``, ``gate_up [E, 2F, H]``, ``down [E, H, F]``
    (in ``x``'s dtype, or e4m3 with ``scales``: ``[E, 2F]`` and ``[E, H]``, see the module);
    returns ``[T, H]`` in ``x``'s dtype, summed in expert order as transformers does.
    """
    num_experts = gate_up.shape[0]
    out = torch.zeros_like(x)
    mask = F.one_hot(ids.long(), num_classes=num_experts).permute(2, 1, 0)  # [E, k, T]
    for e in range(num_experts):
        slot, token = torch.where(mask[e])
        if token.numel() == 0:
            continue
        w13, w2 = gate_up[e], down[e]
        if scales is not None:
            w13, w2 = dequantize(w13, scales[0][e], x.dtype), dequantize(w2, scales[1][e], x.dtype)
        gate, up = F.linear(x[token], w13).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2)
        h = h * weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


def sparse_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    cast_weights: bool = True,
) -> torch.Tensor:
    """A whole sparse-MoE block: router ``linear(x, router_weight)``, :func:`route`, :func:`experts`.

    ``cast_weights``: Qwen3-MoE's cast of the routing weights to ``x``'s dtype (``False``
    for Mixtral, whose ``norm_topk_prob`` is always on).
    """
    logits = F.linear(x, router_weight)
    weights, ids = route(logits, top_k, norm_topk_prob, logits.dtype if cast_weights else None)
    return experts(x, weights, ids, gate_up, down)
