"""The model runner: owns the weights and the KV cache, runs one step, samples.

The engine talks to it through plain data only (:class:`StepInput` in,
:class:`StepOutput` out), so that a later version can run one runner per GPU
under ``torch.distributed`` and broadcast the same input to each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

import attrs
import numpy as np
import torch

from pitstop.attention import AttentionMetadata
from pitstop.config import EngineConfig
from pitstop.errors import ConfigError
from pitstop.model import rotary_cache
from pitstop.model_config import ModelConfig
from pitstop.plugin_manager import PluginManager
from pitstop.protocols import SamplingBatch
from pitstop.sampling import make_generator, make_sampling_batch
from pitstop.sampling_params import SamplingParams
from pitstop.speculative import DraftVerifier

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; a CUDA name without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {name!r} asked for, but this machine has no CUDA device; use device='cpu'"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> float32 on CPU, bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@attrs.frozen
class SeqInput:
    """One sequence's part of a step: the tokens to compute and where they go."""

    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_table: list[int]
    sample: bool  # whether the step reaches the sequence's last token
    params: SamplingParams | None = None
    # Speculative decoding: logits rows at the end of token_ids (k + 1 to verify k drafts,
    # which are the last k of token_ids), and the drafts' [k, V] distributions (None: point masses).
    num_logits: int = 1
    draft_probs: torch.Tensor | None = None


@attrs.frozen
class StepInput:
    """One step: prefill sequences (more than one token) first, then decodes."""

    seqs: list[SeqInput]
    finished_seq_ids: list[int] = attrs.Factory(list)


