"""The model runner: owns the weights and the KV cache, runs one step, samples.

The engine talks to it through plain data only (:class:`StepInput` in,
:class:`StepOutput` out), so that under tensor parallelism one runner per rank
gets the same input (:mod:`pitstop.parallel`); each then holds its shard.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from pitstop.attention import AttentionMetadata
from pitstop.config import EngineConfig
from pitstop.errors import ConfigError
from pitstop.finite_weights import finite_weights
from pitstop.kinds import lacks
from pitstop.kv_cache_dtype import check_kernels_read_fp8, resolve_kv_cache_dtype
from pitstop.model_config import ModelConfig
from pitstop.plugin_manager import PluginManager
from pitstop.poison import poison_, poison_array, poison_pages_, poison_torch_empty
from pitstop.protocols import SamplingBatch, SplitAttention, SplitForwardModel, SplitLayer
from pitstop.sampling import (
    RowInputs,
    TokenHistories,
    make_generator,
    make_sampling_batch,
    make_step_inputs,
)
from pitstop.sampling_params import SamplingParams
from pitstop.sequence import PENDING_TOKEN
from pitstop.speculative import DeviceVerified, DraftVerifier

if TYPE_CHECKING:
    from pitstop.parallel.group import TensorParallelGroup

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


def kv_bytes_per_page(model_config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one page of ``page_size`` tokens over all layers, in cache dtype ``dtype``."""
    return model_config.kv_bytes_per_token * page_size * dtype.itemsize


