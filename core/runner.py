"""The model runner: owns the weights and the KV cache, runs one step, samples.

The engine talks to it through plain data only (:class:`StepInput` in,
:class:`StepOutput` out), so that a later version can run one runner per GPU
under ``torch.distributed`` and broadcast the same input to each.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import attrs
import torch

from pitstop.attention import AttentionMetadata
from pitstop.config import EngineConfig
from pitstop.errors import ConfigError
from pitstop.model import rotary_cache
from pitstop.model_config import ModelConfig
from pitstop.plugin_manager import PluginManager
from pitstop.sampling import make_generator, make_sampling_batch
from pitstop.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; a CUDA name without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but this machine has no CUDA device; use device='cpu'")
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


@attrs.frozen
class StepInput:
    """One step: prefill sequences (more than one token) first, then decodes."""

    seqs: list[SeqInput]
    finished_seq_ids: list[int] = attrs.Factory(list)


@attrs.frozen
class StepOutput:
    """Sampled tokens, one per sequence with ``sample`` set, in input order."""

    token_ids: list[int]
    logprobs: list[float] | None = None


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
        return mc.kv_bytes_per_token * self.page_size * torch.tensor([], dtype=self.dtype).element_size()

    def plan_num_pages(self) -> int:
        """How many pages the KV cache gets: ``max_num_pages``, a GiB budget, or free GPU memory."""
        per_page = self.bytes_per_page()
        cfg = self.config
        if self.device.type != "cuda":
            if cfg.max_num_pages is not None:
                return cfg.max_num_pages
            return max(1, int((cfg.kv_cache_gib or 1.0) * 2**30) // per_page)
        if cfg.kv_cache_gib is not None and cfg.max_num_pages is None:
            return max(1, int(cfg.kv_cache_gib * 2**30) // per_page)
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
            SeqInput(i, [0] * per_seq, 0, list(range(i * pages, (i + 1) * pages)), True, SamplingParams())
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

    # ------------------------------------------------------------------ one step
    def build_metadata(self, seqs: Seq[SeqInput]) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten a step into input ids, attention metadata and the rows to sample."""
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        ctx_lens: list[int] = []
        q_lens: list[int] = []
        sample_rows: list[int] = []
        num_prefills = num_prefill_tokens = 0
        for s in seqs:
            n = len(s.token_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            table = s.block_table
            slots.extend(table[p // ps] * ps + p % ps for p in pos)
            cu.append(cu[-1] + n)
            ctx_lens.append(s.start_pos + n)
            q_lens.append(n)
            if n > 1:
                num_prefills += 1
                num_prefill_tokens += n
            if s.sample:
                sample_rows.append(cu[-1] - 1)
        width = max((len(s.block_table) for s in seqs), default=0)
        tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
        dev = self.device
        pin = dev.type == "cuda"

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype, pin_memory=pin).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(tables, torch.int32) if tables else torch.empty(0, 0, dtype=torch.int32, device=dev),
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
        input_ids, meta, rows = self.build_metadata(step.seqs)
        hidden = self.model(input_ids, self.rotary, self.kv_cache, meta)
        if not rows:
            return StepOutput([])
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        sampling = [s for s in step.seqs if s.sample]
        params = [s.params or SamplingParams() for s in sampling]
        generators = [self._generator(s.seq_id, p) for s, p in zip(sampling, params, strict=True)]
        batch = make_sampling_batch(params, generators, self.device)
        out = self.sampler.sample(logits, batch)
        tokens = out.token_ids.tolist()  # the step's one device-to-host copy
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        return StepOutput(tokens, logprobs)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = self._generators[seq_id] = make_generator(params.seed, self.device)
        return gen
