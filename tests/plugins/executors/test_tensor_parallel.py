"""Tensor parallelism on the CPU over gloo: 2 or 3 spawned ranks against one (issue 17).

The multi-process tests each start worker processes (a few seconds each on a
busy 2-core machine); they share tiny checkpoints and few prompts and tokens.
The unit tests at the bottom check the sharding itself in this process.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import attrs
import pytest
import torch
from helpers.checkpoints import relative_error
from helpers.models import make_tiny_checkpoint, smollm2_gguf

from pitstop.config import EngineConfig
from pitstop.entrypoints.llm import LLM
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.errors import ConfigError, WorkerDiedError
from pitstop.ground.model_config import ModelConfig
from pitstop.plugin_system.executor import ExecutorContext
from pitstop.plugins.executors.tensor_parallel.sharding import (
    WeightShard,
    check_tensor_parallel_size,
    shard_model_config,
)


@pytest.fixture(autouse=True)
def _without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks run the kernel sets' PyTorch ops on the CPU, as when this file runs alone:
    other test modules set ``TRITON_INTERPRET=1`` when imported, which would send the fused
    set (and every spawned rank, which inherits the environment) through Triton's interpreter."""
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 57))]


def greedy_with_logits(llm: LLM, prompts, params=GREEDY):
    """Greedy token ids per prompt, and every step's logits as rank 0 saw them (gathered)."""
    model = llm.engine.runner.model
    original = model.compute_logits
    seen: list[torch.Tensor] = []

    def tap(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        seen.append(logits.clone())
        return logits

    model.compute_logits = tap
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del model.compute_logits
    return [o.token_ids for o in outs], seen


def assert_tp_matches_tp1(folder: Path, size: int, **settings) -> None:
    settings = dict(device="cpu", kv_cache_gib=0.01, max_model_len=96, **settings)
    one = LLM(str(folder), **settings)
    want_ids, want_logits = greedy_with_logits(one, PROMPTS)
    with LLM(str(folder), tensor_parallel_size=size, **settings) as split:
        got_ids, got_logits = greedy_with_logits(split, PROMPTS)
    assert got_ids == want_ids
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits, strict=True):
        assert got.shape == want.shape
        assert relative_error(got, want) < 1e-5


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    # biases on every projection (o_proj's and down_proj's are added once, by rank 0), and a
    # vocabulary that does not divide by 2 (the last rank's part is padded)
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tp"),
        "llama",
        with_tokenizer=False,
        vocab_size=1001,
        attention_bias=True,
        mlp_bias=True,
    )


def test_llama_tp2_logits_and_greedy_equal_tp1(tiny_llama):
    # overlap on: the next step's pending tokens come from rank 0's broadcast samples
    assert_tp_matches_tp1(tiny_llama, 2, overlap="on")


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_tp2_speculation_equals_plain_tp1_greedy(tiny_llama, speculative):
    # rank 0 verifies on its device; the workers only run the forward (with the drafts as host
    # ids, for a draft model's drafts that are still on rank 0's device) and keep nothing pending
    settings = dict(device="cpu", kv_cache_gib=0.01, max_model_len=96)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7], [11, 12, 13, 11, 12, 13], list(range(20, 40)) * 2]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [
        o.token_ids
        for o in LLM(str(tiny_llama), **settings).generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
        )
    ]
    spec = dict(speculative=speculative, num_speculative_tokens=3)
    if speculative == "draft":
        spec["speculative_model"] = str(tiny_llama)
    with LLM(str(tiny_llama), tensor_parallel_size=2, **settings, **spec) as split:
        outs = split.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = split.engine.stats
    assert [o.token_ids for o in outs] == want
    assert stats.spec_proposed_tokens > 0
    if speculative == "draft":
        assert stats.spec_acceptance_rate == 1.0  # the model drafts for itself


