"""What runs the requests: pitstop's engine, or the ``transformers`` peer, behind one interface.

A backend takes requests (:meth:`submit`), does work and hands back the
requests that finished (:meth:`poll`), and reports what its cache did during a
run (:meth:`run_stats`). The drivers in :mod:`pitstop.bench.drivers` only talk
to this interface, so pitstop and its peer see the very same clients.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Protocol

from pitstop.bench.report import RequestRecord, record_from_output
from pitstop.bench.workloads import BenchRequest, Workload

log = logging.getLogger(__name__)


class Backend(Protocol):
    """One engine under test."""

    name: str

    def submit(self, request_id: str, request: BenchRequest, arrival: float) -> None:
        """Queue a request that arrived at ``arrival`` (``perf_counter`` seconds)."""
        ...

    def poll(self, timeout: float = 0.0) -> list[RequestRecord]:
        """Do some work (or wait at most ``timeout`` s for it); return the requests that finished."""
        ...

    def has_work(self) -> bool:
        """Whether a submitted request has not finished yet."""
        ...

    def begin_run(self) -> None:
        """Mark the start of a timed run (statistics count from here)."""
        ...

    def run_stats(self) -> dict[str, Any]:
        """KV utilization, prefix hit rate and preemptions since :meth:`begin_run` (None if unknown)."""
        ...

    def close(self) -> None:
        """Free the model and its memory."""
        ...


def release_memory() -> None:
    """Collect garbage and hand cached GPU memory back, between configurations."""
    gc.collect()
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- pitstop
class PitstopBackend:
    """pitstop's :class:`~pitstop.loop.engine.LLMEngine`, stepped in this thread."""

    def __init__(
        self, config: Any, workload: Workload, lora_requests: list[Any] | None = None
    ) -> None:
        """``lora_requests``: adapters given to the submitted requests in turn (none: base model)."""
        from pitstop.loop.engine import LLMEngine

        self.name = "pitstop"
        self.engine: Any = LLMEngine(config)
        self.workload = workload
        self.lora_requests = list(lora_requests or [])
        self._submitted = 0
        self._base: tuple[int, float, int, int, int] = (0, 0.0, 0, 0, 0)

    def weight_bytes(self) -> int:
        """Device bytes of the weights the engine holds, as its weight format holds them
        (0 under tensor parallelism: the floor then counts dense bytes)."""
        if self.engine.config.tensor_parallel_size > 1:
            return 0
        return self.engine.runner.weight_bytes()

    def _params(self, request: BenchRequest) -> Any:
        from pitstop.entrypoints.sampling_params import SamplingParams

        return SamplingParams(
            max_tokens=request.output_len,
            ignore_eos=True,
            temperature=self.workload.temperature,
            top_k=self.workload.top_k,
        )

    def submit(self, request_id: str, request: BenchRequest, arrival: float) -> None:
        lora = None
        if self.lora_requests:
            lora = self.lora_requests[self._submitted % len(self.lora_requests)]
        self._submitted += 1
        self.engine.add_request(
            request.prompt,
            self._params(request),
            prompt_token_ids=request.prompt_token_ids,
            request_id=request_id,
            arrival_time=arrival,
            lora_request=lora,
        )

    def poll(self, timeout: float = 0.0) -> list[RequestRecord]:
        if not self.engine.has_unfinished_requests():
            if timeout > 0:
                time.sleep(timeout)
            return []
        return [record_from_output(o) for o in self.engine.step(stream=False)]

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _snapshot(self) -> tuple[int, float, int, int, int, int, int, int, int]:
        s = self.engine.stats
        a = self.engine.allocator.stats()
        return (
            s.steps,
            s.utilization_sum,
            s.preemptions,
            a.prefix_queried_tokens,
            a.prefix_hit_tokens,
            s.spec_verifications,
            s.spec_proposed_tokens,
            s.spec_accepted_tokens,
            s.spec_steps,
        )

    def begin_run(self) -> None:
        self._base = self._snapshot()
        self._base_counters = dict(self.engine.allocator.stats().counters)

    def run_stats(self) -> dict[str, Any]:
        steps, util, pre, queried, hits, verifies, proposed, accepted, spec_steps = (
            b - a for a, b in zip(self._base, self._snapshot(), strict=True)
        )
        counters = self.engine.allocator.stats().counters
        stats: dict[str, Any] = {
            "kv_utilization": util / steps if steps else None,
            "prefix_hit_rate": hits / queried if queried else None,
            "preemptions": int(pre),
            "allocator_counters": {
                name: value - self._base_counters.get(name, 0.0) for name, value in counters.items()
            }
            or None,
        }
        if self.engine.config.speculative is not None:
            stats["spec_acceptance_rate"] = accepted / proposed if proposed else None
            stats["spec_mean_accepted"] = accepted / verifies if verifies else None
            stats["spec_step_share"] = spec_steps / steps if steps else None
        return stats

    def close(self) -> None:
        self.engine.close()  # tensor parallelism: the workers stop before the next engine starts
        del self.engine
        release_memory()


