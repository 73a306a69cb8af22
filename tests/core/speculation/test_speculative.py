"""Speculative decoding: both proposers, the adaptation rule, and the allocator after rejections
(the verifier's own tests: tests/plugins/speculative/test_rejection.py)."""

from __future__ import annotations

import os

import pytest
import torch

from pitstop.entrypoints.engine_args import engine_config
from pitstop.plugin_system.plugin_manager import get_plugin_manager

if not torch.cuda.is_available():  # the fused kernels run through Triton's interpreter (CPU)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton
from helpers.models import make_tiny_checkpoint, smollm2_gguf

from pitstop import LLM, SamplingParams
from pitstop.requests.sequence import Sequence, SequenceStatus
from pitstop.speculation.speculative import draft_room

# Prompts with repetition, so that prompt lookup finds drafts; of mixed lengths.
PROMPTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Hello",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# ---------------------------------------------------------------- greedy equals plain decoding
@pytest.fixture(scope="module")
def plain_greedy() -> list[list[int]]:
    smollm2_gguf()
    llm = LLM("smollm2-135m", device="cpu", kv_cache_gib=0.25)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=3))


def _spec_greedy(**kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM("smollm2-135m", device="cpu", kv_cache_gib=0.25, **kwargs)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], llm


@pytest.mark.slow
def test_ngram_greedy_equals_plain(plain_greedy):
    # prefix + chunked (a small chunk mixes prompt chunks with verification steps)
    out, llm = _spec_greedy(
        speculative="ngram", allocator="prefix", scheduler="chunked", chunk_size=32
    )
    assert out == plain_greedy
    stats = llm.engine.stats
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0


@pytest.mark.slow
def test_draft_self_accepts_everything(plain_greedy):
    out, llm = _spec_greedy(speculative="draft", speculative_model="smollm2-135m")
    assert out == plain_greedy
    stats = llm.engine.stats
    assert stats.spec_proposed_tokens > 0
    assert stats.spec_acceptance_rate == 1.0
    assert not llm.engine.proposer._seqs  # every draft sequence was released
    assert llm.engine.proposer.allocator.stats().tokens_held == 0


@pytest.mark.slow
def test_tiny_draft_accepts_little_and_stays_exact(plain_greedy, tiny_draft):
    # preallocated + fcfs: truncation inside a reserved region, static batches
    out, llm = _spec_greedy(
        speculative="draft",
        speculative_model=tiny_draft,
        allocator="preallocated",
        scheduler="fcfs",
        max_model_len=256,
        num_speculative_tokens=3,
    )
    assert out == plain_greedy
    stats = llm.engine.stats
    assert stats.spec_proposed_tokens > 0
    assert stats.spec_acceptance_rate < 0.5


# ---------------------------------------------------------------- the n-gram proposer
def test_ngram_lookup_cases():
    from pitstop.plugins.speculative.ngram import lookup

    assert lookup([1, 2, 3, 4], k=3, max_n=3) == []  # no earlier occurrence of 4
    assert lookup([5], k=3, max_n=3) == []
    # the most recent occurrence of the suffix wins
    assert lookup([7, 1, 8, 8, 1, 9, 9, 1], k=2, max_n=1) == [9, 9]
    # a longer match wins over a more recent shorter one
    assert lookup([3, 1, 5, 6, 0, 1, 7, 3, 1], k=2, max_n=2) == [5, 6]
    assert lookup([3, 1, 5, 6, 0, 1, 7, 3, 1], k=2, max_n=1) == [7, 3]
    # min_n: a shorter match is not enough
    assert lookup([0, 1, 7, 3, 1], k=2, max_n=3, min_n=2) == []
    # proposals stop at the end of the sequence, overlapping matches allowed
    assert lookup([4, 4, 4], k=5, max_n=2) == [4]