def pages_asked(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> int | None:
    """The KV pages the config fixes before any weight loads; None: sized from free GPU memory.

    ``max_num_pages`` when set; else a ``kv_cache_gib`` budget (1 GiB on the CPU
    when none is given) over the bytes of a page in ``kv_cache_dtype``; on CUDA
    without either, the cache takes what the weights and
    ``gpu_memory_utilization`` leave (:meth:`ModelRunner.plan_num_pages`).
    ``dtype`` is the model's.
    """
    if config.max_num_pages is not None:
        return config.max_num_pages
    if device.type != "cuda" or config.kv_cache_gib is not None:
        cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
        per_page = kv_bytes_per_page(model_config, config.page_size, cache_dtype)
        return max(1, int((config.kv_cache_gib or 1.0) * 2**30) // per_page)
    return None


LogitsObserver = Callable[[Seq["SeqInput"], torch.Tensor], None]


@attrs.frozen
class SeqInput:
    """One sequence's part of a step: the tokens to compute and where they go.

    A token of :data:`~pitstop.sequence.PENDING_TOKEN` is one the previous
    launched step sampled and the host does not know yet: the runner reads
    its value from the device (the row of this sequence in that step).
    """

    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_table: list[int]  # the allocator's live list: read during launch only
    sample: bool  # whether the step reaches the sequence's last token
    params: SamplingParams | None = None
    # Speculative decoding: logits rows at the end of token_ids (k + 1 to verify k drafts,
    # which are the last k of token_ids), and the drafts' [k, V] distributions (None: point masses).
    num_logits: int = 1
    draft_probs: torch.Tensor | None = None
    # Drafts still on the device (the draft model's): the last len(draft_ids) of token_ids are
    # placeholders, and the runner writes these in on the device.
    draft_ids: torch.Tensor | None = None
    # Penalty history, min_tokens mask and grammar of a sampling row (None: it uses none).
    row_inputs: RowInputs | None = None
    # prompt_logprobs=k: the prompt tokens that the first len(prompt_targets) tokens of
    # token_ids predict (their logits' log-probabilities come back in SeqResult.prompt_logprobs)
    prompt_targets: list[int] | None = None
    prompt_logprobs: int = 0


@attrs.frozen
class StepInput:
    """One step: prefill sequences (more than one token) first, then decodes.

    ``finished_seq_ids`` are sequences gone since the last step (their
    generators and block-table rows are dropped); ``reset_seq_ids`` are live
    sequences whose block table was rebuilt or shortened since the last step
    (preempted, or drafts truncated). ``poison_pages``: KV pages handed out
    since the last step, to fill with NaN before this step writes them
    (``poison_memory`` on; :mod:`pitstop.poison`).
    """

    seqs: list[SeqInput]
    finished_seq_ids: list[int] = attrs.Factory(list)
    reset_seq_ids: list[int] = attrs.Factory(list)
    poison_pages: list[int] = attrs.Factory(list)


@attrs.frozen
class SeqResult:
    """What one scheduled sequence got from a step: its emitted tokens (none if it did not sample)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    # logprobs=k: per emitted token, the k most likely (id, logprob) and the chosen token's rank
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ranks: list[int] | None = None
    # per predicted prompt token: (its logprob, its rank, the k most likely (id, logprob))
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None


_NO_TOKENS = SeqResult([])


@attrs.frozen
class StepOutput:
    """One :class:`SeqResult` per sequence of the step's input, in input order.

    A sampling sequence emits one token, or, when it verified k drafts, its
    accepted drafts and one more token.
    """

    results: list[SeqResult]
    # poison_memory: the sequences whose logits this step held NaN (they read memory
    # nothing wrote); the engine fails their requests instead of taking their tokens
    poisoned_seq_ids: frozenset[int] = frozenset()

    @property
    def token_ids(self) -> list[int]:
        """Every emitted token, flat, in input order."""
        return [t for r in self.results for t in r.token_ids]


class LaunchedStep:
    """A step whose work is queued on the device; :meth:`result` waits for its tokens.

    The sampled ids travel to a pinned host buffer by one non-blocking copy,
    completed on an event: launching the next step never waits for them.
    """

    def __init__(
        self,
        seqs: list[SeqInput],
        tokens: torch.Tensor | None = None,
        logprobs: torch.Tensor | None = None,
        event: torch.cuda.Event | None = None,
        ready: StepOutput | None = None,
        top: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None = None,
        prompt: dict[int, list[tuple[float, int, list[tuple[int, float]]]]] | None = None,
        nonfinite: torch.Tensor | None = None,
    ) -> None:
        self.seqs = seqs
        self._tokens, self._logprobs, self._event = tokens, logprobs, event
        self._nonfinite = nonfinite  # poison_memory: per logits row, NaN anywhere (host, pinned)
        self._top = top  # host copies of (top ids, top logprobs, ranks) when logprobs were asked
        self._prompt = prompt or {}  # input index -> prompt log-probabilities (prompt_logprobs)
        self._ready = ready
        if ready is not None and self._prompt:
            self._ready = StepOutput(
                [
                    attrs.evolve(r, prompt_logprobs=self._prompt[i]) if i in self._prompt else r
                    for i, r in enumerate(ready.results)
                ]
            )

    def result(self) -> StepOutput:
        """Wait for the step's tokens; one result per input sequence."""
        if self._ready is not None:
            return self._ready
        if self._event is not None:
            self._event.synchronize()
        tokens = self._tokens.tolist() if self._tokens is not None else []
        logprobs = self._logprobs.tolist() if self._logprobs is not None else None
        top_ids = top_lps = ranks = None
        if self._top is not None:
            ids_t, lps_t, ranks_t = self._top
            ranks = ranks_t.tolist()
            if ids_t is not None and lps_t is not None:
                top_ids, top_lps = ids_t.tolist(), lps_t.tolist()
        results: list[SeqResult] = []
        row = 0
        for s in self.seqs:
            if s.sample:
                lp = [logprobs[row]] if logprobs is not None else None
                top = None
                if top_ids is not None and top_lps is not None:
                    top = [list(zip(top_ids[row], top_lps[row], strict=True))]
                rank = [ranks[row]] if ranks is not None else None
                results.append(SeqResult([tokens[row]], lp, top, rank))
                row += 1
            else:
                results.append(_NO_TOKENS)
        for i, prompt in self._prompt.items():
            results[i] = attrs.evolve(results[i], prompt_logprobs=prompt)
        self._ready = StepOutput(results, poisoned_seq_ids(self.seqs, self._nonfinite))
        self._tokens = self._logprobs = self._event = self._top = self._nonfinite = None
        return self._ready


class LaunchedVerification(LaunchedStep):
    """A verification step on its way: its packed results travel to pinned host memory.

    One non-blocking copy, completed on an event; :meth:`result` waits for it
    (the step's one host-device synchronization) and unpacks.
    """

    def __init__(
        self, seqs: list[SeqInput], verified: DeviceVerified, nonfinite: torch.Tensor | None = None
    ) -> None:
        super().__init__(seqs, nonfinite=nonfinite)
        self._verified = verified
        cuda = verified.packed.device.type == "cuda"
        self._packed = verified.packed.to("cpu", non_blocking=cuda)
        self._lps = None
        if verified.logprobs is not None:
            self._lps = verified.logprobs.to("cpu", non_blocking=cuda)
        self._done: torch.cuda.Event | None = None
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> StepOutput:
        """Wait for the copy; the accepted drafts and one more token per sampling sequence."""
        if self._ready is not None:
            return self._ready
        if self._done is not None:
            self._done.synchronize()
        lps = self._lps.tolist() if self._lps is not None else None
        v = self._verified.unpack(self._packed.tolist(), lps)
        emitted = iter(range(len(v.token_ids)))
        results = []
        for s in self.seqs:
            if not s.sample:
                results.append(_NO_TOKENS)
                continue
            i = next(emitted)
            results.append(SeqResult(v.token_ids[i], v.logprobs[i] if v.logprobs else None))
        self._ready = StepOutput(results, poisoned_seq_ids(self.seqs, self._nonfinite))
        return self._ready


class ModelRunner:
    """Runs the model over the paged KV cache and samples the next tokens."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        plugins: PluginManager,
        device: torch.device,
        dtype: torch.dtype,
        tensor_parallel: TensorParallelGroup | None = None,
    ) -> None:
        # With tensor parallelism this runner holds one rank's part of the model: its heads,
        # KV heads, MLP rows and vocabulary rows (pitstop.parallel).
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is not None:
            model_config = tensor_parallel.shard_config(model_config)
        self.config, self.model_config = config, model_config
        self.device, self.dtype = device, dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
        # the selected scheduler's step budget (chunked's chunk_size) sizes the prefill
        # workspace and the piecewise graphs, before the scheduler itself exists
        self.step_token_budget = plugins.step_token_budget(config)
        self.poison = config.poison_memory
        if self.poison:
            poison_torch_empty()
        self.kernels = plugins.create("kernels", config.kernels, config, device, dtype)
        check_kernels_read_fp8(self.kernels, config.kernels, self.kv_cache_dtype)
        if tensor_parallel is not None:
            from pitstop.parallel.kernels import TensorParallelKernels

            self.kernels = TensorParallelKernels(self.kernels, tensor_parallel)
        self.sampler = plugins.create("sampler", config.sampler, config, device)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):  # the model's factory, checked against protocols.Model
                self.model = plugins.create(
                    "model", model_config.architecture, model_config, self.kernels
                )
        finally:
            torch.set_default_dtype(previous)
        if tensor_parallel is not None and not getattr(
            self.model, "supports_tensor_parallel", False
        ):
            raise ConfigError(
                f"the {model_config.architecture} model plugin does not support tensor parallelism "
                "(it sets no supports_tensor_parallel); use tensor_parallel_size=1"
            )
        self.model.eval()
        assert config.max_model_len is not None
        rotary = plugins.architecture(model_config.architecture).rotary
        self.rotary = rotary(model_config, config.max_model_len, device)
        self.page_size = config.page_size
        self.kv_cache: torch.Tensor | None = None
        # Called with (the step's inputs, the logits rows it computed) after every step's
        # logits, before sampling; rows are the sampling inputs' num_logits rows, in order.
        self.logits_observer: LogitsObserver | None = None
        self.num_pages = 0
        self._generators: dict[int, torch.Generator] = {}
        self._histories = TokenHistories()  # penalized sequences' tokens, grown step by step
        self._verifier: DraftVerifier | None = None
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: PiecewiseGraphs | None = None
        self.verify_graphs: Any = None  # pitstop.spec_graphs.VerifyGraphs, with speculation
        # The last step's sampling rows (seq ids) and their batch: a sequence's params never change.
        self._batch_cache: tuple[tuple[int, ...], SamplingBatch] | None = None
        # The last launched step's sampled ids stay here on the device; the next step gathers
        # its pending input tokens from it (``_last_rows``: seq id -> row).
        rows = max(config.max_batch_size, 1)
        self.last_sampled = torch.zeros(rows, dtype=torch.int64, device=device)
        self._last_rows: dict[int, int] = {}
        # Pinned host buffers for the sampled ids (and log-probs), two so that the copy of
        # step N+1 never overwrites step N's before the host has read it.
        pin = device.type == "cuda"
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host_logprobs = [
            torch.zeros(rows, dtype=torch.float32, pin_memory=pin) for _ in range(2)
        ]
        self._flip = 0
        if self.poison:
            for buffer in (self.last_sampled, *self._host_tokens, *self._host_logprobs):
                poison_(buffer)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights) -> None:
        """Copy Hugging Face-named tensors into the model (``None``: random dummy weights).

        With ``check_weights`` (default) each tensor is checked for NaN and
        infinities as it streams into its copy (:mod:`pitstop.finite_weights`).
        """
        checked = finite_weights if self.config.check_weights else iter
        with torch.inference_mode():
            if self.tensor_parallel is not None:  # this rank's part of each tensor only
                shard = self.tensor_parallel.shard
                if weights is None:
                    self.model.init_dummy(self.config.seed, shard=shard)
                else:
                    self.model.load_weights(checked(weights(shard=shard)))
            elif weights is None:
                self.model.init_dummy(self.config.seed)
            else:
                self.model.load_weights(checked(weights()))

    # ------------------------------------------------------------------ KV cache
    def bytes_per_page(self) -> int:
        """Bytes of K and V for one page over all layers."""
        return kv_bytes_per_page(self.model_config, self.page_size, self.kv_cache_dtype)

    def plan_num_pages(self) -> int:
        """How many pages the KV cache gets: ``max_num_pages``, a GiB budget, or free GPU memory."""
        per_page = self.bytes_per_page()
        cfg = self.config
        asked = pages_asked(cfg, self.model_config, self.device, self.dtype)
        if asked is not None and (self.device.type != "cuda" or cfg.max_num_pages is None):
            return asked
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
        tokens = min(cfg.max_num_batched_tokens, max(cfg.max_model_len, self.step_token_budget))
        n_seqs = max(1, min(cfg.max_batch_size, -(-tokens // cfg.max_model_len)))
        # no made-up sequence longer than max_model_len: its positions would run past the
        # rotary table (a device-side assert with the reference kernels' index_select)
        per_seq = min(cfg.max_model_len, tokens // n_seqs)
        pages = (per_seq + self.page_size - 1) // self.page_size
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.init_kv_cache(pages * n_seqs)
        self.run_synthetic_step(n_seqs, per_seq, pages)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    def run_synthetic_step(self, num_seqs: int, num_tokens: int, pages_per_seq: int) -> None:
        """Run one step of ``num_seqs`` made-up prompts of ``num_tokens`` tokens (memory profiling).

        The sequences get negative ids, which no real sequence has, and every
        per-sequence cache the step filled is cleared afterwards: once, a
        profile sequence left its sampling batch (temperature 1) cached under
        id 0, and the first real request of a fresh process, also id 0,
        sampled with it instead of its own parameters.
        """
        seqs = [
            SeqInput(
                -1 - i,
                [0] * num_tokens,
                0,
                list(range(i * pages_per_seq, (i + 1) * pages_per_seq)),
                True,
                SamplingParams(),
            )
            for i in range(num_seqs)
        ]
        try:
            self.execute(StepInput(seqs))
        finally:
            self.forget_sequences([s.seq_id for s in seqs])

    def forget_sequences(self, seq_ids: Seq[int]) -> None:
        """Drop everything the runner keeps per sequence for ``seq_ids`` (they are gone)."""
        gone = set(seq_ids)
        for seq_id in gone:
            self._generators.pop(seq_id, None)
        self._histories.forget(list(gone))
        self.forget_block_tables(list(gone))
        if self._batch_cache is not None and gone.intersection(self._batch_cache[0]):
            self._batch_cache = None
        if gone.intersection(self._last_rows):
            self._last_rows = {k: v for k, v in self._last_rows.items() if k not in gone}

    def init_kv_cache(self, num_pages: int) -> None:
        """Allocate the KV cache: ``[layers, 2, num_pages, page_size, kv_heads, head_size]`` in ``kv_cache_dtype``."""
        mc = self.model_config
        shape = (mc.num_layers, 2, num_pages, self.page_size, mc.num_kv_heads, mc.head_size)
        # fp8 is zeroed as uint8 (zero bytes are +0.0): no float8 fill kernel needed on any device
        storage = torch.uint8 if self.kv_cache_dtype.itemsize == 1 else self.kv_cache_dtype
        self.kv_cache = torch.zeros(shape, dtype=storage, device=self.device).view(
            self.kv_cache_dtype
        )
        self.num_pages = num_pages
        if self.poison:
            poison_(self.kv_cache)

    def poison_pages(self, pages: Seq[int]) -> None:
        """Fill KV pages with NaN (``poison_memory``: pages handed to a sequence that writes them)."""
        if not pages or self.kv_cache is None:
            return
        index = torch.tensor(list(pages), dtype=torch.int64).to(self.device)
        poison_pages_(self.kv_cache, index)

    def maybe_capture_graphs(self, extra: Callable[[ModelRunner], None] | None = None) -> None:
        """Capture CUDA graphs for decode batches when the device and kernel set allow it.

        ``extra(runner)`` captures more graphs in the same session (the engine
        passes :func:`pitstop.spec_graphs.capture_verify_graphs` with speculation).
        """
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager:
            return
        if not self.kernels.cuda_graph_safe(self.model_config.head_size):
            log.info(
                "CUDA graphs off: kernel set %r is not graph-safe; decode runs eagerly", cfg.kernels
            )
            return
        start = time.perf_counter()
        # A garbage collection during capture could free another engine's graphs, events or
        # pinned buffers, which a capturing stream forbids: collect first, then hold it off.
        gc.collect()
        gc.disable()
        try:
            self.graphs = DecodeGraphs(self, max_batch=min(cfg.max_batch_size, 512))
            if supports_piecewise(self.model):
                try:
                    self.mixed_graphs = PiecewiseGraphs(self, max_tokens=self.mixed_step_tokens())
                except Exception as exc:  # noqa: BLE001 - eager prefill still works
                    torch.cuda.synchronize(self.device)
                    log.warning(
                        "piecewise CUDA graphs off (capture failed: %s); prefill and mixed "
                        "steps run eagerly",
                        exc,
                    )
            if extra is not None:
                extra(self)
        finally:
            gc.enable()
        if self.poison:  # what a replay reads, each replay must have written
            for graphs in (self.graphs, self.mixed_graphs, self.verify_graphs):
                if graphs is not None:
                    graphs.poison()
        log.info(
            "captured CUDA graphs for decode batch sizes %s and %s in %.1f s",
            self.graphs.describe(),
            f"prefill/mixed steps up to {self.mixed_graphs.max_tokens} tokens (piecewise)"
            if self.mixed_graphs is not None
            else "no prefill steps (the model has no before/after_attention)",
            time.perf_counter() - start,
        )

    def mixed_step_tokens(self) -> int:
        """The largest prefill/mixed step to capture piecewise: the step budget, at most 2048.

        Longer steps are compute-bound (tens of milliseconds of GEMMs), so
        their eager launch is hidden behind the GPU anyway.
        """
        return max(16, min(self.step_token_budget, MAX_PIECEWISE_TOKENS))

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
        ids = np.asarray(input_ids, dtype=np.int64)
        on_device = [
            (cu[i + 1] - len(s.draft_ids), s.draft_ids)
            for i, s in enumerate(seqs)
            if s.draft_ids is not None
        ]
        for begin, drafts in on_device:
            ids[begin : begin + len(drafts)] = 0  # placeholders: written on the device below
        pending = np.flatnonzero(ids == PENDING_TOKEN)
        src = None
        if len(pending):
            seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)[pending]
            src = np.asarray([self._pending_row(seqs[i].seq_id) for i in seq_of_token])
            ids[pending] = 0
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
        input_tensor = tensor(ids, torch.int64)
        if src is not None:  # the previous step's samples, gathered on the device
            index = tensor(pending, torch.int64)
            input_tensor.index_copy_(0, index, self.last_sampled[tensor(src, torch.int64)])
        for begin, drafts in on_device:
            input_tensor[begin : begin + len(drafts)].copy_(drafts)
        return input_tensor, meta, sample_rows

    def save_samples(self) -> tuple[torch.Tensor, dict[int, int]]:
        """A copy of the last launched step's samples (to rerun parts of a failed step)."""
        return self.last_sampled.clone(), dict(self._last_rows)

    def restore_samples(self, saved: tuple[torch.Tensor, dict[int, int]]) -> None:
        """Put back what :meth:`save_samples` copied."""
        self.last_sampled.copy_(saved[0])
        self._last_rows = dict(saved[1])

    def adopt_samples(self, sampled: Seq[tuple[int, int]]) -> None:
        """Make ``(seq_id, token)`` pairs the last step's samples (after a step was rerun in parts)."""
        self._last_rows = {seq_id: i for i, (seq_id, _) in enumerate(sampled)}
        if sampled:
            values = torch.tensor([t for _, t in sampled], dtype=torch.int64)
            self.last_sampled[: len(sampled)].copy_(values.to(self.device))

    def _pending_row(self, seq_id: int) -> int:
        """The row of ``seq_id`` in the last launched step's samples (its pending token's value)."""
        row = self._last_rows.get(seq_id)
        if row is None:
            raise RuntimeError(
                f"sequence {seq_id} has a pending token but did not sample in the last launched step"
            )
        return row

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step and wait for its tokens (:meth:`launch`, then its result)."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: StepInput) -> LaunchedStep:
        """Queue one step on the device: forward, logits, sampling, and the copy of the tokens back.

        Returns without waiting for the device; a step that verifies
        speculative drafts is verified on the device too (replaying a
        verification graph when one fits). Pending input tokens are read from
        the previous launched step's samples, on the device.
        """
        self.forget_sequences(step.finished_seq_ids)
        self.forget_block_tables(step.reset_seq_ids)
        self.poison_pages(step.poison_pages)
        if not step.seqs:
            return LaunchedStep([], ready=StepOutput([]))
        assert self.kv_cache is not None, "init_kv_cache() first"
        verifies = any(s.num_logits > 1 for s in step.seqs)
        wants_prompt = any(s.prompt_targets for s in step.seqs)
        if (
            verifies
            and not wants_prompt
            and self.verify_graphs is not None
            and self.verify_graphs.can_run(step.seqs)
        ):
            logits, rows = self.verify_graphs.run(step.seqs)
            if self.tensor_parallel is not None:
                if self.tensor_parallel.rank > 0:  # a worker: rank 0 verifies
                    return self._follow_rank0(step.seqs, True)
                self.tensor_parallel.step_open = False
            logits = self.select_rows(logits, rows)
            if self.logits_observer is not None:
                self.logits_observer(step.seqs, logits)
            return self._launch_verification(step.seqs, logits)
        hidden, rows, starts = self.forward(step.seqs)
        prompt = None
        if wants_prompt:
            prompt = self._prompt_logprobs(step.seqs, hidden, starts)
        if not rows:
            self._last_rows = {}
            return LaunchedStep(
                step.seqs, ready=StepOutput([_NO_TOKENS] * len(step.seqs)), prompt=prompt
            )
        logits = self.model.compute_logits(self.select_rows(hidden, rows))
        # before sampling: logits processors may write into the rows
        nan_rows = nan_rows_of(logits) if self.poison else None
        if self.logits_observer is not None:
            self.logits_observer(step.seqs, logits)
        sampling = [s for s in step.seqs if s.sample]
        if self.tensor_parallel is not None:
            if self.tensor_parallel.rank > 0:  # a worker: rank 0 samples (or verifies)
                return self._follow_rank0(step.seqs, verifies)
            self.tensor_parallel.step_open = False  # from here on the ranks stay in step
        if verifies:
            return self._launch_verification(step.seqs, logits)
        n = len(sampling)
        try:
            params = [s.params or SamplingParams() for s in sampling]
            generators = [
                self._generator(s.seq_id, p) for s, p in zip(sampling, params, strict=True)
            ]
            key = tuple(s.seq_id for s in sampling)
            if self._batch_cache is not None and self._batch_cache[0] == key:
                batch = self._batch_cache[1]  # same rows as last step: no host-to-device copies
            else:
                batch = make_sampling_batch(params, generators, self.device)
                self._batch_cache = (key, batch)
            row_inputs = [s.row_inputs for s in sampling]
            if any(r is not None for r in row_inputs):
                pending = [self._last_rows.get(s.seq_id, 0) for s in sampling]
                batch = make_step_inputs(
                    batch,
                    row_inputs,
                    pending,
                    self.last_sampled,
                    logits.shape[-1],
                    seq_ids=[s.seq_id for s in sampling],
                    histories=self._histories,
                )
            out = self.sampler.sample(logits, batch)
            self.last_sampled[:n].copy_(out.token_ids)
        finally:  # tensor parallelism: the workers wait for these ids, even if sampling failed
            if self.tensor_parallel is not None:
                self.tensor_parallel.share_samples(self.last_sampled[:n])
        self._last_rows = {s.seq_id: i for i, s in enumerate(sampling)}
        self._flip ^= 1
        host_tokens = self._host_tokens[self._flip][:n]
        host_tokens.copy_(out.token_ids, non_blocking=True)
        host_logprobs = None
        if out.logprobs is not None:
            host_logprobs = self._host_logprobs[self._flip][:n]
            host_logprobs.copy_(out.logprobs, non_blocking=True)
        top = None
        if out.ranks is not None:
            top = (_to_host(out.top_ids), _to_host(out.top_logprobs), _to_host(out.ranks))
        nonfinite = _to_host(nan_rows)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return LaunchedStep(
            step.seqs,
            host_tokens,
            host_logprobs,
            event,
            top=top,
            prompt=prompt,
            nonfinite=nonfinite,
        )

    def _prompt_logprobs(
        self, seqs: list[SeqInput], hidden: torch.Tensor, starts: list[int]
    ) -> dict[int, list[tuple[float, int, list[tuple[int, float]]]]]:
        """Log-probabilities of the prompt tokens some sequences of this step predict.

        One logits GEMM over those rows, then the targets' log-probabilities,
        ranks and top-k, read back at once (a step with ``prompt_logprobs``
        waits for the device here; other steps never come here).
        """
        rows: list[int] = []
        targets: list[int] = []
        owners: list[int] = []
        for i, s in enumerate(seqs):
            if s.prompt_targets:
                rows.extend(range(starts[i], starts[i] + len(s.prompt_targets)))
                targets.extend(s.prompt_targets)
                owners.append(i)
        k = max(s.prompt_logprobs for s in seqs if s.prompt_targets)
        index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[index]).float(), dim=-1)
        target = torch.tensor(targets, dtype=torch.int64, device=hidden.device).unsqueeze(1)
        chosen = logprobs.gather(1, target)
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        top_lp, top_ids = logprobs.topk(max(k, 1), dim=-1)
        chosen_l, top_lp_l, top_ids_l = (
            chosen.squeeze(1).tolist(),
            top_lp.tolist(),
            top_ids.tolist(),
        )
        out: dict[int, list[tuple[float, int, list[tuple[int, float]]]]] = {}
        row = 0
        for i in owners:
            s = seqs[i]
            entries = []
            for _ in s.prompt_targets or ():
                top = list(zip(top_ids_l[row], top_lp_l[row], strict=True))[: s.prompt_logprobs]
                entries.append((chosen_l[row], ranks[row], top))
                row += 1
            out[i] = entries
        return out

    def _follow_rank0(self, seqs: list[SeqInput], verifies: bool) -> LaunchedStep:
        """A tensor-parallel worker's end of a step: rank 0 samples; take its ids (for the next
        step's pending tokens). A verifying step runs serially: nothing is pending after it."""
        n = sum(s.sample for s in seqs)
        if verifies:
            self._last_rows = {}
        else:
            self.tensor_parallel.share_samples(self.last_sampled[:n])
            self._last_rows = {s.seq_id: i for i, s in enumerate(s for s in seqs if s.sample)}
        return LaunchedStep(seqs, ready=StepOutput([_NO_TOKENS] * len(seqs)))

    def forget_block_tables(self, seq_ids: Seq[int]) -> None:
        """Drop the graphs' copies of these sequences' block tables (finished, or shortened)."""
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None:
                graphs.forget(seq_ids)

    def forward(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, list[int], list[int]]:
        """The model over one step (a decode graph, piecewise graphs, or eagerly).

        Returns the hidden states, the rows to sample and each sequence's first row.
        """
        if self.graphs is not None and self.graphs.can_run(seqs):
            rows = [i for i, s in enumerate(seqs) if s.sample]
            return self.graphs.run(seqs), rows, list(range(len(seqs)))  # one token each
        input_ids, meta, rows = self.build_metadata(seqs)
        starts = np.cumsum([0] + [len(s.token_ids) for s in seqs[:-1]]).tolist()
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(input_ids.shape[0]):
            return self.mixed_graphs.run(input_ids, meta), rows, starts
        return self.model(input_ids, self.rotary, self.kv_cache, meta), rows, starts

    def _launch_verification(self, seqs: list[SeqInput], logits: torch.Tensor) -> LaunchedStep:
        """Verify the drafts of a step on the device; its results come back in one copy.

        ``logits`` holds ``num_logits`` rows per sampling sequence, in order.
        Nothing of this step is pending afterwards: the engine applies a
        verification before it launches the next step.
        """
        sampling = [s for s in seqs if s.sample]
        params = [s.params or SamplingParams() for s in sampling]
        generators = [self._generator(s.seq_id, p) for s, p in zip(sampling, params, strict=True)]
        if self._verifier is None:
            self._verifier = DraftVerifier(self.sampler, self.device, self.config.seed)
        self._last_rows = {}
        nonfinite = _to_host(nan_rows_of(logits)) if self.poison else None
        return LaunchedVerification(seqs, self._verifier(logits, sampling, generators), nonfinite)

    def select_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
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