# ---------------------------------------------------------------------- transformers
_HF_CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
}


def hf_config_from_model_config(mc: Any) -> Any:
    """A ``transformers`` config of the same shape as a pitstop :class:`ModelConfig`."""
    import transformers

    from pitstop.bench.vllm_model import hf_shape_fields

    cls = getattr(transformers, _HF_CONFIG_CLASSES[mc.architecture])
    kwargs: dict[str, Any] = {
        **hf_shape_fields(mc),
        "eos_token_id": list(mc.eos_token_ids) or None,
    }
    rope = {"rope_type": "default", "rope_theta": mc.rope_theta}
    if mc.rope_scaling:
        rope = {**mc.rope_scaling, "rope_theta": mc.rope_theta}
    kwargs["rope_parameters"] = rope
    return cls(**kwargs)


def load_peer_model(model: str, device: str, dtype: str) -> Any:
    """The ``transformers`` model of the same weights (same shape, for a dummy preset)."""
    from pathlib import Path

    import torch
    import transformers

    from pitstop.loading.weights import load_model_source
    from pitstop.plugins.model_sources.gguf.source import SMOLLM2_NAME, smollm2_path
    from pitstop.runner.model_runner import resolve_dtype

    common = {"dtype": resolve_dtype(dtype, torch.device(device)), "attn_implementation": "sdpa"}
    if model.startswith("dummy:"):
        cfg = hf_config_from_model_config(load_model_source(model).model_config)
        with torch.device(device):
            net = transformers.AutoModelForCausalLM.from_config(cfg, **common)
    else:
        path = smollm2_path() if model == SMOLLM2_NAME else Path(model).expanduser()
        if path.is_file():  # a GGUF: transformers dequantizes it itself
            net = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, **common
            )
        else:
            net = transformers.AutoModelForCausalLM.from_pretrained(str(path), **common)
        net = net.to(device)
    return net.eval()


class TransformersBackend:
    """``transformers``' continuous batching (``ContinuousBatchingManager``) on its own thread."""

    def __init__(
        self, model: str, device: str, dtype: str, workload: Workload, max_model_len: int
    ) -> None:
        import transformers

        self.name = "transformers"
        self.workload = workload
        self.model = load_peer_model(model, device, dtype)
        sample = workload.temperature > 0
        gen = transformers.GenerationConfig(
            do_sample=sample,
            temperature=workload.temperature if sample else None,
            top_k=workload.top_k if sample and workload.top_k > 0 else None,
            max_new_tokens=max(r.output_len for r in workload.requests),
            eos_token_id=-1,  # ignore EOS: every request produces exactly its length
            pad_token_id=0,
        )
        self._cm = self.model.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=5
        )
        self.manager = self._cm.__enter__()
        self._pending: dict[str, tuple[float, BenchRequest]] = {}

    def submit(self, request_id: str, request: BenchRequest, arrival: float) -> None:
        if request.prompt_token_ids is None:
            raise ValueError("the transformers peer takes token ids; tokenize text prompts first")
        self._pending[request_id] = (arrival, request)
        self.manager.add_request(
            list(request.prompt_token_ids),
            request_id=request_id,
            max_new_tokens=request.output_len,
            record_timestamps=True,
            eos_token_id=-1,
        )

    def poll(self, timeout: float = 0.0) -> list[RequestRecord]:
        done: list[RequestRecord] = []
        result = self.manager.get_result(timeout=max(timeout, 0.01))
        while result is not None:
            if result.is_finished() and result.request_id in self._pending:
                arrival, req = self._pending.pop(result.request_id)
                if result.error is not None:
                    raise RuntimeError(
                        f"transformers failed request {result.request_id}: {result.error}"
                    )
                times = tuple(result.timestamps or ())
                done.append(
                    RequestRecord(
                        request_id=result.request_id,
                        input_len=req.input_len,
                        output_len=len(result.generated_tokens),
                        arrival=arrival,
                        first_token=times[0] if times else None,
                        finish=times[-1] if times else None,
                        token_times=times,
                    )
                )
            if not self.manager.is_running():
                raise RuntimeError("the transformers continuous-batching thread stopped")
            result = self.manager.get_result(timeout=0)
        return done

    def has_work(self) -> bool:
        return bool(self._pending)

    def begin_run(self) -> None:
        pass

    def run_stats(self) -> dict[str, Any]:
        return {
            "kv_utilization": None,
            "prefix_hit_rate": None,
            "preemptions": None,
            "per_request_counters": False,
        }

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
        del self.manager, self.model
        release_memory()