def test_qwen3_tp2_with_replicated_kv_head_equals_tp1(tmp_path):
    # one KV head, two ranks: each rank holds a copy of it; tied embedding and head; the
    # fused set (on the CPU: its merged projections, PyTorch ops)
    folder = make_tiny_checkpoint(
        tmp_path,
        "qwen3",
        with_tokenizer=False,
        vocab_size=640,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    assert_tp_matches_tp1(folder, 2, kernels="fused")  # merged QKV and gate-up, sharded


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        # layer 0 a dense SwiGLU among sparse ones, top-3 of 6 experts renormalized
        (
            "qwen3_moe",
            dict(
                num_hidden_layers=3,
                mlp_only_layers=[0],
                num_experts=6,
                num_experts_per_tok=3,
                norm_topk_prob=True,
            ),
        ),
        # a shared expert beside the routed ones, its part in the block's one all-reduce
        ("qwen2_moe", dict(num_hidden_layers=2)),
    ],
)
def test_mixture_of_experts_tp2_equals_tp1(tmp_path, arch, overrides):
    # every rank holds every expert, cut by its intermediate rows; the router is whole
    folder = make_tiny_checkpoint(tmp_path, arch, with_tokenizer=False, vocab_size=640, **overrides)
    assert_tp_matches_tp1(folder, 2)


def test_smollm2_tp3_greedy_equals_tp1():
    path = str(smollm2_gguf())  # 9 query heads, 3 KV heads: one KV head per rank
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    settings = dict(device="cpu", kv_cache_gib=0.02, max_model_len=64)
    want = [o.token_ids for o in LLM(path, **settings).generate(prompts, params, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=3, **settings) as split:
        got = [o.token_ids for o in split.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_a_request_failing_on_rank_0_fails_alone_and_the_workers_stay_in_step(tiny_llama):
    # rank 0 samples, so a per-request fault there (here: a poisoned seed) is isolated as at
    # tp=1, while the workers keep meeting rank 0's collectives (the step's reruns included)
    poison = 4242
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in PROMPTS]
    settings = dict(device="cpu", kv_cache_gib=0.01, max_model_len=96, overlap="on")
    clean = LLM(str(tiny_llama), **settings).generate(
        prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False
    )
    params[1] = SamplingParams(temperature=0.7, seed=poison, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_llama), tensor_parallel_size=2, **settings) as llm:
        rank0 = llm.engine.runner.runner
        original = rank0._generator

        def generator(seq_id, p):
            if p.seed == poison:
                raise ValueError("poisoned request")
            return original(seq_id, p)

        rank0._generator = generator
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        assert outs[1].finish_reason == "error" and "poisoned" in (outs[1].error or "")
        for i in (0, 2):
            assert outs[i].token_ids == clean[i].token_ids
        del rank0._generator
        again = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params[0])
        assert again[0].token_ids == clean[0].token_ids  # the workers are still in step
        stats = llm.engine.allocator.stats()
        assert stats.pages_free == stats.num_pages


def test_rank_0_failing_between_collectives_stops_the_engine(tiny_llama):
    # the workers are then inside a collective rank 0 never reaches: isolating the request
    # would pair the wrong collectives, so the engine stops instead
    with LLM(str(tiny_llama), device="cpu", kv_cache_gib=0.01, tensor_parallel_size=2) as llm:
        model = llm.engine.runner.model

        def broken(hidden):
            raise RuntimeError("out of memory on rank 0 only")

        model.compute_logits = broken
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 0 failed inside the step's collectives"):
            llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert not llm.engine.runner.watch.workers[0].is_alive()


_TORCHRUN_SCRIPT = """
import sys
from pitstop import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", kv_cache_gib=0.01, max_model_len=96, tensor_parallel_size=2)
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outs = llm.generate(prompt_token_ids=%r, sampling_params=params, use_tqdm=False)
print("TOKENS", [o.token_ids for o in outs])
llm.close()
"""