def test_ngram_proposals_respect_max_tokens_and_max_model_len():
    from pitstop.plugins.speculative.ngram import NgramProposer

    config = engine_config(model="x", max_model_len=20, prompt_lookup_max=2)
    prop = NgramProposer(
        config, settings=get_plugin_manager().get("proposer", "ngram").read_settings(config)
    )
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    seq = Sequence("a", tokens, SamplingParams(max_tokens=100))
    assert prop.propose([seq], 4)[0].token_ids == [3, 4, 5, 6]
    seq = Sequence("b", tokens, SamplingParams(max_tokens=3))
    seq.token_ids += [3]  # one output token: 2 left, so at most one draft (plus the bonus)
    assert draft_room(seq, 4, 20) == 1
    assert prop.propose([seq], 4)[0].token_ids == [4]
    seq = Sequence("c", tokens * 2, SamplingParams(max_tokens=100))  # 18 of 20 tokens
    assert draft_room(seq, 4, 20) == 1
    assert len(prop.propose([seq], 4)[0].token_ids) == 1
    seq = Sequence("d", tokens * 2 + [3], SamplingParams(max_tokens=100))
    assert prop.propose([seq], 4)[0].token_ids == []


# ---------------------------------------------------------------- allocator state
@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=0))


def _run_checking_invariants(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> None:
    """Step the engine; after every step each running decoder holds exactly its computed tokens."""
    engine = llm.engine
    for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt_token_ids=ids, params=sp, request_id=f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.live_sequences().values():
            assert not seq.draft_token_ids
            if seq.status is SequenceStatus.RUNNING and not seq.is_prefill:
                # the invariant after a step (plain or verifying): held == computed == num_tokens - 1
                assert (
                    engine.allocator.num_held_tokens(seq)
                    == seq.num_computed_tokens
                    == seq.num_tokens - 1
                )
    stats = engine.allocator.stats()
    assert stats.tokens_held == 0
    assert stats.pages_free == stats.num_pages
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0


@pytest.mark.parametrize(
    ("allocator", "scheduler"),
    [
        ("paged", "continuous"),
        ("prefix", "chunked"),
        ("preallocated", "continuous"),
        ("paged", "fcfs"),
    ],
)
def test_allocator_state_after_many_accepts_and_rejects(tiny_target, allocator, scheduler):
    llm = LLM(
        tiny_target,
        device="cpu",
        allocator=allocator,
        scheduler=scheduler,
        speculative="ngram",
        num_speculative_tokens=5,
        page_size=4,
        max_num_pages=200,
        max_model_len=128,
        chunk_size=24,
        max_batch_size=6,
        max_prefill_batch=6,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(10):
        base = torch.randint(0, 200, (3 + i % 4,), generator=gen).tolist()
        prompts.append(base * (2 + i % 3))  # repetition: drafts to find
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 1.0, max_tokens=20 + 3 * i, ignore_eos=True, seed=i
        )
        for i in range(10)
    ]
    _run_checking_invariants(llm, prompts, params)
    stats = llm.engine.stats
    assert stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert stats.generation_tokens == sum(p.max_tokens for p in params)


@pytest.mark.slow
def test_draft_proposer_state_after_rejections(tiny_target, tiny_draft):
    llm = LLM(
        tiny_target,
        device="cpu",
        speculative="draft",
        speculative_model=tiny_draft,
        num_speculative_tokens=3,
        page_size=4,
        max_num_pages=120,
        max_model_len=128,
        max_batch_size=4,
        max_prefill_batch=4,
    )
    prompts = [[5, 6, 7, 8] * (1 + i) for i in range(6)]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=15, ignore_eos=True)
        for i in range(6)
    ]
    _run_checking_invariants(llm, prompts, params)
    proposer = llm.engine.proposer
    assert not proposer._seqs
    assert proposer.allocator.stats().tokens_held == 0
    assert proposer.allocator.stats().pages_free == proposer.allocator.num_pages