class PoisonedReadError(RuntimeError):
    """A step's logits held NaN with ``poison_memory`` on: something read memory nothing wrote."""

    def __init__(self, seq_id: int) -> None:
        super().__init__(
            f"sequence {seq_id} got NaN logits with poison_memory on: a kernel or "
            "workspace read memory the engine never wrote (poisoned with NaN); run with the "
            "reference kernels and enforce_eager to narrow it down"
        )


def nan_rows_of(logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits``, whether any value is NaN (on the device, no wait).

    With poisoned memory a NaN is how a read of unwritten KV slots, workspace
    or staging memory shows; unchecked, greedy sampling would turn it into
    token 0, a plausible answer. An infinite logit is not flagged: ``-inf``
    is how masks (grammars, banned tokens) remove a token.
    """
    return torch.isnan(logits).any(dim=-1)


def poisoned_seq_ids(seqs: Seq[SeqInput], nonfinite: torch.Tensor | None) -> frozenset[int]:
    """The sampling sequences (``num_logits`` rows each, in order) with a NaN row."""
    if nonfinite is None:
        return frozenset()
    flags = nonfinite.tolist()
    owners = [s.seq_id for s in seqs if s.sample for _ in range(s.num_logits)]
    return frozenset(owner for owner, bad in zip(owners, flags, strict=True) if bad)


def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A non-blocking copy of ``tensor`` into pinned host memory (complete at the step's event)."""
    if tensor is None or tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def capture_graph(
    run: Callable[[], Any], pool: Any, device: torch.device
) -> tuple[torch.cuda.CUDAGraph, Any, Any]:
    """Warm ``run`` up, then capture it in a CUDA graph on memory pool ``pool`` (None: a new one).

    Returns the graph, what ``run`` returned during capture (its static
    output) and the pool, for the next graph to share.
    """
    run()  # warm-up: compiles kernels, settles the allocator
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out, graph.pool() if pool is None else pool


def capture_buckets(
    sizes: Seq[int], forward: Callable[[int], torch.Tensor], device: torch.device
) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """One graph of ``forward(size)`` per size, largest first, all on one memory pool.

    Returns size -> (graph, its static output).
    """
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    pool = None
    with torch.inference_mode():
        for size in sorted(sizes, reverse=True):
            graph, out, pool = capture_graph(lambda size=size: forward(size), pool, device)
            graphs[size] = (graph, out)
    torch.cuda.synchronize(device)
    return graphs


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 16 up to ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class BlockTableRows:
    """Block tables of the live sequences, kept in one numpy array and updated incrementally.

    Each sequence owns a row while it lives; a step writes only the pages a
    table gained since the last step (tables only grow between ``allocate``
    and ``free``/``truncate``; a new list object, a shorter table or an
    explicit :meth:`forget` rewrites the row), then gathers the step's rows
    in one vectorized copy.
    """

    def __init__(self, max_pages: int, capacity: int = 64, *, poison: bool = False) -> None:
        self.max_pages = max_pages
        self.poison = poison  # released rows and new capacity hold INT_SENTINEL, not zeros
        self.array = np.zeros((capacity, max_pages), dtype=np.int32)
        if poison:
            poison_array(self.array)
        self._row: dict[int, int] = {}  # seq_id -> row
        self._known: dict[int, tuple[list[int], int]] = {}  # seq_id -> (table object, length)
        self._free = list(range(capacity - 1, -1, -1))

    def forget(self, seq_ids: Seq[int]) -> None:
        """Release the rows of sequences that finished, were preempted or truncated."""
        for seq_id in seq_ids:
            row = self._row.pop(seq_id, None)
            if row is not None:
                self._free.append(row)
                del self._known[seq_id]
                if self.poison:
                    poison_array(self.array[row])

    def rows(self, seqs: Seq[SeqInput]) -> np.ndarray:
        """The rows of ``seqs`` (in order), every table brought up to date."""
        out = np.empty(len(seqs), dtype=np.int64)
        for i, s in enumerate(seqs):
            table = s.block_table
            row = self._row.get(s.seq_id)
            if row is None:
                if not self._free:
                    self._grow()
                row = self._row[s.seq_id] = self._free.pop()
                begin = 0
            else:
                obj, length = self._known[s.seq_id]
                begin = length if obj is table and len(table) >= length else 0
            if begin < len(table):
                self.array[row, begin : len(table)] = table[begin:]
            self._known[s.seq_id] = (table, len(table))
            out[i] = row
        return out

    def _grow(self) -> None:
        old = self.array.shape[0]
        grown = np.zeros_like(self.array)
        if self.poison:
            poison_array(grown)
        self.array = np.concatenate([self.array, grown])
        self._free.extend(range(2 * old - 1, old - 1, -1))


class DecodeGraphs:
    """CUDA graphs of the model's forward for pure-decode steps, one per batch size.

    Every input lives in a static buffer; a step copies its (padded) inputs in
    and replays the graph of the smallest captured batch that fits. Padding
    rows get slot -1 (no KV store) and context length 0 (no attention). A
    pending input token (sampled by the previous step, not yet on the host)
    is gathered inside the graph from the runner's ``last_sampled`` buffer:
    ``src`` names its row there (-1: the host's id in ``input_ids``). The
    host staging buffers are pinned and doubled, so that the next step's
    writes never race this step's copies.
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
        self.src = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(b, self.max_pages, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.cu_query_lens = torch.arange(b + 1, dtype=torch.int32, device=dev)
        # host staging, pinned (asynchronous copies) and doubled; one int64 row block
        # [ids, src, positions, slots] and the int32 context lens, then block tables
        self._host64 = [torch.zeros(4, b, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._host32 = [
            torch.zeros(b * (1 + self.max_pages), dtype=torch.int32, pin_memory=True)
            for _ in range(2)
        ]
        self._flip = 0
        self.tables = BlockTableRows(self.max_pages, capacity=max(64, 2 * b), poison=runner.poison)
        self.graphs = capture_buckets(self.sizes, self._forward, dev)

    def poison(self) -> None:
        """Poison every static input and staging buffer (``poison_memory``, after capture)."""
        for buffer in (
            self.input_ids, self.src, self.positions, self.slots, self.block_tables,
            self.context_lens, *self._host64, *self._host32,
        ):  # fmt: skip
            poison_(buffer)

    def _forward(self, size: int) -> torch.Tensor:
        runner = self.runner
        src = self.src[:size]
        pending = runner.last_sampled[src.clamp(min=0)]
        ids = torch.where(src >= 0, pending, self.input_ids[:size])
        return runner.model(ids, runner.rotary, runner.kv_cache, self._meta(size))

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

    def forget(self, seq_ids: Seq[int]) -> None:
        """Drop the block-table rows of sequences that finished or whose tables were rebuilt."""
        if seq_ids:
            self.tables.forget(seq_ids)

    def run(self, seqs: Seq[SeqInput]) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, replay, return hidden ``[n, hidden]``."""
        n = len(seqs)
        size = next(b for b in self.sizes if b >= n)
        ps = self.runner.page_size
        self._flip ^= 1
        h64, h32 = self._host64[self._flip], self._host32[self._flip]
        b = self.max_batch
        h_ctx, h_tables = h32[:b], h32[b:].view(b, self.max_pages)
        a64, a_ctx, a_tables = h64.numpy(), h_ctx.numpy(), h_tables.numpy()
        ids = [s.token_ids[0] for s in seqs]
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        a64[0, :n] = ids
        a64[0, n:size] = 0  # padding rows read token 0 (and store nothing)
        pending = a64[0, :n] == PENDING_TOKEN
        a64[1, :n] = -1
        if pending.any():
            rows = self.runner._pending_row
            a64[1, :n][pending] = [rows(seqs[i].seq_id) for i in np.flatnonzero(pending)]
            a64[0, :n][pending] = 0
        a64[2, :n] = pos
        rows_of = self.tables.rows(seqs)
        tables = self.tables.array
        a_tables[:n] = tables[rows_of]
        page = tables[rows_of, pos // ps]
        a64[3, :n] = page.astype(np.int64) * ps + pos % ps
        a_ctx[:n] = pos + 1
        a64[1:, n:size] = -1  # padding: no pending token, no KV store
        a64[2, n:size] = 0
        a_ctx[n:size] = 0
        a_tables[n:size] = 0  # padding rows attend to nothing; their tables point at page 0
        self.input_ids[:size].copy_(h64[0, :size], non_blocking=True)
        self.src[:size].copy_(h64[1, :size], non_blocking=True)
        self.positions[:size].copy_(h64[2, :size], non_blocking=True)
        self.slots[:size].copy_(h64[3, :size], non_blocking=True)
        self.context_lens[:size].copy_(h_ctx[:size], non_blocking=True)
        self.block_tables[:size].copy_(h_tables[:size], non_blocking=True)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]


MAX_PIECEWISE_TOKENS = 2048


def supports_piecewise(model: torch.nn.Module) -> bool:
    """Whether a model has the split forward :class:`PiecewiseGraphs` drives
    (:class:`~pitstop.protocols.SplitForwardModel`: the Llama family has it)."""
    # kinds.lacks, not isinstance(): see there (an nn.Module's submodules)
    layers = getattr(model, "layers", None) or ()
    return (
        not lacks(SplitForwardModel, model)
        and len(layers) > 0
        and all(not lacks(SplitLayer, x) and not lacks(SplitAttention, x.self_attn) for x in layers)
    )


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture for prefill and mixed steps: 16, 32, 64, 128, then x1.5 / x2 steps."""
    sizes: list[int] = []
    size = 16
    while size < max_tokens:
        sizes.append(size)
        half = size + size // 2
        if size >= 128 and half < max_tokens:
            sizes.append(half)
        size *= 2
    sizes.append(max_tokens)
    return sorted(set(sizes))


class PiecewiseGraphs:
    """CUDA graphs for steps that prefill (chunks, prompts, mixed with decodes): all but attention.

    Attention over a mix of prompts and decodes needs host-side lengths, so
    it runs eagerly; everything between two attentions is one captured graph
    per token-count bucket: segment 0 is the embedding and layer 0 up to its
    attention (norm, projections, rotary, K/V store), segment i the rest of
    layer i-1 and layer i up to attention, the last segment the rest of the
    last layer and the final norm. A step of ``T`` tokens replays the graphs
    of the smallest bucket ``>= T`` and runs the model's attention between
    them on the real ``T`` rows; padding rows store no K/V (slot -1) and are
    row-independent everywhere else, so they never touch a real row. This
    turns a few hundred kernel launches per step into one replay per layer
    plus the attention call, so the host keeps ahead of the GPU.
    """

    def __init__(self, runner: ModelRunner, max_tokens: int, *, capture: bool = True) -> None:
        self.runner = runner
        self.captured = capture
        model = runner.model
        cfg = runner.model_config
        dev, dtype = runner.device, runner.dtype
        self.sizes = mixed_graph_sizes(max_tokens)
        t = self.max_tokens = self.sizes[-1]
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.q = torch.zeros(t, cfg.num_heads, cfg.head_size, dtype=dtype, device=dev)
        self.o = torch.zeros(t, cfg.num_heads, cfg.head_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev)
        self._no_tables = torch.zeros(0, 1, dtype=torch.int32, device=dev)
        self.num_layers = len(model.layers)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if not capture:  # the segments run eagerly (CPU tests of the split forward)
            return
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):
                graphs = []
                for segment in range(self.num_layers + 1):
                    graph, _, pool = capture_graph(
                        lambda segment=segment, size=size: self._segment(segment, size), pool, dev
                    )
                    graphs.append(graph)
                self.graphs[size] = graphs
        torch.cuda.synchronize(dev)

    def poison(self) -> None:
        """Poison the static inputs and activations (``poison_memory``, after capture)."""
        for buffer in (
            self.input_ids, self.positions, self.slots, self.q, self.o, self.residual, self.hidden,
        ):  # fmt: skip
            poison_(buffer)

    def _static_meta(self, size: int) -> AttentionMetadata:
        """What the captured segments read: positions and slots (rotary, K/V store)."""
        return AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slots[:size],
            block_tables=self._no_tables,
            context_lens=self.slots[:0],
            cu_query_lens=self.slots[:0],
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=0,
            max_query_len=0,
            max_context_len=0,
            page_size=self.runner.page_size,
        )

    def _segment(self, segment: int, size: int) -> None:
        """Run segment ``segment`` for ``size`` rows, reading and writing the static buffers."""
        runner = self.runner
        model, kv = runner.model, runner.kv_cache
        assert kv is not None
        meta = self._static_meta(size)
        if segment == 0:
            ids = self.input_ids[:size]
            x = model.embed(ids)
            residual = None
        else:
            x, residual = model.layers[segment - 1].after_attention(
                self.o[:size], self.residual[:size]
            )
        if segment == self.num_layers:
            self.hidden[:size].copy_(model.final_norm(x, residual))
            return
        q, residual = model.layers[segment].before_attention(
            x, residual, runner.rotary, kv[segment, 0], kv[segment, 1], meta
        )
        self.q[:size].copy_(q)
        self.residual[:size].copy_(residual)

    def can_run(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens fits a captured bucket."""
        return 0 < num_tokens <= self.max_tokens

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One step: copy ids, positions and slots in, replay, attend eagerly between; ``[T, hidden]``."""
        n = input_ids.shape[0]
        size = next(b for b in self.sizes if b >= n) if self.captured else n
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.positions[n:size].zero_()
        self.input_ids[n:size].zero_()
        model, kv = self.runner.model, self.runner.kv_cache
        assert kv is not None
        graphs = self.graphs.get(size)
        for layer in range(self.num_layers + 1):
            if graphs is not None:
                graphs[layer].replay()
            else:
                self._segment(layer, size)
            if layer == self.num_layers:
                break
            o = model.layers[layer].self_attn.attend(self.q[:n], kv[layer, 0], kv[layer, 1], meta)
            self.o[:n].copy_(o)
        return self.hidden[:n]
