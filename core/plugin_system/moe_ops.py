"""The mixture-of-experts op of a kernel set: an optional member, :class:`MoEOps`.

Its own module only to keep :mod:`pitstop.plugin_system.protocols` short; that module
imports it, so ``pitstop.plugin_system.protocols.MoEOps`` is the name to use.

A kernel set that serves mixture-of-experts models (Qwen3-MoE, Mixtral) has a ``moe``
method; :class:`~pitstop.plugin_system.protocols.KernelSetBase` declares it ``None``, so
``KernelSetBase.of(kernels, "moe")`` is ``None`` for a set without one, and an MoE model
then runs the plain loop over experts itself
(:mod:`pitstop.plugins.kernels.moe_reference`, the numerical reference). Both shipped
sets have it: ``reference`` runs that loop, ``fused`` the Triton op of
:mod:`pitstop.plugins.kernels.triton_ops.moe` (top-k routing in one kernel -- at one or two
tokens with the router's projection and the grouping, in one launch -- tokens grouped by
expert, two grouped GEMMs and the k-slot sum, for one token inside the down GEMM: a
decode step of one token is three launches; autotuned tiles cached on disk).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class MoEOps(Protocol):
    """The sparse mixture-of-experts block's expert half, after the router's projection."""

    def moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor | None,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        weights_dtype: torch.dtype | None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        router: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        norm_eps: float | None = None,
    ) -> torch.Tensor:
        """``sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))`` over each
        token's ``top_k`` experts ``e``, a new ``[T, H]`` tensor in ``x``'s dtype.

        ``x [T, H]``; ``router_logits [T, E]`` (the router's ``linear``, in ``x``'s dtype);
        ``gate_up [E, 2F, H]`` (each expert's gate rows, then its up rows) and
        ``down [E, H, F]`` in ``x``'s dtype. Routing is transformers': softmax in float32,
        top-k (lower expert id first among equal probabilities), divided by the sum of
        the k kept ones when ``renormalize`` (``norm_topk_prob``), then cast to
        ``weights_dtype`` (Qwen3-MoE: ``x``'s dtype; ``None`` keeps float32, as Mixtral
        does). ``scales``: fp8 experts (``weights="fp8"``): ``gate_up`` and ``down`` are
        float8_e4m3fn and each output row has a float32 scale, ``(gate_up_scale [E, 2F],
        down_scale [E, H])``, the weight being ``q * scale``. ``router [E, H]`` (only for a
        set declaring ``moe_takes_router``, which the model then calls so): the router's
        weight in ``x``'s dtype, with ``router_logits`` None: the op projects ``x`` itself
        (``x @ router.T`` rounded to ``x``'s dtype, as the ``linear`` op would), so that it
        may fuse the projection with the routing. ``residual [T, H]`` (only for a set
        declaring ``moe_adds_residual``): return ``residual + out`` instead, rounded as adding
        the two tensors in ``x``'s dtype would (so that the add needs no launch of its own).
        ``norm_eps`` (only with ``router``, for a set declaring ``moe_takes_norm``): the
        block's RMSNorm folded into the op -- ``x`` is the norm's input, un-normalized, and
        the norm's gain is already multiplied into ``router`` and ``gate_up`` (``W * g``);
        the op applies each token's ``1/sqrt(mean(x**2) + norm_eps)`` itself (to the rows,
        or to the logits and the gate and up sums), so that the norm needs no launch.
        Runs inside CUDA graphs when
        the set declares itself graph-safe: no host synchronisation, no allocation whose
        size depends on the routing.
        """
        ...