# ---------------------------------------------------------------- verification graphs' layout (CPU)
def _store_skipping_padding(kernels) -> None:
    """Give the reference kernels the fused kernels' contract: slot -1 stores nothing.

    The verification graphs pad each sequence to k + 1 query tokens with
    slot -1; on a GPU the fused ``rope_and_store`` skips those, and this lets
    the same static-buffer forward run eagerly on the CPU.
    """
    from pitstop.plugins.kernels.reference import apply_rotary, store_kv

    def rope_and_store(q, k, v, rotary, k_cache, v_cache, meta):
        cos = rotary.cos.index_select(0, meta.positions)
        sin = rotary.sin.index_select(0, meta.positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keep = meta.slot_mapping >= 0
        store_kv(k[keep], v[keep], k_cache, v_cache, meta.slot_mapping[keep])
        return q, k

    kernels.rope_and_store = rope_and_store


REPETITIVE = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [9], [3, 4] * 10, [20, 21, 22, 23, 24] * 3]


def _tiny_llm(target: str, **settings) -> LLM:
    base = {"device": "cpu", "max_model_len": 128, "max_num_pages": 120, "page_size": 4}
    return LLM(target, **(base | settings))


def _tiny_greedy(
    target: str, prompts, max_tokens: int = 25, **settings
) -> tuple[list[list[int]], LLM]:
    llm = _tiny_llm(target, **settings)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.allocator.stats().tokens_held == 0
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_verify_buffers_pad_each_sequence_and_keep_greedy_exact(tiny_target, proposer):
    from pitstop.runner.verify_graphs import VerifyGraphs

    prompts = REPETITIVE[:3]  # three sequences: the bucket of 4 pads one
    plain, _ = _tiny_greedy(tiny_target, prompts)
    k = 4
    # draft: the target drafts for itself, its drafts written into the buffers on the device
    extra = {"speculative_model": tiny_target} if proposer == "draft" else {}
    llm = _tiny_llm(
        tiny_target,
        speculative=proposer,
        num_speculative_tokens=k,
        speculative_min_accepted=0.0,  # keep speculating: every step verifies
        overlap="on",
        **extra,
    )
    runner = llm.engine.runner
    _store_skipping_padding(runner.kernels)
    graphs = VerifyGraphs(runner.forward_parts(), max_batch=4, num_query=k + 1, capture=False)
    assert graphs.sizes == [1, 2, 4]
    replays = []
    run = graphs.run
    graphs.run = lambda seqs: (replays.append(len(seqs)), run(seqs))[1]
    runner.verify_graphs = graphs
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    assert 3 in replays  # a batch of 3 ran in the bucket of 4
    stats = llm.engine.stats
    assert stats.spec_verifications > 0 and stats.spec_accepted_tokens > 0
    assert llm.engine.allocator.stats().tokens_held == 0


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton interpreter on the CPU (the GPU tests below run the compiled graphs)",
)
def test_verify_buffers_through_the_fused_kernels_keep_greedy_exact(tmp_path):
    """The graphs' forward (fused rope/store skipping slot -1, varlen attention over the padded
    rows) run eagerly through Triton's interpreter: what the GPU replays, minus the capture."""
    pytest.importorskip("triton")
    from pitstop.runner.verify_graphs import VerifyGraphs

    folder = make_tiny_checkpoint(
        tmp_path, "qwen3", with_tokenizer=False, num_hidden_layers=2, head_dim=64
    )
    prompts = REPETITIVE[:3]
    settings = {"dtype": "float32", "kernels": "fused", "page_size": 16}
    # every step runs through the interpreter: 12 tokens still verify all three rows at
    # once (the bucket of 4) six times, drafts accepted and rejected, across 16-token pages
    max_tokens = 12
    plain, _ = _tiny_greedy(str(folder), prompts, max_tokens, **settings)
    llm = _tiny_llm(str(folder), speculative="ngram", speculative_min_accepted=0.0, **settings)
    assert llm.engine.runner.kernels.describe()["attention"] == "triton"
    graphs = VerifyGraphs(
        llm.engine.runner.forward_parts(), max_batch=4, num_query=5, capture=False
    )
    replays = []
    run = graphs.run
    graphs.run = lambda seqs: (replays.append(len(seqs)), run(seqs))[1]
    llm.engine.runner.verify_graphs = graphs
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    assert 3 in replays and llm.engine.stats.spec_accepted_tokens > 0