@attrs.frozen
class StepOutput:
    """Sampled tokens, one per sequence with ``sample`` set, in input order.

    When a sequence verified drafts, ``num_emitted`` says how many consecutive
    entries of ``token_ids`` (and ``logprobs``) each sampled sequence emitted.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    num_emitted: list[int] | None = None  # None: one token per sampled sequence


class ModelRunner:
    """Runs the model over the paged KV cache and samples the next tokens."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        plugins: PluginManager,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config, self.model_config = config, model_config
        self.device, self.dtype = device, dtype
        self.kernels = plugins.create("kernels", config.kernels, config, device, dtype)
        self.sampler = plugins.create("sampler", config.sampler, config, device)
        factory = plugins.get("model", model_config.architecture).factory
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = factory(model_config, self.kernels)
        finally:
            torch.set_default_dtype(previous)
        self.model.eval()
        assert config.max_model_len is not None
        self.rotary = rotary_cache(model_config, config.max_model_len, device)
        self.page_size = config.page_size
        self.kv_cache: torch.Tensor | None = None
        self.num_pages = 0
        self._generators: dict[int, torch.Generator] = {}
        self._verifier: DraftVerifier | None = None
        self.graphs: DecodeGraphs | None = None
        # The last step's sampling rows (seq ids) and their batch: a sequence's params never change.
        self._batch_cache: tuple[tuple[int, ...], SamplingBatch] | None = None

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights) -> None:
        """Copy Hugging Face-named tensors into the model (``None``: random dummy weights)."""
        with torch.inference_mode():
            if weights is None:
                self.model.init_dummy(self.config.seed)
            else:
                self.model.load_weights(weights())

    # ------------------------------------------------------------------ KV cache
    def bytes_per_page(self) -> int:
        """Bytes of K and V for one page over all layers."""
        mc = self.model_config
        return (
            mc.kv_bytes_per_token
            * self.page_size
            * torch.tensor([], dtype=self.dtype).element_size()
        )

    def plan_num_pages(self) -> int:
        """How many pages the KV cache gets: ``max_num_pages``, a GiB budget, or free GPU memory."""
        per_page = self.bytes_per_page()
        cfg = self.config
        if cfg.max_num_pages is None and (
            self.device.type != "cuda" or cfg.kv_cache_gib is not None
        ):
            return max(1, int((cfg.kv_cache_gib or 1.0) * 2**30) // per_page)
        if self.device.type != "cuda":
            return cfg.max_num_pages
        peak = self._profile_peak_memory()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - peak
        fit = max(0, budget // per_page)
        if cfg.max_num_pages is not None:
            if cfg.max_num_pages > fit:
                raise ConfigError(
                    f"max_num_pages={cfg.max_num_pages} needs {cfg.max_num_pages * per_page / 2**30:.2f} GiB, "
                    f"but at gpu_memory_utilization={cfg.gpu_memory_utilization} only {fit} pages fit; "
                    f"use max_num_pages <= {fit} or raise gpu_memory_utilization"
                )
            return cfg.max_num_pages
        if fit < 1:
            raise ConfigError(
                f"no room for a KV cache at gpu_memory_utilization={cfg.gpu_memory_utilization}; raise it"
            )
        return fit

    def _profile_peak_memory(self) -> int:
        """Extra memory a forward at the largest step takes beyond the weights (bytes)."""
        cfg = self.config
        assert cfg.max_model_len is not None
        tokens = min(cfg.max_num_batched_tokens, max(cfg.max_model_len, cfg.chunk_size))
        n_seqs = max(1, min(cfg.max_batch_size, tokens // max(1, cfg.max_model_len)))
        per_seq = tokens // n_seqs
        pages = (per_seq + self.page_size - 1) // self.page_size
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.init_kv_cache(pages * n_seqs)
        seqs = [
            SeqInput(
                i, [0] * per_seq, 0, list(range(i * pages, (i + 1) * pages)), True, SamplingParams()
            )
            for i in range(n_seqs)
        ]
        self.execute(StepInput(seqs))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    def init_kv_cache(self, num_pages: int) -> None:
        """Allocate the KV cache: ``[layers, 2, num_pages, page_size, kv_heads, head_size]``."""
        mc = self.model_config
        shape = (mc.num_layers, 2, num_pages, self.page_size, mc.num_kv_heads, mc.head_size)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_pages = num_pages

    def maybe_capture_graphs(self) -> None:
        """Capture CUDA graphs for decode batches when the device and kernel set allow it."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager:
            return
        graph_safe = getattr(self.kernels, "cuda_graph_safe", None)
        if graph_safe is None or not graph_safe(self.model_config.head_size):
            log.info(
                "CUDA graphs off: kernel set %r is not graph-safe; decode runs eagerly", cfg.kernels
            )
            return
        start = time.perf_counter()
        self.graphs = DecodeGraphs(self, max_batch=min(cfg.max_batch_size, 512))
        log.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s",
            self.graphs.describe(),
            time.perf_counter() - start,
        )

    # ------------------------------------------------------------------ one step
    def build_metadata(
        self, seqs: Seq[SeqInput]
    ) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten a step into input ids, attention metadata and the rows to sample."""
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        cu = [0]
        ctx_lens: list[int] = []
        q_lens: list[int] = []
        sample_rows: list[int] = []
        num_prefills = num_prefill_tokens = 0
        width = max((len(s.block_table) for s in seqs), default=0)
        tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            input_ids.extend(s.token_ids)
            # positions and slots per sequence with numpy: no Python loop over tokens
            pos = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)
            table = np.asarray(s.block_table, dtype=np.int64)
            tables[i, : len(table)] = table
            positions.append(pos)
            slots.append(table[pos // ps] * ps + pos % ps)
            cu.append(cu[-1] + n)
            ctx_lens.append(s.start_pos + n)
            q_lens.append(n)
            if n > 1:
                num_prefills += 1
                num_prefill_tokens += n
            if s.sample:
                sample_rows.extend(range(cu[-1] - s.num_logits, cu[-1]))
        dev = self.device

        def tensor(data, dtype):
            if isinstance(data, np.ndarray):
                host = torch.from_numpy(data)
                return host.to(dev, non_blocking=True) if dev.type == "cuda" else host
            return torch.tensor(data, dtype=dtype).to(dev, non_blocking=True)

        empty = np.zeros(0, dtype=np.int64)
        meta = AttentionMetadata(
            positions=tensor(np.concatenate(positions) if positions else empty, torch.int64),
            slot_mapping=tensor(np.concatenate(slots) if slots else empty, torch.int64),
            block_tables=tensor(tables, torch.int32),
            context_lens=tensor(ctx_lens, torch.int32),
            cu_query_lens=tensor(cu, torch.int32),
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decodes=len(seqs) - num_prefills,
            max_query_len=max(q_lens, default=0),
            max_context_len=max(ctx_lens, default=0),
            page_size=ps,
            context_lens_list=ctx_lens,
            query_lens_list=q_lens,
        )
        return tensor(input_ids, torch.int64), meta, sample_rows

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Run the model over one step and sample a token for every sequence that asks."""
        for seq_id in step.finished_seq_ids:
            self._generators.pop(seq_id, None)
        if not step.seqs:
            return StepOutput([])
        assert self.kv_cache is not None, "init_kv_cache() first"
        if self.graphs is not None and self.graphs.can_run(step.seqs):
            hidden = self.graphs.run(step.seqs)
            rows = [i for i, s in enumerate(step.seqs) if s.sample]
        else:
            input_ids, meta, rows = self.build_metadata(step.seqs)
            hidden = self.model(input_ids, self.rotary, self.kv_cache, meta)
        if not rows:
            return StepOutput([])
        logits = self.model.compute_logits(self._select_rows(hidden, rows))
        sampling = [s for s in step.seqs if s.sample]
        params = [s.params or SamplingParams() for s in sampling]
        generators = [self._generator(s.seq_id, p) for s, p in zip(sampling, params, strict=True)]
        if len(rows) > len(sampling):  # some sequence verifies speculative drafts
            if self._verifier is None:
                self._verifier = DraftVerifier(self.sampler, self.device, self.config.seed)
            v = self._verifier(logits, sampling, generators)
            logprobs = [x for lp in v.logprobs for x in lp] if v.logprobs is not None else None
            return StepOutput(
                [t for e in v.token_ids for t in e], logprobs, [len(e) for e in v.token_ids]
            )
        key = tuple(s.seq_id for s in sampling)
        if self._batch_cache is not None and self._batch_cache[0] == key:
            batch = self._batch_cache[1]  # same rows as last step: skip the host-to-device copies
        else:
            batch = make_sampling_batch(params, generators, self.device)
            self._batch_cache = (key, batch)
        out = self.sampler.sample(logits, batch)
        tokens = out.token_ids.tolist()  # the step's one device-to-host copy
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        return StepOutput(tokens, logprobs)

    def _select_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The hidden rows to turn into logits, without waiting for the GPU.

        A pure decode step samples every row in order: no gather at all. Otherwise
        the indices go over asynchronously, so the logits GEMM and the sampler queue
        up behind the forward pass instead of after a host-device synchronization.
        """
        if len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1:
            return hidden
        index = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        return hidden.index_select(0, index)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = self._generators[seq_id] = make_generator(params.seed, self.device)
        return gen


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 16 up to ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """CUDA graphs of the model's forward for pure-decode steps, one per batch size.

    Every input lives in a static buffer; a step copies its (padded) inputs in
    and replays the graph of the smallest captured batch that fits. Padding
    rows get slot -1 (no KV store) and context length 0 (no attention).
    """

    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        cfg = runner.config
        assert cfg.max_model_len is not None and runner.kv_cache is not None
        self.runner = runner
        dev = runner.device
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_pages = -(-cfg.max_model_len // runner.page_size)
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(b, self.max_pages, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.cu_query_lens = torch.arange(b + 1, dtype=torch.int32, device=dev)
        # host staging, pinned, so the copies in are asynchronous
        self.host_ids = torch.zeros(b, dtype=torch.int64, pin_memory=True)
        self.host_pos = torch.zeros(b, dtype=torch.int64, pin_memory=True)
        self.host_slots = torch.full((b,), -1, dtype=torch.int64, pin_memory=True)
        self.host_ctx = torch.zeros(b, dtype=torch.int32, pin_memory=True)
        self.host_tables = torch.zeros(b, self.max_pages, dtype=torch.int32, pin_memory=True)
        # numpy views of the same memory: cheap bulk writes from Python lists
        self.np_ids, self.np_pos = self.host_ids.numpy(), self.host_pos.numpy()
        self.np_slots, self.np_ctx = self.host_slots.numpy(), self.host_ctx.numpy()
        self.np_tables = self.host_tables.numpy()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                meta = self._meta(size)
                model = runner.model
                args = (self.input_ids[:size], runner.rotary, runner.kv_cache, meta)
                model(*args)  # warm-up: compiles kernels, settles the allocator
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = model(*args)
                if pool is None:
                    pool = graph.pool()
                self.graphs[size] = (graph, out)
        torch.cuda.synchronize(dev)

    def _meta(self, size: int) -> AttentionMetadata:
        cfg = self.runner.config
        assert cfg.max_model_len is not None
        return AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            cu_query_lens=self.cu_query_lens[: size + 1],
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=size,
            max_query_len=1,
            max_context_len=cfg.max_model_len,
            page_size=self.runner.page_size,
        )

    def describe(self) -> str:
        """The captured sizes, compactly."""
        return f"{self.sizes[:5]}...{self.sizes[-1]}" if len(self.sizes) > 6 else str(self.sizes)

    def can_run(self, seqs: Seq[SeqInput]) -> bool:
        """Whether a step is pure decode and fits a captured batch."""
        return 0 < len(seqs) <= self.max_batch and all(len(s.token_ids) == 1 for s in seqs)

    def run(self, seqs: Seq[SeqInput]) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, replay, return hidden ``[n, hidden]``."""
        n = len(seqs)
        size = next(b for b in self.sizes if b >= n)
        ps = self.runner.page_size
        pos = [s.start_pos for s in seqs]
        self.np_ids[:n] = [s.token_ids[0] for s in seqs]
        self.np_pos[:n] = pos
        self.np_slots[:n] = [
            s.block_table[p // ps] * ps + p % ps for s, p in zip(seqs, pos, strict=True)
        ]
        self.np_ctx[:n] = [p + 1 for p in pos]
        self.np_slots[n:size] = -1
        self.np_ctx[n:size] = 0
        tables = self.np_tables
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        ids, pos_t, slots, ctx = self.host_ids, self.host_pos, self.host_slots, self.host_ctx
        tables = self.host_tables
        self.input_ids[:size].copy_(ids[:size], non_blocking=True)
        self.positions[:size].copy_(pos_t[:size], non_blocking=True)
        self.slots[:size].copy_(slots[:size], non_blocking=True)
        self.context_lens[:size].copy_(ctx[:size], non_blocking=True)
        self.block_tables[:size].copy_(tables[:size], non_blocking=True)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
