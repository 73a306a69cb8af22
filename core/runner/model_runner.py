"""The model runner: owns the weights and the KV cache, runs one step, samples.

The engine talks to it through plain data only (:mod:`pitstop.ground.step`:
:class:`~pitstop.ground.step.StepInput` in; a handle whose result is a
:class:`~pitstop.ground.step.StepOutput` out), so that under tensor parallelism one
runner per rank gets the same input (an executor plugin's ranks,
:mod:`pitstop.plugin_system.executor`); each then holds its part of the model.
:class:`ModelRunner` coordinates the parts, each a module of its own:

- :mod:`pitstop.runner.batch`: a step as flat tensors and attention metadata;
- :mod:`pitstop.runner.graphs`, :mod:`pitstop.runner.piecewise`,
  :mod:`pitstop.runner.capture`: CUDA graphs (decode and verification as one
  mechanism; piecewise prefill) and their capture;
- :mod:`pitstop.runner.sampling`: sampling and verification, and what they
  keep between steps (prompt log-probabilities are the sampler's); :mod:`pitstop.runner.launched`: the launched step's handle;
- :mod:`pitstop.runner.memory_plan`: device, dtype and the KV cache's size;
- :mod:`pitstop.runner.peers`: the step's peers (alone, or the other ranks an
  executor's :class:`~pitstop.runner.peers.RankParallel` gives), behind one call, so
  ``launch`` reads the same at every rank count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, nullcontext

import attrs
import numpy as np
import torch

from pitstop.config import EngineConfig
from pitstop.errors import ConfigError
from pitstop.ground.attention import AttentionMetadata
from pitstop.ground.model_config import ModelConfig
from pitstop.ground.poison import nan_rows_of, poison_, poison_pages_, poison_torch_empty
from pitstop.ground.step import NO_TOKENS, LogitsObserver, SeqInput, StepInput, StepOutput
from pitstop.loading.checkpoint import weight_stream
from pitstop.loading.finite_weights import finite_weights
from pitstop.loading.kv_cache_dtype import check_kernels_read_fp8, resolve_kv_cache_dtype
from pitstop.plugin_system.adapter import AdapterContext, Adapters
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.plugin_system.protocols import ModelBase, SamplerBase
from pitstop.plugin_system.registration import takes_keyword
from pitstop.plugin_system.settings import ResolvedConfig, resolve
from pitstop.requests.sampling_params import SamplingParams
from pitstop.runner.batch import build_metadata, select_rows
from pitstop.runner.capture import capture_graphs
from pitstop.runner.graphs import DecodeGraphs, ForwardParts
from pitstop.runner.launched import LaunchedStep
from pitstop.runner.memory_plan import (  # noqa: F401  (resolve_device, resolve_dtype re-exported)
    kv_bytes_per_page,
    plan_num_pages,
    profile_peak_memory,
    resolve_device,
    resolve_dtype,
)
from pitstop.runner.peers import Alone, RankParallel, StepPeers
from pitstop.runner.piecewise import PiecewiseGraphs, mixed_step_tokens
from pitstop.runner.sampling import StepSampling

log = logging.getLogger(__name__)


def weights_keyword(runner: ModelRunner, plugins: PluginManager) -> dict[str, object]:
    """``{"weights": format}`` for a model factory that takes ``weights=``; nothing for one
    that does not, which runs dense weights only (any other format is a ConfigError)."""
    architecture = runner.model_config.architecture
    if takes_keyword(plugins.get("model", architecture).factory, "weights"):
        return {"weights": runner.weights}
    default = attrs.fields(EngineConfig).weights.default
    if runner.config.weights != default:
        raise ConfigError(
            f"weights={runner.config.weights!r}: the {architecture} model plugin takes no weight "
            f"format (its factory has no weights= keyword) and holds its weights dense; use "
            f"weights={default!r}"
        )
    return {}


class ModelRunner:
    """Runs the model over the paged KV cache and samples the next tokens."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        plugins: PluginManager,
        device: torch.device,
        dtype: torch.dtype,
        parallel: RankParallel | None = None,
        *,
        resolved: ResolvedConfig | None = None,
        memory_region: Callable[[str], AbstractContextManager[object]] | None = None,
    ) -> None:
        """``resolved``: ``config`` as the engine resolved it (every selected strategy's typed
        settings, :func:`pitstop.plugin_system.settings.resolve`); resolved here when the runner is built alone.
        ``parallel``: this rank's part in a model split over several (an executor plugin's;
        None: the whole model, in this process). ``memory_region(tag)``: a context the weights
        (``"weights"``) and the KV cache (``"kv_cache"``) are allocated in, so that they can be
        released and restored later (sleep mode; None: plain allocations)."""
        self.memory_region = memory_region or (lambda tag: nullcontext())
        if resolved is None:  # built alone (a test, a draft model): its own kinds' settings
            resolved = resolve(config, plugins, kinds=("kernels", "sampler", "weights"))
        # Split over several ranks, this runner holds one rank's part of the model: its heads,
        # KV heads, MLP rows and vocabulary rows.
        self.parallel = parallel
        if parallel is not None:
            model_config = parallel.rank_model_config(model_config)
        self.config, self.model_config = config, model_config
        self.device, self.dtype = device, dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
        # the selected scheduler's step budget (chunked's chunk_size) sizes the prefill
        # workspace and the piecewise graphs, before the scheduler itself exists
        self.step_token_budget = resolved.step_token_budget
        self.poison = config.poison_memory
        if self.poison:
            poison_torch_empty()
        self.kernels = plugins.create(
            "kernels", config.kernels, config, device, dtype, settings=resolved.of("kernels")
        )
        check_kernels_read_fp8(self.kernels, config.kernels, self.kv_cache_dtype)
        if parallel is not None:
            self.kernels = parallel.wrap_kernels(self.kernels)
        self.sampler = plugins.create(
            "sampler", config.sampler, config, device, settings=resolved.of("sampler")
        )
        # how the model holds and multiplies its linear weights (weights=NAME)
        self.weights = plugins.create(
            "weights",
            config.weights,
            config,
            self.kernels,
            device,
            dtype,
            settings=resolved.of("weights"),
        )
        with self.memory_region("weights"):
            self.model = self._build_model(plugins)
        # the adapter plugin (adapter=NAME, vLLM's enable_lora): wraps the model's projections
        self.adapters: Adapters | None = self._build_adapters(plugins, resolved)
        assert config.max_model_len is not None
        rotary = plugins.architecture(model_config.architecture).rotary
        self.rotary = rotary(model_config, config.max_model_len, device)
        self.page_size = config.page_size
        self.kv_cache: torch.Tensor | None = None
        # Called with (the step's inputs, the logits rows it computed) after every step's
        # logits, before sampling; rows are the sampling inputs' num_logits rows, in order.
        self.logits_observer: LogitsObserver | None = None
        self.num_pages = 0
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: PiecewiseGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = (
            None  # pitstop.runner.verify_graphs, with speculation
        )
        self.sampling = StepSampling(
            self.sampler,
            device,
            max(config.max_batch_size, 1),
            poison=self.poison,
        )
        self.peers: StepPeers = Alone() if parallel is None else parallel.peers(self.sampling)

    def _build_model(self, plugins: PluginManager) -> torch.nn.Module:
        """The architecture plugin's model, built on the device in the model's dtype."""
        mc = self.model_config
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):  # the model's factory, checked against protocols.Model
                model = plugins.create(
                    "model", mc.architecture, mc, self.kernels, **weights_keyword(self, plugins)
                )
        finally:
            torch.set_default_dtype(previous)
        if self.parallel is not None and not ModelBase.of(model, "supports_tensor_parallel"):
            raise ConfigError(
                f"the {mc.architecture} model plugin does not support tensor parallelism "
                "(it sets no supports_tensor_parallel); use tensor_parallel_size=1"
            )
        model.eval()
        return model

    def _build_adapters(self, plugins: PluginManager, resolved: ResolvedConfig) -> Adapters | None:
        """The adapter plugin the config names, attached to the model (None: no adapters)."""
        config = self.config
        if config.adapter is None:
            return None
        shard = None if self.parallel is None else self.parallel.shard
        context = AdapterContext(
            config,
            self.model_config,
            self.kernels,
            self.device,
            self.dtype,
            shard=shard,
            weights_region=lambda: self.memory_region("weights"),
            step_tokens=self.step_token_budget,
        )
        adapters = plugins.create(
            "adapter", config.adapter, config, context, settings=resolved.of("adapter")
        )
        adapters.attach(self.model)
        return adapters

    def weight_bytes(self) -> int:
        """Device bytes of the model's weights as held (the weight format's resident bytes
        for its linear layers): what one decode step reads of them."""
        return ModelBase.of(self.model, "weight_bytes")()

    # ------------------------------------------------------------------ per-step state
    @property
    def last_sampled(self) -> torch.Tensor:
        """The last launched step's sampled ids, on the device (read by the next step)."""
        return self.sampling.last_sampled

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights) -> None:
        """Copy Hugging Face-named tensors into the model (``None``: random dummy weights).

        With ``check_weights`` (default) each tensor is checked for NaN and
        infinities as it streams into its copy (:mod:`pitstop.loading.finite_weights`).
        """
        checked = finite_weights if self.config.check_weights else iter
        with torch.inference_mode(), self.memory_region("weights"):
            if self.parallel is not None:  # this rank's part of each tensor only
                shard = self.parallel.shard
                if weights is None:
                    self.model.init_dummy(self.config.seed, shard=shard)
                else:
                    self.model.load_weights(checked(weights(shard=shard)))
                return
            # a weight format that keeps quantized blocks gets them (pitstop.loading.checkpoint)
            stream = weight_stream(weights, self.weights, self.model)
            if stream is None:
                self.model.init_dummy(self.config.seed)
            else:
                self.model.load_weights(checked(stream))

    # ------------------------------------------------------------------ KV cache
    def bytes_per_page(self) -> int:
        """Bytes of K and V for one page over all layers."""
        return kv_bytes_per_page(self.model_config, self.page_size, self.kv_cache_dtype)

    def plan_num_pages(self) -> int:
        """How many pages the KV cache gets: ``max_num_pages``, a GiB budget, or free GPU memory."""
        return plan_num_pages(
            self.config,
            self.model_config,
            self.device,
            self.dtype,
            self.bytes_per_page(),
            self._profile_peak_memory,
        )

    def _profile_peak_memory(self) -> int:
        """The memory the largest step takes beyond the weights (a cache made for it, then dropped)."""
        peak = profile_peak_memory(
            self.config, self.device, self.page_size, self.step_token_budget, self._profile_step
        )
        self.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    def _profile_step(self, num_seqs: int, num_tokens: int, pages_per_seq: int) -> int:
        """A KV cache for one made-up step of this shape, and the step (memory profiling);
        returns the bytes that cache took."""
        before = torch.cuda.memory_allocated(self.device)
        self.init_kv_cache(num_seqs * pages_per_seq)
        cache_bytes = torch.cuda.memory_allocated(self.device) - before
        self.run_synthetic_step(num_seqs, num_tokens, pages_per_seq)
        return cache_bytes

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
        self.sampling.forget(gone)
        self.forget_block_tables(list(gone))

    def forget_block_tables(self, seq_ids: Seq[int]) -> None:
        """Drop the graphs' copies of these sequences' block tables (finished, or shortened)."""
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None:
                graphs.forget(seq_ids)

    def init_kv_cache(self, num_pages: int) -> None:
        """Allocate the KV cache: ``[layers, 2, num_pages, page_size, kv_heads, head_size]`` in ``kv_cache_dtype``."""
        mc = self.model_config
        shape = (mc.num_layers, 2, num_pages, self.page_size, mc.num_kv_heads, mc.head_size)
        # fp8 is zeroed as uint8 (zero bytes are +0.0): no float8 fill kernel needed on any device
        storage = torch.uint8 if self.kv_cache_dtype.itemsize == 1 else self.kv_cache_dtype
        with self.memory_region("kv_cache"):
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

    # ------------------------------------------------------------------ CUDA graphs
    def maybe_capture_graphs(self, extra: Callable[[ModelRunner], None] | None = None) -> None:
        """Capture CUDA graphs for decode batches when the device and kernel set allow it.

        ``extra(runner)`` captures more graphs in the same session (the engine
        passes :func:`pitstop.runner.verify_graphs.capture_verify_graphs` with speculation).
        """
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager:
            return
        if not self.kernels.cuda_graph_safe(self.model_config.head_size):
            log.info(
                "CUDA graphs off: kernel set %r is not graph-safe; decode runs eagerly", cfg.kernels
            )
            return

        def capture_extra() -> DecodeGraphs | None:  # extra's graphs (set on this runner)
            assert extra is not None
            extra(self)
            return self.verify_graphs

        self.graphs, self.mixed_graphs = capture_graphs(
            self.forward_parts(),
            cfg.max_batch_size,
            self.step_token_budget,
            capture_extra if extra is not None else None,
            cfg.piecewise_max_tokens,
        )

    def forward_parts(self) -> ForwardParts:
        """What the graphs' forward reads of this runner (after :meth:`init_kv_cache`)."""
        assert self.kv_cache is not None and self.config.max_model_len is not None
        return ForwardParts(
            model=self.model,
            model_config=self.model_config,
            rotary=self.rotary,
            kv_cache=self.kv_cache,
            page_size=self.page_size,
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.config.max_model_len,
            poison=self.poison,
            last_sampled=self.sampling.last_sampled,
            pending_row=self._pending_row,
        )

    def mixed_step_tokens(self) -> int:
        """The largest prefill/mixed step to capture piecewise: the step budget, at most
        ``piecewise_max_tokens``."""
        return mixed_step_tokens(self.step_token_budget, self.config.piecewise_max_tokens)

    # ------------------------------------------------------------------ samples
    def save_samples(self) -> tuple[torch.Tensor, dict[int, int]]:
        """A copy of the last launched step's samples (to rerun parts of a failed step)."""
        return self.sampling.save()

    def restore_samples(self, saved: tuple[torch.Tensor, dict[int, int]]) -> None:
        """Put back what :meth:`save_samples` copied."""
        self.sampling.restore(saved)

    def adopt_samples(self, sampled: Seq[tuple[int, int]]) -> None:
        """Make ``(seq_id, token)`` pairs the last step's samples (after a step was rerun in parts)."""
        self.sampling.adopt(sampled)

    def _pending_row(self, seq_id: int) -> int:
        """The row of ``seq_id`` in the last launched step's samples (its pending token's value)."""
        return self.sampling.pending_row(seq_id)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator | None:
        """A seeded sequence's generator (None: the sampler's shared randomness)."""
        return self.sampling.generator(seq_id, params)

    # ------------------------------------------------------------------ one step
    def build_metadata(
        self, seqs: Seq[SeqInput]
    ) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten a step into input ids, attention metadata and the rows to sample."""
        return build_metadata(
            seqs, self.page_size, self.device, self.last_sampled, self._pending_row
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step and wait for its tokens (:meth:`launch`, then its result)."""
        return self.launch(step).result()

    @torch.inference_mode()
    def launch(self, step: StepInput) -> LaunchedStep:
        """Queue one step on the device: forward, logits, sampling, and the copy of the tokens back.

        Returns without waiting for the device; the handle is the step in
        flight. A step that verifies speculative drafts is verified on the
        device too (replaying a verification graph when one fits). Pending
        input tokens are read from the previous launched step's samples, on
        the device. The step ends through :attr:`peers`.
        """
        self.forget_sequences(step.finished_seq_ids)
        self.forget_block_tables(step.reset_seq_ids)
        self.poison_pages(step.poison_pages)
        seqs = step.seqs
        if not seqs:
            return LaunchedStep([], ready=StepOutput([]))
        assert self.kv_cache is not None, "init_kv_cache() first"
        if self.adapters is not None:  # each row's adapter slot, where the projections read it
            self.adapters.prepare(seqs)
        verifies = any(s.num_logits > 1 for s in seqs)
        wants_prompt = any(s.prompt_targets for s in seqs)
        graphs = self.verify_graphs
        if verifies and not wants_prompt and graphs is not None and graphs.can_run(seqs):
            logits, rows = graphs.run(seqs)
            return self.peers.conclude(
                seqs, True, lambda: self._verify(seqs, self.select_rows(logits, rows))
            )
        hidden, rows, starts = self.forward(seqs)
        prompt = None
        if wants_prompt:
            prompt_logprobs = SamplerBase.of(self.sampler, "prompt_logprobs")
            prompt = prompt_logprobs(seqs, hidden, starts, self.model.compute_logits)
        if not rows:
            self.sampling.last_rows = {}
            return LaunchedStep(seqs, ready=StepOutput([NO_TOKENS] * len(seqs)), prompt=prompt)
        logits = self.model.compute_logits(self.select_rows(hidden, rows))
        # before sampling: logits processors may write into the rows
        nan_rows = nan_rows_of(logits) if self.poison else None
        if self.logits_observer is not None:
            self.logits_observer(seqs, logits)
        if verifies:
            return self.peers.conclude(
                seqs, True, lambda: self._verify(seqs, logits, observe=False)
            )
        return self.peers.conclude(
            seqs,
            False,
            lambda: self.sampling.sample(
                seqs, logits, self._generator, self.peers, prompt=prompt, nan_rows=nan_rows
            ),
        )

    def _verify(
        self, seqs: list[SeqInput], logits: torch.Tensor, *, observe: bool = True
    ) -> LaunchedStep:
        """Verify the step's drafts on the device (``observe``: show the observer the logits first)."""
        if observe and self.logits_observer is not None:
            self.logits_observer(seqs, logits)
        return self.sampling.verify(seqs, logits, self._generator)

    def forward(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, list[int], list[int]]:
        """The model over one step (a decode graph, piecewise graphs, or eagerly).

        Returns the hidden states, the rows to sample and each sequence's first row.
        """
        if self.graphs is not None and self.graphs.can_run(seqs):
            hidden, rows = self.graphs.run(seqs)
            return hidden, rows, list(range(len(seqs)))  # one token each
        input_ids, meta, rows = self.build_metadata(seqs)
        starts = np.cumsum([0] + [len(s.token_ids) for s in seqs[:-1]]).tolist()
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(input_ids.shape[0]):
            return self.mixed_graphs.run(input_ids, meta), rows, starts
        return self.model(input_ids, self.rotary, self.kv_cache, meta), rows, starts

    def select_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The hidden rows to turn into logits, without waiting for the GPU (:func:`select_rows`)."""
        return select_rows(hidden, rows, self.device)