def test_speculation_in_the_overlapped_loop_keeps_greedy_exact(tiny_target):
    plain, _ = _tiny_greedy(tiny_target, REPETITIVE)
    spec, llm = _tiny_greedy(tiny_target, REPETITIVE, speculative="ngram", overlap="on")
    assert spec == plain
    stats = llm.engine.stats
    assert llm.engine.overlap and stats.spec_steps > 0
    # random weights: drafts rarely hold, so the sequences pause and decode overlapped
    assert stats.spec_paused_seq_steps > 0 and stats.spec_empty_proposals > 0


def test_batch_rule_decodes_plainly_above_speculative_max_batch(tiny_target):
    llm = _tiny_llm(
        tiny_target,
        speculative="ngram",
        speculative_max_batch=2,
        speculative_min_accepted=0.0,
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 8, 30, 30)]
    _run_checking_invariants(llm, REPETITIVE, params)
    stats = llm.engine.stats
    assert stats.spec_skipped_batch_steps > 0  # four requests run at once: no speculation
    assert stats.spec_steps > 0 and stats.spec_verifications > 0  # the last two speculate


# ---------------------------------------------------------------- the adaptation rule
def _policy(**settings):
    from pitstop.ground.metrics import EngineStats
    from pitstop.speculation.spec_adaptation import SpeculationPolicy

    stats = EngineStats()
    return SpeculationPolicy(engine_config(model="x", **settings), stats), stats


def test_policy_pauses_a_sequence_that_keeps_nothing_and_doubles_the_pause():
    from pitstop.speculation.spec_adaptation import EMA_WEIGHT, FIRST_PAUSE, START_SCORE

    policy, stats = _policy(speculative_min_accepted=0.5)
    seq = Sequence("a", [1, 2, 3], SamplingParams())
    asked = []
    for _ in range(100):
        willing = seq.seq_id in policy.plan_step(1, [seq])
        asked.append(willing)
        if willing:
            policy.record(seq, 4, 0)  # four drafts, none kept
    # the score decays from START_SCORE by (1 - EMA_WEIGHT) a step: below 0.5, a pause
    misses, score = 0, START_SCORE
    while score >= 0.5:
        score, misses = score * (1 - EMA_WEIGHT), misses + 1
    assert asked.index(False) == misses == 5  # then each failed probe doubles the pause
    runs = "".join("1" if a else "0" for a in asked).split("1")
    pauses = [len(r) for r in runs if r]
    assert pauses[:3] == [FIRST_PAUSE, 2 * FIRST_PAUSE, 4 * FIRST_PAUSE]
    assert stats.spec_paused_seq_steps == asked.count(False)


def test_policy_keeps_a_sequence_whose_probe_succeeds_and_counts_empty_proposals():
    policy, stats = _policy(speculative_min_accepted=0.5)
    seq = Sequence("a", [1, 2, 3], SamplingParams())
    for _ in range(5):
        policy.plan_step(1, [seq])
        policy.record(seq, 0, 0)  # the proposer found nothing
    assert stats.spec_empty_proposals == 5
    while seq.seq_id not in policy.plan_step(1, [seq]):
        pass
    policy.record(seq, 4, 3)  # the probe keeps three drafts
    assert all(seq.seq_id in policy.plan_step(1, [seq]) for _ in range(5))


def test_policy_batch_rule_and_threshold_zero():
    policy, stats = _policy(speculative_max_batch=4, speculative_min_accepted=0.0)
    seqs = [Sequence(str(i), [1, 2], SamplingParams()) for i in range(6)]
    assert policy.plan_step(5, seqs) == set()
    assert stats.spec_skipped_batch_steps == 1
    for _ in range(20):
        willing = policy.plan_step(4, seqs[:4])
        assert willing == {s.seq_id for s in seqs[:4]}  # threshold 0: never paused
        for s in seqs[:4]:
            policy.record(s, 4, 0)


