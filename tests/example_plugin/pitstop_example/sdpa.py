"""The kernel set ``sdpa``: a step's attention in a few batched SDPA calls.

Attention gathers each sequence's pages into one padded batch and runs
:func:`torch.nn.functional.scaled_dot_product_attention` once for the
step's prompts and chunks and once for its decodes (more calls only when
``sdpa.max_batch`` caps the sequences per call), where the ``reference``
set loops over the prompts one at a time. The causal and length masks and
the padded query rows are built once per step (the runner hands every layer
the same :class:`~pitstop.attention.AttentionMetadata`) and reused by every
layer. A GQA model's query heads of one KV head are stacked along the query
axis, so K and V are never repeated.

Every other op comes from the kernel set named by ``sdpa.base`` (default
``reference``), built through pitstop's plugin manager: ``--kernels sdpa
--sdpa.base fused`` keeps the fused norms, rotary and KV store and swaps in
this attention. An fp8 KV cache is read as ``stored * kv_scale``, as the
reference reads it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

import pitstop
from pitstop.attention import AttentionMetadata
from pitstop.errors import ConfigError
from pitstop.protocols import KernelSet, KernelSetBase, RotaryCache
from pitstop.settings import read_settings, setting


@attrs.frozen
class SdpaSettings:
    """The settings of the ``sdpa`` kernel set: ``--sdpa.base``, ``--sdpa.max-batch``."""

    base: str = setting(
        "reference",
        type=str,
        help="the registered kernel set that runs every op but attention",
    )
    max_batch: int = setting(
        64,
        type=int,
        minimum=1,
        help="most sequences in one SDPA call (bounds the padded K/V copies)",
    )


@attrs.frozen
class _Group:
    """One SDPA call's sequences: their padded query rows and mask, built once per step."""

    rows: torch.Tensor  # [B, Q] int64: flat query row of each padded slot (padding repeats one)
    real: torch.Tensor  # [its tokens] int64: the padded slots (of B * Q) that are real queries
    first_row: int  # its tokens are the flat rows first_row ... first_row + len(real) - 1
    # [B, 1, G * Q, L] bool: which keys each padded query sees, repeated for the G query
    # heads of a KV head (stacked along the query axis, as the queries are)
    allowed: torch.Tensor
    tables: torch.Tensor  # [B, pages] int64: block tables, -1 padding read as page 0
    max_context: int