def test_the_same_code_runs_under_torchrun(tiny_llama, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "tp_script.py"
    script.write_text(_TORCHRUN_SCRIPT % (PROMPTS,))
    from pitstop.plugins.executors.tensor_parallel.launch import _free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(script),
            str(tiny_llama),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1  # only rank 0 runs the engine; rank 1 served it and exited
    want, _ = greedy_with_logits(
        LLM(str(tiny_llama), device="cpu", kv_cache_gib=0.01, max_model_len=96), PROMPTS
    )
    assert lines[0] == f"TOKENS {want}"


def test_killed_worker_stops_the_engine_naming_its_rank(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_gib=0.01, tensor_parallel_size=2)
    try:
        engine = llm.engine
        engine.add_request(
            prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=50, ignore_eos=True)
        )
        engine.step()
        engine.step()
        os.kill(engine.runner.watch.workers[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1 died .*SIGKILL"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerDiedError, match="closed"):  # no step runs on a broken engine
            engine.step()
    finally:
        llm.close()


def one_rank_engine(monkeypatch, folder_or_model: str, **settings) -> LLM:
    """An engine whose runner goes through the tensor-parallel path with a world of one rank
    (this process): the groups, the wrapped kernel set, rank 0's runner, every collective."""
    import pitstop.loop.engine
    from pitstop.plugins.executors.tensor_parallel.launch import _spawn

    def runner(config, mc, plugins, device, dtype, *, resolved, memory_region=None):
        # rank 0's runner and the worker get the config as the engine resolved it
        return _spawn(ExecutorContext(config, mc, plugins, device, dtype, None, resolved))

    monkeypatch.setattr(pitstop.loop.engine, "ModelRunner", runner)
    llm = LLM(folder_or_model, **settings)
    monkeypatch.undo()
    return llm


def assert_one_rank_path_matches(monkeypatch, model: str, **settings) -> LLM:
    want_ids, want_logits = greedy_with_logits(LLM(model, **settings), PROMPTS)
    with one_rank_engine(monkeypatch, model, **settings) as llm:
        assert type(llm.engine.runner).__name__ == "TensorParallelRunner"
        got_ids, got_logits = greedy_with_logits(llm, PROMPTS)
        assert got_ids == want_ids
        for got, want in zip(got_logits, want_logits, strict=True):
            assert relative_error(got, want) < 1e-5
    return llm


def test_the_tensor_parallel_path_with_one_gloo_rank_equals_the_plain_runner(
    monkeypatch, tiny_llama
):
    assert_one_rank_path_matches(
        monkeypatch, str(tiny_llama), device="cpu", kv_cache_gib=0.01, max_model_len=96
    )


@pytest.mark.gpu
def test_nccl_all_reduce_inside_cuda_graphs_with_one_rank(monkeypatch, tmp_path):
    # one GPU cannot hold two NCCL ranks; this runs the NCCL collectives, captured in the
    # decode and piecewise CUDA graphs, on a world of one and checks nothing changes (the
    # tiny Qwen3 of tests/core/runner/test_gpu_engine.py: a head size the Triton kernels take)
    folder = make_tiny_checkpoint(
        tmp_path, "qwen3", with_tokenizer=False, num_hidden_layers=3, head_dim=64
    )
    llm = assert_one_rank_path_matches(
        monkeypatch,
        str(folder),
        device="cuda",
        dtype="float32",
        kv_cache_gib=0.05,
        max_model_len=96,
        overlap="on",
    )
    assert llm.engine.runner.graphs is not None
    assert llm.engine.runner.mixed_graphs is not None


def test_the_watch_thread_reports_a_dead_worker_once():
    # on CUDA this thread aborts NCCL's collectives when a worker dies (NCCL would wait)
    import multiprocessing
    import threading

    from pitstop.plugins.executors.tensor_parallel.watch import WorkerWatch

    ctx = multiprocessing.get_context("spawn")
    worker = ctx.Process(target=os._exit, args=(3,))
    worker.start()
    watch = WorkerWatch([worker], ctx.Queue())
    seen: list[str] = []
    called = threading.Event()
    watch.watch_in_background(lambda problem: (seen.append(problem), called.set()), period=0.05)
    assert called.wait(30)
    time.sleep(0.2)
    assert seen == ["tensor-parallel worker rank 1 died (exit code 3)"]
    watch.stop()


# ---------------------------------------------------------------------- in this process
def test_a_worker_placing_an_adapter_ahead_logs_a_failure_and_serves_on(caplog):
    # rank 0 sends `place_adapter` without waiting (its own check passed); a worker whose
    # read fails leaves the adapter to the step that runs it and keeps serving calls
    from pitstop.plugins.executors.tensor_parallel.worker import serve_calls

    asked: list[tuple[str, object]] = []

    class Slots:
        def check(self, request):
            asked.append(("check", request))
            if request == "gone":
                raise FileNotFoundError(request)

        def ready(self, request, busy):
            asked.append(("ready", (request, busy)))
            return False

    class Runner:
        adapters = Slots()

    class Group:
        calls = [("place_adapter", ("a", [3, 1])), ("place_adapter", ("gone", [])), ("stop", ())]

        def receive_call(self):
            return self.calls.pop(0)

    serve_calls(Runner(), Group(), weights=None)
    assert asked == [("check", "a"), ("ready", ("a", {1, 3})), ("check", "gone")]
    assert "placing adapter 'gone' ahead of its step failed" in caplog.text


def _config(**changes) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_size=8,
    )
    return ModelConfig(**(base | changes))


def test_sizes_a_model_does_not_split_into_are_refused_with_the_ones_that_work():
    smol = _config(num_heads=9, num_kv_heads=3, intermediate_size=1536)
    with pytest.raises(
        ConfigError, match=r"9 query heads do not divide by 2.*sizes that work: 1, 3$"
    ):
        check_tensor_parallel_size(smol, 2)
    with pytest.raises(ConfigError, match="KV heads"):
        check_tensor_parallel_size(_config(num_heads=12, num_kv_heads=4, intermediate_size=48), 6)
    with pytest.raises(ConfigError, match="intermediate size 48 does not divide by 5"):
        check_tensor_parallel_size(_config(num_heads=10, num_kv_heads=5), 5)
    part = shard_model_config(_config(), 2)
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size, part.vocab_size) == (
        3,
        1,
        24,
        51,
    )
    assert shard_model_config(_config(), 6).num_kv_heads == 1  # two KV heads, replicated