def test_adaptation_settings_are_validated():
    from pitstop.config import EngineConfig
    from pitstop.errors import ConfigError

    with pytest.raises(ConfigError, match="speculative_max_batch must be a positive integer"):
        EngineConfig(model="x", speculative_max_batch=0)
    with pytest.raises(ConfigError, match="speculative_min_accepted must be a finite number >= 0"):
        EngineConfig(model="x", speculative_min_accepted=-1.0)


def test_adaptation_counters_are_on_metrics():
    import types

    from pitstop.ground.metrics import EngineStats
    from pitstop.plugin_system.protocols import AllocatorStats
    from pitstop.server.metrics import _SnapshotCollector

    stats = EngineStats(spec_steps=7, spec_skipped_batch_steps=3, spec_paused_seq_steps=5)
    stats.spec_empty_proposals = 2
    snap = types.SimpleNamespace(
        num_running=0,
        num_waiting=0,
        allocator=AllocatorStats(num_pages=1, pages_free=1, tokens_held=0, tokens_reserved=0),
        stats=stats,
        kv_cache_usage=0.0,
    )
    collector = _SnapshotCollector(types.SimpleNamespace(snapshot=snap), "m")
    values = {m.name: m.samples[0].value for m in collector.collect()}
    assert values["pitstop:spec_decode_steps"] == 7
    assert values["pitstop:spec_decode_skipped_batch_steps"] == 3
    assert values["pitstop:spec_decode_paused_sequence_steps"] == 5
    assert values["pitstop:spec_decode_empty_proposals"] == 2


# ---------------------------------------------------------------- on the GPU (the H200 run)
@pytest.fixture(scope="module")
def gpu_tiny(tmp_path_factory) -> str:
    folder = make_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu-spec"),
        "qwen3",
        with_tokenizer=False,
        num_hidden_layers=3,
        head_dim=64,
    )
    return str(folder)


GPU_PROMPTS = [[11, 12, 13, 14, 15] * 8, [7, 8, 9] * 20, [3, 4, 5, 6] * 5, list(range(100, 140))]


def _gpu_greedy(model: str, prompts, max_tokens: int = 40, **settings):
    llm = LLM(
        model,
        device="cuda",
        dtype="float32",
        max_model_len=512,
        kv_cache_gib=0.5,
        kernels="fused",
        fused_precision="fp32",
        **settings,
    )
    replays = {"verify": 0, "draft": 0}
    runner = llm.engine.runner
    if runner.verify_graphs is not None:
        run = runner.verify_graphs.run

        def counted(seqs, run=run):
            replays["verify"] += 1
            return run(seqs)

        runner.verify_graphs.run = counted
    proposer = llm.engine.proposer
    if proposer is not None and getattr(proposer, "runner", None) is not None:
        graphs = proposer.runner.graphs
        assert graphs is not None, "the draft model captured no decode graphs"
        drun = graphs.run

        def dcounted(seqs, run=drun):
            replays["draft"] += 1
            return run(seqs)

        graphs.run = dcounted
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.allocator.stats().tokens_held == 0
    return [o.token_ids for o in outs], llm, replays


@pytest.fixture(scope="module")
def gpu_plain(gpu_tiny) -> list[list[int]]:
    return _gpu_greedy(gpu_tiny, GPU_PROMPTS)[0]


@pytest.mark.gpu
def test_gpu_verification_graphs_replay_and_greedy_equals_plain(gpu_tiny, gpu_plain):
    spec, llm, replays = _gpu_greedy(
        gpu_tiny,
        GPU_PROMPTS,
        speculative="ngram",
        num_speculative_tokens=4,
        speculative_min_accepted=0.0,  # speculate at every step
    )
    assert spec == gpu_plain
    graphs = llm.engine.runner.verify_graphs
    assert graphs is not None and graphs.num_query == 5 and graphs.graphs  # captured
    assert replays["verify"] > 0  # and replayed
    assert llm.engine.stats.spec_verifications > 0