def _groups(
    meta: AttentionMetadata, max_batch: int, group_size: int, device: torch.device
) -> list[_Group]:
    """The prompts (and chunks) of a step, then its decodes, in calls of at most ``max_batch``."""
    qlens, ctxs = meta.query_lens_list, meta.context_lens_list
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    spans = []
    for lo, hi in ((0, meta.num_prefills), (meta.num_prefills, meta.num_seqs)):
        spans += [(a, min(a + max_batch, hi)) for a in range(lo, hi, max_batch)]
    groups = []
    for a, b in spans:
        q_max, l_max = max(qlens[a:b]), max(ctxs[a:b])
        rows = [[starts[i] + min(j, qlens[i] - 1) for j in range(q_max)] for i in range(a, b)]
        # query j of sequence i sits at ctx - qlen + j and sees the keys up to it
        pos = [
            [ctxs[i] - qlens[i] + min(j, qlens[i] - 1) for j in range(q_max)] for i in range(a, b)
        ]
        pos_t = torch.tensor(pos, device=device).repeat(1, group_size)  # [B, G * Q]
        keys = torch.arange(l_max, device=device)
        pages = -(-l_max // meta.page_size)
        groups.append(
            _Group(
                rows=torch.tensor(rows, device=device),
                real=torch.tensor(
                    [(i - a) * q_max + j for i in range(a, b) for j in range(qlens[i])],
                    device=device,
                ),
                first_row=starts[a],
                allowed=(keys[None, None, :] <= pos_t[:, :, None]).unsqueeze(1),
                tables=meta.block_tables[a:b, :pages].clamp(min=0).long(),
                max_context=l_max,
            )
        )
    return groups


def _read_pages(
    cache: torch.Tensor, tables: torch.Tensor, length: int, scale: Any, dtype: torch.dtype
) -> torch.Tensor:
    """The first ``length`` cached tokens of each table as ``[B, Hkv, length, D]`` in ``dtype``."""
    if cache.dtype.itemsize == 1:  # fp8: index as bytes (CPU torch has no float8 indexing)
        pages = cache.view(torch.uint8)[tables].view(cache.dtype).to(torch.float32) * scale
    else:
        pages = cache[tables]
    b, n, ps, h, d = pages.shape
    return pages.reshape(b, n * ps, h, d)[:, :length].transpose(1, 2).to(dtype)


def batched_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[_Group],
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q ``[T, Hq, D]`` over the paged cache, one SDPA call per group."""
    out = torch.empty_like(q)
    num_heads, head_size = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group_size = num_heads // kv_heads
    k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    for g in groups:
        b, q_len = g.rows.shape
        k = _read_pages(k_cache, g.tables, g.max_context, k_scale, q.dtype)
        v = _read_pages(v_cache, g.tables, g.max_context, v_scale, q.dtype)
        # [B, Q, Hkv, G, D] -> [B, Hkv, G * Q, D]: a KV head's query heads share its K and V
        qg = q[g.rows].view(b, q_len, kv_heads, group_size, head_size)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group_size * q_len, head_size)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.allowed, scale=scale)
        o = o.view(b, kv_heads, group_size, q_len, head_size).permute(0, 3, 1, 2, 4)
        # integer indices only: no device-to-host sync (a boolean mask would need one)
        real = o.reshape(b * q_len, num_heads, head_size).index_select(0, g.real)
        out[g.first_row : g.first_row + real.shape[0]] = real
    return out


class SdpaKernels(KernelSetBase):
    """Batched SDPA attention over the paged cache; every other op from ``sdpa.base``."""

    name = "sdpa"

    def __init__(self, base: KernelSet, max_batch: int, device: torch.device) -> None:
        self.base = base
        self.max_batch = max_batch
        self.device = device
        # The base set's weight layout: the model merges projections only if its linear wants it.
        self.merge_projections = base.merge_projections
        self._meta: AttentionMetadata | None = None
        self._groups: list[_Group] = []

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base set's RMSNorm."""
        return self.base.rms_norm(x, weight, eps, residual)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The base set's linear layer."""
        return self.base.linear(x, weight, bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """The base set's SiLU-and-mul."""
        return self.base.silu_and_mul(x)

    def rope_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The base set's rotary and KV store (``kv_scale`` passed on only for an fp8 cache)."""
        extra = {} if kv_scale is None else {"kv_scale": kv_scale}
        return self.base.rope_and_store(q, k, v, rotary, k_cache, v_cache, meta, **extra)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention over the paged cache in batched SDPA calls (see the module docstring)."""
        if meta is not self._meta:  # a new step: its groups, once for every layer
            group_size = q.shape[1] // k_cache.shape[2]
            self._groups = _groups(meta, self.max_batch, group_size, q.device)
            self._meta = meta
        return batched_attention(q, k_cache, v_cache, self._groups, scale, kv_scale)

    def describe(self) -> dict[str, str]:
        """The base set's ops, with attention replaced."""
        ops = dict(self.base.describe())
        ops["attention"] = f"sdpa (batched torch SDPA, up to {self.max_batch} sequences a call)"
        return ops


def make_sdpa(
    config: pitstop.EngineConfig, device: torch.device, dtype: torch.dtype
) -> SdpaKernels:
    """Attention in batched torch SDPA calls; the other ops from another kernel set."""
    from pitstop.plugin_manager import get_plugin_manager

    settings = read_settings(config, "sdpa", SdpaSettings)
    if settings.base == "sdpa":
        raise ConfigError(
            "kernel set 'sdpa': setting sdpa.base must name another kernel set "
            "(reference, fused, ...), got 'sdpa'"
        )
    base = get_plugin_manager().create("kernels", settings.base, config, device, dtype)
    return SdpaKernels(base, settings.max_batch, device)
