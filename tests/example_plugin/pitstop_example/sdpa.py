"""The kernel set ``sdpa``: a step's attention in a few batched SDPA calls.

Attention gathers the pages of a step's sequences into padded batches and
runs :func:`torch.nn.functional.scaled_dot_product_attention` once per
batch, where the ``reference`` set loops over the prompts one at a time.
Sequences are packed longest query first, and one joins a batch only while
padding at most doubles the batch's work (query-by-key cells), so the
decodes of a step share one call and a long prompt never pads them to its
length; ``sdpa.max_batch`` caps the sequences per call. The causal and length masks and
the padded query rows are built once per step (the runner hands every layer
the same :class:`~pitstop.ground.attention.AttentionMetadata`) and reused by every
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
from pitstop.errors import ConfigError
from pitstop.ground.attention import AttentionMetadata
from pitstop.plugin_system.protocols import KernelSet, KernelSetBase, RotaryCache
from pitstop.plugin_system.settings import read_settings, setting


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
    dest: torch.Tensor  # [its tokens] int64: the flat query row each real slot's output goes to
    # [B, 1, G * Q, L] bool: which keys each padded query sees, repeated for the G query
    # heads of a KV head (stacked along the query axis, as the queries are)
    allowed: torch.Tensor
    # [B, 1, L, 1] bool: the key slots each sequence's context holds. The slots past it were
    # never written (NaN with poison_memory): a masked-out NaN still makes NaN in the product
    # with V, so they are zeroed, not only masked.
    written: torch.Tensor
    tables: torch.Tensor  # [B, pages] int64: block tables, -1 padding read as page 0
    max_context: int


def pack(query_lens: list[int], context_lens: list[int], max_batch: int) -> list[list[int]]:
    """Sequence indices in SDPA calls: at most ``max_batch`` each, padding at most doubling the work.

    Sequences go longest query first; one joins the current call while the
    call's padded query-by-key cells stay within twice its real ones, so a
    long prompt never pads a batch of decodes up to its length.
    """
    order = sorted(range(len(query_lens)), key=lambda i: (-query_lens[i], -context_lens[i]))
    calls: list[list[int]] = []
    real = longest = 0
    for i in order:
        cells = query_lens[i] * context_lens[i]
        if calls and len(calls[-1]) < max_batch:
            call = calls[-1]
            q_max, l_max = query_lens[call[0]], max(longest, context_lens[i])
            if (len(call) + 1) * q_max * l_max <= 2 * (real + cells):
                call.append(i)
                real, longest = real + cells, l_max
                continue
        calls.append([i])
        real, longest = cells, context_lens[i]
    return calls


def _groups(
    meta: AttentionMetadata, max_batch: int, group_size: int, device: torch.device
) -> list[_Group]:
    """The step's sequences in SDPA calls (:func:`pack`), with their rows and masks."""
    qlens = torch.tensor(meta.query_lens_list)
    ctxs = torch.tensor(meta.context_lens_list)
    starts = torch.cumsum(qlens, 0) - qlens
    groups = []
    for call in pack(meta.query_lens_list, meta.context_lens_list, max_batch):
        idx = torch.tensor(call)
        q, c, first = qlens[idx], ctxs[idx], starts[idx]
        q_max, l_max = int(q.max()), int(c.max())
        j = torch.minimum(torch.arange(q_max)[None, :], q[:, None] - 1)  # padding repeats the last
        # query j of a sequence sits at context - query_len + j and sees the keys up to it
        pos = (c - q)[:, None] + j
        is_real = torch.arange(q_max)[None, :] < q[:, None]
        allowed = torch.arange(l_max)[None, None, :] <= pos.repeat(1, group_size)[:, :, None]
        pages = -(-l_max // meta.page_size)
        groups.append(
            _Group(
                rows=(first[:, None] + j).to(device),
                real=is_real.flatten().nonzero().squeeze(1).to(device),
                dest=(first[:, None] + j)[is_real].to(device),
                allowed=allowed.unsqueeze(1).to(device),
                written=(torch.arange(l_max)[None, :] < c[:, None])[:, None, :, None].to(device),
                tables=meta.block_tables[idx.to(meta.block_tables.device), :pages]
                .clamp(min=0)
                .long(),
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
        k, v = torch.where(g.written, k, 0), torch.where(g.written, v, 0)
        # [B, Q, Hkv, G, D] -> [B, Hkv, G * Q, D]: a KV head's query heads share its K and V
        qg = q[g.rows].view(b, q_len, kv_heads, group_size, head_size)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group_size * q_len, head_size)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.allowed, scale=scale)
        o = o.view(b, kv_heads, group_size, q_len, head_size).permute(0, 3, 1, 2, 4)
        # integer indices only: no device-to-host sync (a boolean mask would need one)
        real = o.reshape(b * q_len, num_heads, head_size).index_select(0, g.real)
        out.index_copy_(0, g.dest, real)
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
        # and whether its rotary normalizes Qwen3's q/k heads itself (rope_and_store passes them on)
        self.fuses_qk_norm = KernelSetBase.of(base, "fuses_qk_norm")
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
        qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm_eps: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The base set's rotary and KV store (``kv_scale`` passed on only for an fp8 cache,
        the q/k norms only when the model hands them over: the base declared ``fuses_qk_norm``)."""
        extra: dict = {} if kv_scale is None else {"kv_scale": kv_scale}
        if qk_norm is not None:
            extra |= {"qk_norm": qk_norm, "qk_norm_eps": qk_norm_eps}
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
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    settings = read_settings(config, "sdpa", SdpaSettings)
    if settings.base == "sdpa":
        raise ConfigError(
            "kernel set 'sdpa': setting sdpa.base must name another kernel set "
            "(reference, fused, ...), got 'sdpa'"
        )
    base = get_plugin_manager().create("kernels", settings.base, config, device, dtype)
    return SdpaKernels(base, settings.max_batch, device)