@pytest.mark.gpu
def test_gpu_batches_over_the_bound_decode_in_the_overlapped_loop(gpu_tiny, gpu_plain):
    spec, llm, _ = _gpu_greedy(gpu_tiny, GPU_PROMPTS, speculative="ngram", speculative_max_batch=1)
    assert spec == gpu_plain
    assert llm.engine.overlap
    stats = llm.engine.stats
    assert stats.spec_skipped_batch_steps > 0  # four sequences at once: plain decode steps


@pytest.mark.gpu
def test_gpu_self_draft_replays_its_graphs_and_accepts_everything(gpu_tiny, gpu_plain):
    spec, llm, replays = _gpu_greedy(
        gpu_tiny,
        GPU_PROMPTS,
        speculative="draft",
        speculative_model=gpu_tiny,
        num_speculative_tokens=4,
    )
    assert spec == gpu_plain
    stats = llm.engine.stats
    assert stats.spec_proposed_tokens > 0 and stats.spec_acceptance_rate > 0.98
    assert replays["draft"] > 0 and replays["verify"] > 0
    assert not llm.engine.proposer._seqs


@pytest.mark.gpu
def test_gpu_smollm2_self_draft_accepts_nearly_everything():
    import os
    from pathlib import Path

    from pitstop.errors import ModelLoadError

    path = os.environ.get("SMOLLM_GGUF", "/tmp/smollm2.gguf")
    if not Path(path).exists():
        pytest.skip(f"no SmolLM2 GGUF at {path} (set SMOLLM_GGUF)")
    try:
        plain, _, _ = _gpu_greedy(path, GPU_PROMPTS, max_tokens=64)
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    spec, llm, replays = _gpu_greedy(
        path,
        GPU_PROMPTS,
        max_tokens=64,
        speculative="draft",
        speculative_model=path,
        num_speculative_tokens=4,
    )
    assert spec == plain
    stats = llm.engine.stats
    assert stats.spec_acceptance_rate > 0.98, stats
    assert replays["draft"] > 0 and replays["verify"] > 0


def test_bench_table_shows_how_many_steps_speculated():
    from pitstop.bench.report import RunResult, figures, table

    plain = figures(RunResult([], start=0.0, end=1.0))
    spec = figures(
        RunResult(
            [],
            start=0.0,
            end=1.0,
            spec_acceptance_rate=0.5,
            spec_mean_accepted=2.0,
            spec_step_share=0.25,
        )
    )
    assert spec["spec_step_share"] == 0.25 and "spec_step_share" not in plain
    text = table([("plain", plain, None), ("ngram", spec, None)])
    assert "steps that speculated" in text and "25.0%" in text


def test_self_draft_keeps_the_kv_of_its_accepted_drafts(tiny_target):
    """Drafts stay on the device until verification; after it, the draft model's KV of the kept
    drafts stays (their placeholders take the target's tokens) and nothing else is kept."""
    from pitstop.requests.sequence import PENDING_TOKEN

    llm = _tiny_llm(
        tiny_target,
        speculative="draft",
        speculative_model=tiny_target,
        num_speculative_tokens=3,
        max_batch_size=4,
        max_prefill_batch=4,
    )
    engine, proposer = llm.engine, llm.engine.proposer
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, ids in enumerate(REPETITIVE[:3]):
        engine.add_request(prompt_token_ids=ids, params=params, request_id=f"r{i}")
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.live_sequences().values():
            kv = proposer._seqs[seq.seq_id].kv_ids if seq.seq_id in proposer._seqs else None
            if kv is None:
                continue
            assert PENDING_TOKEN not in kv
            assert kv == seq.token_ids[: len(kv)]
            if engine.stats.spec_verifications:
                # greedy self-drafting keeps every draft: at most the last two tokens are new
                assert len(kv) >= seq.num_tokens - 2
                checked += 1
    assert checked and engine.stats.spec_acceptance_rate == 1.0
    assert not proposer._seqs and proposer.allocator.stats().tokens_held == 0