def test_an_engine_of_a_size_the_model_does_not_split_into_starts_nothing():
    import multiprocessing

    with pytest.raises(
        ConfigError, match="9 query heads do not divide by 2.*sizes that work: 1, 3"
    ):
        LLM(str(smollm2_gguf()), device="cpu", kv_cache_gib=0.01, tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def test_config_refuses_bad_tensor_parallel_settings():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)
    with pytest.raises(ConfigError, match="cuda:r"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1")


def test_more_ranks_than_gpus_is_refused_before_anything_starts(monkeypatch):
    from pitstop.plugins.executors.tensor_parallel.launch import start_tensor_parallel

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig(tensor_parallel_size=2)
    context = ExecutorContext(config, _config(), None, torch.device("cuda"), None, None, None)
    with pytest.raises(ConfigError, match="needs 2 GPUs on this machine, it has 1"):
        start_tensor_parallel(context)


def test_reading_a_shard_from_safetensors_equals_cutting_the_whole_tensor(tiny_llama):
    from pitstop.plugins.model_sources.huggingface.checkpoint import read_hf_config
    from pitstop.plugins.model_sources.huggingface.safetensors import (
        iter_safetensors,
        read_safetensors_headers,
    )

    entries = read_safetensors_headers(sorted(tiny_llama.glob("*.safetensors")))
    cfg = read_hf_config(tiny_llama)
    whole = dict(iter_safetensors(entries))
    for rank in range(2):
        shard = WeightShard(cfg, rank, 2)
        parts = dict(iter_safetensors(entries, shard))
        assert parts.keys() == whole.keys()
        for name, tensor in whole.items():
            assert torch.equal(parts[name], shard.take(name, tensor)), name


@pytest.mark.parametrize(("size", "kv_heads"), [(2, 2), (3, 3), (6, 2)])
def test_the_ranks_parts_put_together_are_the_whole_model(size, kv_heads):
    from pitstop.model import dummy_weights, expected_weight_shapes

    cfg = _config(num_kv_heads=kv_heads, attention_bias=True, o_proj_bias=True, mlp_bias=True)
    whole = dict(dummy_weights(expected_weight_shapes(cfg), 0, torch.device("cpu"), torch.float32))
    shards = [WeightShard(cfg, rank, size) for rank in range(size)]
    local = shard_model_config(cfg, size)
    local_shapes = expected_weight_shapes(local)
    for name, tensor in whole.items():
        parts = [s.take(name, tensor) for s in shards]
        assert all(tuple(p.shape) == local_shapes[name] for p in parts), name
        region = shards[0].region(name, tensor.shape)
        if name.endswith(("o_proj.bias", "down_proj.bias")):  # added once: rank 0 holds it
            assert torch.equal(parts[0], tensor) and all(not p.any() for p in parts[1:])
        elif region is None:
            assert all(torch.equal(p, tensor) for p in parts), name
        elif ".k_proj." in name or ".v_proj." in name:
            heads = [p.reshape(local.num_kv_heads, -1, *p.shape[1:]) for p in parts]
            full = tensor.reshape(cfg.num_kv_heads, -1, *tensor.shape[1:])
            for rank, h in enumerate(heads):  # rank r holds KV head(s) of its query heads
                first = rank * cfg.num_heads // size // (cfg.num_heads // cfg.num_kv_heads)
                assert torch.equal(h, full[first : first + local.num_kv_heads]), name
        else:
            joined = torch.cat(parts, dim=region.dim)
            assert torch.equal(joined.narrow(region.dim, 0, tensor.shape[region.dim]), tensor)
            assert not joined[tensor.shape[0] :].any()  # vocabulary padding is zeros


def test_each_expert_is_cut_by_its_intermediate_rows():
    from pitstop.model import dummy_weights
    from pitstop.plugins.models.moe_config import MoEModelConfig
    from pitstop.plugins.models.moe_weights import expected_moe_shapes

    base = attrs.asdict(_config(num_heads=4, num_kv_heads=2), recurse=False)
    for arch, shared in (("MixtralForCausalLM", None), ("Qwen2MoeForCausalLM", 12)):
        cfg = MoEModelConfig(
            **(base | dict(architecture=arch)),
            num_experts=3,
            num_experts_per_tok=2,
            moe_intermediate_size=20,
            norm_topk_prob=True,
            sparse_layers=(1,),
            shared_expert_intermediate_size=shared,
        )
        local = shard_model_config(cfg, 2)
        assert (local.moe_intermediate_size, local.intermediate_size) == (10, 24)
        assert local.shared_expert_intermediate_size == (None if shared is None else 6)
        whole = dict(dummy_weights(expected_moe_shapes(cfg), 0, torch.device("cpu"), torch.float32))
        local_shapes = expected_moe_shapes(local)
        shards = [WeightShard(cfg, rank, 2) for rank in range(2)]
        for name, tensor in whole.items():
            parts = [s.take(name, tensor) for s in shards]
            assert all(tuple(p.shape) == local_shapes[name] for p in parts), name
            region = shards[0].region(name, tensor.shape)
            if region is None:  # routers, gates, norms: whole on every rank
                assert all(torch.equal(p, tensor) for p in parts), name
            elif "embed" not in name and "lm_head" not in name:
                assert torch.equal(torch.cat(parts, dim=region.dim), tensor), name
    with pytest.raises(ConfigError, match="moe intermediate size 18 does not divide by 4"):
        check_tensor_parallel_size(attrs.evolve(cfg, moe_intermediate_size=18), 4)


class _OneRank:
    """What a rank's runner reads of its TensorParallelGroup before any collective runs."""

    def __init__(self, cfg: ModelConfig, rank: int, size: int) -> None:
        self.rank, self.size, self.model_config = rank, size, cfg
        self.device = torch.device("cpu")


def test_dummy_weights_are_the_same_values_whatever_the_size():
    from pitstop.plugin_system.plugin_manager import get_plugin_manager
    from pitstop.plugins.executors.tensor_parallel.rank import TensorParallelRank
    from pitstop.runner.model_runner import ModelRunner

    cfg = _config()
    config = EngineConfig(
        model="dummy:qwen3-0.6b", device="cpu", kernels="reference", max_model_len=32
    )
    cpu = torch.device("cpu")

    def runner(tp=None) -> ModelRunner:
        r = ModelRunner(config, cfg, get_plugin_manager(), cpu, torch.float32, parallel=tp)
        r.load_weights(None)
        return r

    whole = dict(runner().model.named_parameters())
    for rank in range(2):
        params = dict(runner(TensorParallelRank(_OneRank(cfg, rank, 2))).model.named_parameters())
        q = params["layers.0.self_attn.q_proj"]
        assert torch.equal(
            q, whole["layers.0.self_attn.q_proj"][rank * q.shape[0] : (rank + 1) * q.shape[0]]
        )
        down = params["layers.1.mlp.down_proj"]
        w = down.shape[1]
        assert torch.equal(down, whole["layers.1.mlp.down_proj"][:, rank * w : (rank + 1) * w])
        emb = params["embed_tokens"]
        rows = whole["embed_tokens"][rank * emb.shape[0] : (rank + 1) * emb.shape[0]]
        assert torch.equal(emb[: rows.shape[0]], rows)
