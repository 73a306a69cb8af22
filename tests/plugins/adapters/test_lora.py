"""The ``lora`` adapter plugin (issue 47): PEFT adapters served per request, exact against PEFT.

Adapters are made at test time with ``peft`` on a tiny random Llama checkpoint
(``init_lora_weights=False``, their B scaled up so that they change the greedy tokens),
saved with ``save_pretrained``. Each row of a batch that mixes adapters of different ranks
and targets with rows of the base model must give, token for token (fp32, greedy), what
PEFT's ``merge_and_unload()`` of its own adapter gives (transformers' base model for the
rows without one). Engines run with poisoned memory. Refusals name the problem and fail
that request alone; the prefix cache never shares pages across adapters.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoints import greedy_continuation, hf_model, save_random_lora
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, InvalidRequestError, LoRARequest, SamplingParams
from pitstop.errors import ConfigError

peft = pytest.importorskip("peft")

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# name -> (rank, targets, extra LoraConfig arguments)
ADAPTERS: dict[str, tuple[int, list[str], dict[str, Any]]] = {
    "qvd": (8, ["q_proj", "v_proj", "down_proj"], {}),
    "ko_gu": (4, ["k_proj", "o_proj", "gate_proj", "up_proj"], {"use_rslora": True}),
    "all_l1": (
        2,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        {"layers_to_transform": [1]},
    ),
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}


def _save_adapter(
    base_dir: Path, out: Path, rank: int, targets: list[str], seed: int, **kw
) -> Path:
    """A PEFT adapter with random A and B (B scaled up so that it changes tokens), saved."""
    return save_random_lora(
        hf_model(base_dir), out, rank=rank, alpha=2 * rank, targets=targets, seed=seed,
        b_scale=20, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base checkpoint ("base") and one adapter folder per entry of ADAPTERS."""
    root = tmp_path_factory.mktemp("lora")
    folders = {"base": make_tiny_checkpoint(root, "llama", with_tokenizer=False)}  # token ids only
    for i, (name, (rank, targets, kw)) in enumerate(ADAPTERS.items()):
        folders[name] = _save_adapter(folders["base"], root / name, rank, targets, i + 1, **kw)
    return folders


@cache
def _merged(base: Path, adapter: Path | None) -> Any:
    """transformers' base model, or PEFT's merge_and_unload() of ``adapter`` on it."""
    model = hf_model(base)
    if adapter is None:
        return model
    return peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


@cache
def _expected(base: Path, adapter: Path | None, prompt: tuple[int, ...]) -> list[int]:
    return greedy_continuation(_merged(base, adapter), prompt, MAX_TOKENS)


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def _llm(tiny: dict[str, Path], **settings_: Any) -> LLM:
    values = dict(
        device="cpu",
        kv_cache_gib=0.01,
        max_model_len=128,
        poison_memory=True,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
    )
    values.update(settings_)
    return LLM(str(tiny["base"]), **values)


def _request(tiny: dict[str, Path], name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, IDS[name], str(tiny[name]))


def _assert_rows_match_peft(
    llm: LLM, tiny: dict[str, Path], names: list[str | None], prompts: list[list[int]]
) -> list[list[int]]:
    """Generate ``prompts`` in one batch, prompt ``i`` under adapter ``names[i]`` (None: the
    base model); each row's greedy tokens must be PEFT's merged model's. Returns those."""
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=GREEDY,
        lora_request=[_request(tiny, n) for n in names],
        use_tqdm=False,
    )
    expected = []
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        adapter = None if name is None else tiny[name]
        expected.append(_expected(tiny["base"], adapter, tuple(prompt)))
        assert out.token_ids == expected[-1], f"adapter {name} at prompt length {len(prompt)}"
    return expected


@pytest.fixture(scope="module")
def llm(tiny: dict[str, Path]) -> LLM:
    return _llm(tiny, scheduler="chunked", chunk_size=24)


def test_a_mixed_batch_matches_peft_merged_per_row(tiny: dict[str, Path], llm: LLM) -> None:
    names = ["qvd", "ko_gu", None, "all_l1", "qvd", None]
    prompts = _prompts((7, 30, 13, 41, 5, 19))
    expected = _assert_rows_match_peft(llm, tiny, names, prompts)
    base = [_expected(tiny["base"], None, tuple(prompt)) for prompt in prompts]
    changed = sum(want != plain for want, plain in zip(expected, base, strict=True))
    assert changed >= 3, "the adapters should change the greedy tokens of most of their rows"


@pytest.mark.parametrize("kernel", ["shrink_expand", "stacked"])
def test_any_mix_of_adapters_matches_peft(tiny: dict[str, Path], kernel: str) -> None:
    """pitstop.testing.adapters on the lora plugin, with the prefix cache on."""
    from pitstop.testing.adapters import check_adapters

    options = {"lora.kernel": kernel}
    prefix_llm = _llm(tiny, enable_prefix_caching=True, page_size=16, options=options)

    def reference(name: str | None):
        adapter = None if name is None else tiny[name]
        return lambda prompt: _expected(tiny["base"], adapter, tuple(prompt))

    references = {_request(tiny, n): reference(n) for n in (None, *ADAPTERS)}
    check_adapters(prefix_llm, references, max_examples=4, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("kernel", ["shrink_expand", "stacked"])
def test_one_slot_serves_adapters_in_turn_from_the_host_cache(
    tiny: dict[str, Path], kernel: str
) -> None:
    """One slot serving adapters in turn; stacked: each load rewrites the slot's columns of
    W_ext and rows of A_all (a module the next adapter does not train comes out zero)."""
    llm = _llm(tiny, max_loras=1, max_cpu_loras=1, options={"lora.kernel": kernel})
    prompt = _prompts((17,), seed=3)[0]
    for name in ("qvd", "ko_gu", "qvd", None, "all_l1", "qvd"):
        out = llm.generate(
            prompt_token_ids=[prompt],
            sampling_params=GREEDY,
            lora_request=_request(tiny, name),
            use_tqdm=False,
        )[0]
        adapter = None if name is None else tiny[name]
        assert out.token_ids == _expected(tiny["base"], adapter, tuple(prompt)), name


def test_requests_of_more_adapters_than_max_loras_wait_for_a_place(
    tiny: dict[str, Path],
) -> None:
    # as vLLM: a request whose adapter finds every slot taken waits (unqueued) until the
    # requests of another adapter finish; no step runs more than max_loras adapters
    llm = _llm(tiny, max_loras=2)
    engine = llm.engine
    seen: list[set[int]] = []
    prepare = engine.runner.adapters.prepare

    def record(seqs):
        seen.append({s.adapter for s in seqs if s.adapter is not None})
        return prepare(seqs)

    engine.runner.adapters.prepare = record  # type: ignore[method-assign]
    names = ["qvd", "ko_gu", "all_l1", None, "qvd", "all_l1"]
    prompts = _prompts((9, 14, 5, 11, 7, 20), seed=5)
    ids = [
        engine.add_request(prompt_token_ids=p, params=GREEDY, lora_request=_request(tiny, n))
        for n, p in zip(names, prompts, strict=True)
    ]
    assert engine.intake.num_waiting_for_adapter == 2  # all_l1's two, behind qvd and ko_gu
    aborted = engine.add_request(
        prompt_token_ids=[5, 6], params=GREEDY, lora_request=_request(tiny, "ko_gu")
    )
    engine.abort(aborted)  # queued beside its adapter, then aborted: nothing of it is left
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step(stream=False):
            finished[out.request_id] = out
    assert engine.intake.num_waiting_for_adapter == 0
    for request_id, name, prompt in zip(ids, names, prompts, strict=True):
        adapter = None if name is None else tiny[name]
        want = _expected(tiny["base"], adapter, tuple(prompt))
        assert finished[request_id].token_ids == want, name
    assert seen and max(len(step) for step in seen) <= 2
    pages = engine.allocator.stats()
    assert pages.pages_free == pages.num_pages and pages.tokens_held == 0


def test_a_waiting_request_can_be_aborted(tiny: dict[str, Path]) -> None:
    llm = _llm(tiny, max_loras=1)
    engine = llm.engine
    first = engine.add_request(
        prompt_token_ids=[5, 6, 7], params=GREEDY, lora_request=_request(tiny, "qvd")
    )
    waiting = engine.add_request(
        prompt_token_ids=[5, 6, 7], params=GREEDY, lora_request=_request(tiny, "ko_gu")
    )
    assert engine.intake.num_waiting_for_adapter == 1
    output = engine.abort(waiting)
    assert output is not None and output.finished
    assert engine.intake.num_waiting_for_adapter == 0
    done = []
    while engine.has_unfinished_requests():
        done += engine.step(stream=False)
    assert [o.request_id for o in done] == [first]


def test_a_request_joins_once_its_adapter_is_on_the_device(tiny: dict[str, Path]) -> None:
    """While the adapter plugin says a request's adapter is still being copied (``ready``
    False), the request stays out of the scheduler, its place kept, so no step of the
    running batch waits for the copy; it joins at the first step after the copy is done.
    Arriving with nothing else queued, it goes at once. Every row's tokens are PEFT's."""
    llm = _llm(tiny, max_loras=2)
    engine, plugin = llm.engine, llm.engine.runner.adapters
    copying = {IDS["ko_gu"]: 3}  # adapter id -> the asks before its copy is done
    asked: list[tuple[int, frozenset[int]]] = []

    def ready(request: Any, busy: Any) -> bool:
        asked.append((request.lora_int_id, frozenset(busy)))
        left = copying.get(request.lora_int_id, 0)
        copying[request.lora_int_id] = max(left - 1, 0)
        return left == 0

    plugin.ready = ready  # type: ignore[method-assign]
    seen: list[set[int]] = []
    prepare = plugin.prepare

    def record(seqs: Any) -> None:
        seen.append({s.adapter.lora_int_id for s in seqs if s.adapter is not None})
        prepare(seqs)

    plugin.prepare = record  # type: ignore[method-assign]
    prompts = _prompts((9, 14), seed=31)
    first = engine.add_request(
        prompt_token_ids=prompts[0], params=GREEDY, lora_request=_request(tiny, "qvd")
    )
    second = engine.add_request(
        prompt_token_ids=prompts[1], params=GREEDY, lora_request=_request(tiny, "ko_gu")
    )
    assert engine.intake.num_waiting_for_adapter == 1, "its copy runs: it waits"
    assert asked[-1] == (IDS["ko_gu"], frozenset({IDS["qvd"]})), "the queued adapters' slots kept"
    steps_waiting, finished = 0, {}
    while engine.has_unfinished_requests():
        if engine.intake.num_waiting_for_adapter:
            steps_waiting += 1
        for out in engine.step(stream=False):
            finished[out.request_id] = out
    # three answers "not yet" (at its add, before steps 1 and 2), "done" before step 3
    assert steps_waiting == 3 and [a for a, _ in asked].count(IDS["ko_gu"]) == 4
    assert seen[:2] == [{IDS["qvd"]}] * 2 and IDS["ko_gu"] in seen[2], seen
    for request_id, name, prompt in ((first, "qvd", prompts[0]), (second, "ko_gu", prompts[1])):
        want = _expected(tiny["base"], tiny[name], tuple(prompt))
        assert finished[request_id].token_ids == want, name
    copying[IDS["all_l1"]] = 5  # nothing else queued: no batch to hold up, it goes at once
    alone = engine.add_request(
        prompt_token_ids=prompts[0], params=GREEDY, lora_request=_request(tiny, "all_l1")
    )
    assert engine.intake.num_waiting_for_adapter == 0
    done = []
    while engine.has_unfinished_requests():
        done += engine.step(stream=False)
    assert [o.request_id for o in done] == [alone]
    assert done[0].token_ids == _expected(tiny["base"], tiny["all_l1"], tuple(prompts[0]))


@pytest.mark.parametrize("kernel", ["shrink_expand", "stacked"])
def test_tensor_parallel_ranks_serve_adapters_as_one_rank(
    tiny: dict[str, Path], kernel: str
) -> None:
    # tp=2 over gloo: each rank keeps its part of every adapter (B's rows for q/k/v/gate/up,
    # A's columns for o/down, whose partial deltas join the all-reduce); PEFT's tokens. Stacked:
    # each rank's W_ext holds its part of the weight and of B, o/down's h' a partial product
    names = ["qvd", None, "ko_gu", "all_l1"]
    prompts = _prompts((7, 12, 30, 9), seed=6)
    options = {"lora.kernel": kernel}
    with _llm(tiny, tensor_parallel_size=2, max_model_len=96, options=options) as llm:
        _assert_rows_match_peft(llm, tiny, names, prompts)


def test_tensor_parallel_workers_place_an_adapter_as_it_arrives(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    # the engine asks every rank's plugin `ready` as a request arrives (EveryRankAdapters),
    # so each worker reads its part of the adapter then, not in the step that runs it: with
    # the folder gone before the first step, every rank still serves PEFT's tokens
    folder = tmp_path / "qvd"
    shutil.copytree(tiny["qvd"], folder)
    prompt = _prompts((11,), seed=8)[0]
    with _llm(tiny, tensor_parallel_size=2, max_model_len=96) as llm:
        engine = llm.engine
        assert type(engine.intake.adapters).__name__ == "EveryRankAdapters"
        request_id = engine.add_request(
            prompt_token_ids=prompt,
            params=GREEDY,
            lora_request=LoRARequest("qvd", IDS["qvd"], str(folder)),
        )
        engine.runner.sync()  # the workers have read the message (it is sent without waiting)
        shutil.rmtree(folder)
        done = []
        while engine.has_unfinished_requests():
            done += engine.step(stream=False)
    assert [o.request_id for o in done] == [request_id]
    assert done[0].token_ids == _expected(tiny["base"], tiny["qvd"], tuple(prompt))


def test_an_adapter_cut_for_each_rank_joins_into_the_whole() -> None:
    from pitstop.ground.model_config import ModelConfig
    from pitstop.plugins.adapters.lora.peft_adapter import LoRAWeights, expected_shapes, rank_part
    from pitstop.plugins.executors.tensor_parallel.sharding import WeightShard

    mc = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_layers=1, num_heads=4, num_kv_heads=2, head_size=8,
    )  # fmt: skip
    shapes = expected_shapes(mc)
    gen = torch.Generator().manual_seed(0)
    pairs = {
        (0, m): (torch.randn(3, shapes[m][1], generator=gen), torch.randn(shapes[m][0], 3, generator=gen))
        for m in shapes
    }  # fmt: skip
    whole = LoRAWeights("x", 3, 1.0, pairs)
    parts = [rank_part(whole, WeightShard(mc, r, 2)) for r in range(2)]
    for (layer, module), (a, b) in pairs.items():
        got = [p.weights[(layer, module)] for p in parts]
        if module in ("o", "down"):  # row-parallel: the sum of the ranks' deltas is the delta
            x = torch.randn(5, a.shape[1], generator=gen)
            cols = a.shape[1] // 2
            delta = sum(
                (x[:, r * cols : (r + 1) * cols] @ ga.T) @ gb.T for r, (ga, gb) in enumerate(got)
            )
            torch.testing.assert_close(delta, (x @ a.T) @ b.T)
        else:  # column-parallel: the ranks' rows side by side are the delta's rows
            assert all(torch.equal(ga, a) for ga, _ in got)
            assert torch.equal(torch.cat([gb for _, gb in got]), b)


def test_the_prefix_cache_is_keyed_by_adapter(tiny: dict[str, Path]) -> None:
    llm = _llm(tiny, enable_prefix_caching=True, page_size=16)
    prompt = _prompts((40,), seed=4)[0]
    allocator = llm.engine.allocator

    def run(name: str | None) -> int:
        before = allocator.stats().prefix_hit_tokens
        out = llm.generate(
            prompt_token_ids=[prompt],
            sampling_params=GREEDY,
            lora_request=_request(tiny, name),
            use_tqdm=False,
        )[0]
        adapter = None if name is None else tiny[name]
        assert out.token_ids == _expected(tiny["base"], adapter, tuple(prompt)), name
        return allocator.stats().prefix_hit_tokens - before

    assert run("qvd") == 0
    assert run("ko_gu") == 0  # the same prompt under another adapter shares nothing
    assert run(None) == 0  # nor under the base model
    assert run("qvd") == 32  # the same adapter again: its two full pages


def test_without_enable_lora_a_lora_request_names_the_flag(tiny: dict[str, Path]) -> None:
    llm = LLM(str(tiny["base"]), device="cpu", kv_cache_gib=0.01, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        llm.generate(
            prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, lora_request=_request(tiny, "qvd")
        )


def test_lora_request_must_be_one_or_one_per_prompt(tiny: dict[str, Path], llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="2 lora requests for 1 prompts"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=GREEDY, lora_request=[None, None])
    with pytest.raises(InvalidRequestError, match="beam search with an adapter"):
        from pitstop.entrypoints.beam_search import BeamSearchParams

        llm.beam_search(
            [{"prompt_token_ids": [5, 6]}],
            BeamSearchParams(beam_width=2, max_tokens=2),
            lora_request=_request(tiny, "qvd"),
        )


def _edited(tiny: dict[str, Path], tmp_path: Path, **changes: Any) -> Path:
    """A copy of adapter qvd with ``changes`` made to its adapter_config.json."""
    folder = tmp_path / "edited"
    shutil.copytree(tiny["qvd"], folder)
    cfg_file = folder / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))
    return folder


REFUSED = {
    "dora": ({"use_dora": True}, "DoRA"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "bias": ({"bias": "all"}, "trained biases"),
    "embedding": ({"target_modules": ["embed_tokens", "q_proj"]}, "embedding and lm-head"),
    "rank": ({"r": 16}, "over max_lora_rank=8"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_adapters_are_refused_by_name(
    tiny: dict[str, Path], llm: LLM, tmp_path: Path, case: str
) -> None:
    changes, expected = REFUSED[case]
    folder = _edited(tiny, tmp_path, **changes)
    with pytest.raises(InvalidRequestError, match=expected):
        llm.generate(
            prompt_token_ids=[[5, 6, 7]],
            sampling_params=GREEDY,
            lora_request=LoRARequest(case, 90, str(folder)),
        )


def test_a_bad_path_or_another_base_fails_that_request_alone(
    tiny: dict[str, Path], llm: LLM, tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequestError, match="is not a folder"):
        llm.generate(
            prompt_token_ids=[[5, 6]],
            sampling_params=GREEDY,
            lora_request=LoRARequest("gone", 91, str(tmp_path / "x")),
        )
    other = make_tiny_checkpoint(tmp_path / "other", "llama", intermediate_size=96)
    foreign = _save_adapter(other, tmp_path / "foreign", 4, ["down_proj"], 7)
    with pytest.raises(InvalidRequestError, match="do not match the base model"):
        llm.generate(
            prompt_token_ids=[[5, 6]],
            sampling_params=GREEDY,
            lora_request=LoRARequest("foreign", 92, str(foreign)),
        )
    # the id of an adapter the engine knows (loaded here, not only by an earlier test) with
    # another folder
    llm.generate(
        prompt_token_ids=[[5, 6]], sampling_params=GREEDY, lora_request=_request(tiny, "qvd")
    )
    with pytest.raises(InvalidRequestError, match="already adapter"):
        llm.generate(
            prompt_token_ids=[[5, 6]],
            sampling_params=GREEDY,
            lora_request=LoRARequest("qvd", IDS["qvd"], str(foreign)),
        )
    prompt = _prompts((9,), seed=5)[0]
    out = llm.generate(
        prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=_request(tiny, "qvd")
    )[0]
    assert out.token_ids == _expected(tiny["base"], tiny["qvd"], tuple(prompt))


def test_merged_qkv_and_gate_up_projections_get_one_slice_per_part(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused kernel set's layout (q|k|v and gate|up merged), on the reference kernels."""
    from pitstop.plugins.kernels.reference import ReferenceKernels

    monkeypatch.setattr(ReferenceKernels, "merge_projections", True)
    llm = _llm(tiny)
    layer = llm.engine.runner.model.layers[0]
    assert hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")
    names = ["ko_gu", None, "qvd", "all_l1"]
    prompts = _prompts((11, 6, 25, 18), seed=6)
    _assert_rows_match_peft(llm, tiny, names, prompts)


@pytest.mark.parametrize("kernel", ["shrink_expand", "stacked"])
def test_speculative_decoding_verifies_with_each_rows_adapter(
    tiny: dict[str, Path], kernel: str
) -> None:
    """ngram drafts (repetitive prompts, so that it proposes) verified under each row's adapter."""
    llm = _llm(tiny, speculative="ngram", num_speculative_tokens=3, options={"lora.kernel": kernel})
    names = ["qvd", None, "ko_gu"]
    prompts = [[7, 8, 9, 10] * 6, [11, 12, 13] * 7, [21, 22] * 9]
    _assert_rows_match_peft(llm, tiny, names, prompts)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["fused", "reference"])
def test_on_the_gpu_a_mixed_batch_matches_peft_with_cuda_graphs(
    tiny: dict[str, Path], kernels: str
) -> None:
    """On CUDA (fp32): the Triton lora_add inside the whole model, decode steps replayed
    from CUDA graphs (the rows' slots in a static buffer), chunks beside decodes; PEFT's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    names = ["qvd", None, "ko_gu", "all_l1", "qvd", None, "ko_gu", "all_l1"]
    prompts = _prompts((7, 30, 13, 41, 5, 19, 60, 3), seed=8)
    llm = _llm(
        tiny, device="cuda", dtype="float32", kernels=kernels, scheduler="chunked", chunk_size=32
    )
    _assert_rows_match_peft(llm, tiny, names, prompts)
    if kernels == "fused":
        assert llm.engine.runner.graphs is not None, "decode should run from CUDA graphs"


@pytest.mark.gpu
@pytest.mark.parametrize("way", ["overlap", "stacked"])
def test_on_the_gpu_other_lora_ways_match_peft_with_cuda_graphs(
    tiny: dict[str, Path], way: str
) -> None:
    """On CUDA (fp32), decode steps replayed from CUDA graphs, chunks of 32 rows beside them;
    PEFT's tokens row for row. ``overlap`` (``lora.overlap``): each small step's shrinks on
    the side stream beside the base GEMMs (a fork and a join inside the captured decode graphs
    and the eager chunk steps). ``stacked`` (``lora.kernel=stacked``): the Triton ``lora_pack``
    and one cuBLAS GEMM over ``[x | h']`` and ``[W | B']`` a projection."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    names = ["qvd", None, "ko_gu", "all_l1", "qvd", None, "ko_gu", "all_l1"]
    prompts = _prompts((7, 30, 13, 41, 5, 19, 60, 3), seed=9 if way == "overlap" else 14)
    overlap = {"lora.overlap": True, "lora.kernel": "shrink_expand"}
    options = overlap if way == "overlap" else {"lora.kernel": "stacked"}
    llm = _llm(
        tiny,
        device="cuda",
        dtype="float32",
        kernels="fused",
        scheduler="chunked",
        chunk_size=32,
        options=options,
    )
    adapters = llm.engine.runner.adapters
    if way == "overlap":
        assert adapters.side is not None, "the side stream"
    else:
        assert all(p.ext is not None for p in adapters.layers[0].values()), "every one stacked"
    _assert_rows_match_peft(llm, tiny, names, prompts)
    assert llm.engine.runner.graphs is not None, "decode should run from CUDA graphs"


def test_overlap_is_a_no_op_off_cuda(tiny: dict[str, Path]) -> None:
    """``lora.overlap`` is accepted on the CPU and changes nothing there (no second stream):
    the rows still match PEFT."""
    llm = _llm(tiny, options={"lora.overlap": True, "lora.kernel": "shrink_expand"})
    assert llm.engine.runner.adapters.side is None
    _assert_rows_match_peft(llm, tiny, ["qvd", None], _prompts((6, 11), seed=2))


def test_overlap_is_refused_beside_a_kernel_without_shrinks(tiny: dict[str, Path]) -> None:
    """``lora.overlap`` moves ``shrink_expand``'s shrinks to a second stream; with the default
    ``stacked`` kernel (or ``fused``) it would do nothing, so it is refused, naming the fix."""
    for kernel in (None, "fused"):
        options = {"lora.overlap": True} | ({} if kernel is None else {"lora.kernel": kernel})
        with pytest.raises(ConfigError, match="set lora.kernel=shrink_expand too"):
            _llm(tiny, options=options)


def test_stacked_settings_are_refused_beside_another_kernel(tiny: dict[str, Path]) -> None:
    """``lora.large_steps`` and ``lora.pack_split`` shape the stacked layout's launches; set
    beside ``shrink_expand`` or ``fused`` they would do nothing, so they are refused."""
    for option in ({"lora.large_steps": "gemms"}, {"lora.pack_split": False}):
        with pytest.raises(ConfigError, match="use lora.kernel=stacked"):
            _llm(tiny, options={"lora.kernel": "shrink_expand", **option})


def test_an_adapter_is_placed_in_a_free_slot_when_its_request_is_checked(
    tiny: dict[str, Path],
) -> None:
    """Loading never waits for a step: a checked request's adapter goes into a free slot at
    once (on CUDA on the side stream); with no slot free on the CPU (no stream orders a copy
    after a step that may still read the slot) the step that runs it loads it. Either way
    the rows match PEFT."""
    llm = _llm(tiny, max_loras=2)
    plugin = llm.engine.runner.adapters
    plugin.check(_request(tiny, "qvd"))
    assert IDS["qvd"] in plugin.slot_lru, "placed before any step runs it"
    plugin.check(_request(tiny, "ko_gu"))
    plugin.check(_request(tiny, "all_l1"))  # both slots taken: left to its step
    assert set(plugin.slot_lru) == {IDS["qvd"], IDS["ko_gu"]}
    names = ["qvd", "all_l1", None, "all_l1"]
    _assert_rows_match_peft(llm, tiny, names, _prompts((9, 14, 6, 21), seed=12))
    assert IDS["all_l1"] in plugin.slot_lru


@pytest.mark.gpu
def test_on_the_gpu_piecewise_graphs_of_prompt_steps_add_every_slots_delta(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt steps replayed from piecewise CUDA graphs, the stacked layout's large steps
    (``_add_large``, here every step over 16 rows, no projection packing them): the graphs
    were captured before any step ran, so each holds the GEMMs over every slot's columns and
    reads the static row scales the step writes; each row's tokens are PEFT's, rows of no
    adapter beside rows of three, and a step without adapters after them."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pitstop.plugins.adapters.lora import slots

    monkeypatch.setattr(slots, "WORKSPACE_ROWS", 16)
    monkeypatch.setattr(slots, "packs_large_steps", lambda n, k: False)
    llm = _llm(tiny, device="cuda", dtype="float32", kernels="fused", max_batch_size=16)
    runner = llm.engine.runner
    assert runner.mixed_graphs is not None and runner.mixed_graphs.captured, "piecewise graphs"
    replayed: list[int] = []
    run = runner.mixed_graphs.run

    def counted(input_ids: torch.Tensor, meta: Any) -> torch.Tensor:
        replayed.append(input_ids.shape[0])
        return run(input_ids, meta)

    monkeypatch.setattr(runner.mixed_graphs, "run", counted)
    names = ["qvd", None, "ko_gu", "all_l1", None]
    _assert_rows_match_peft(llm, tiny, names, _prompts((40, 9, 31, 12, 26), seed=21))
    assert replayed and max(replayed) > 16, f"a prompt step over 16 rows replayed: {replayed}"
    _assert_rows_match_peft(llm, tiny, [None, None], _prompts((30, 20), seed=22))


@pytest.mark.gpu
def test_on_the_gpu_adapters_load_on_a_side_stream(tiny: dict[str, Path]) -> None:
    """On CUDA a checked adapter is copied on the loader stream (an event per slot copy)
    into an empty slot, and the step that runs it waits for the copy on the device; one
    that finds none is placed by ``ready`` when its request is added; rows match PEFT with
    CUDA graphs, adapters changing slots."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = _llm(tiny, device="cuda", dtype="float32", kernels="fused", max_loras=2)
    plugin = llm.engine.runner.adapters
    assert plugin.loader is not None
    plugin.check(_request(tiny, "qvd"))
    assert set(plugin.copies) == {plugin.slot_lru[IDS["qvd"]]}, "copied on the side stream"
    _assert_rows_match_peft(llm, tiny, ["qvd", None], _prompts((9, 14), seed=13))
    assert not plugin.copies, "the step that ran it waited for its copy"
    plugin.check(_request(tiny, "ko_gu"))  # the free slot
    assert plugin.copies
    plugin.check(_request(tiny, "all_l1"))  # no empty slot: placed by ready() at its add
    assert IDS["all_l1"] not in plugin.slot_lru
    names = ["ko_gu", "all_l1", None, "all_l1", "ko_gu"]
    _assert_rows_match_peft(llm, tiny, names, _prompts((9, 14, 6, 21, 3), seed=14))
    assert llm.engine.runner.graphs is not None, "decode should run from CUDA graphs"


@pytest.mark.gpu
def test_on_the_gpu_ready_copies_beside_the_steps_into_a_slot_no_queued_adapter_holds(
    tiny: dict[str, Path],
) -> None:
    """``ready``: with every slot held by a queued request's adapter it copies nothing (the
    step that runs it loads it); else it starts the side copy into the slot of an adapter
    no queued request runs, answers True once that copy is done, and the rows match PEFT."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = _llm(tiny, device="cuda", dtype="float32", kernels="fused", max_loras=2)
    plugin = llm.engine.runner.adapters
    plugin.check(_request(tiny, "qvd"))
    plugin.check(_request(tiny, "ko_gu"))
    torch.cuda.synchronize()
    held = dict(plugin.slot_lru)
    all_l1 = _request(tiny, "all_l1")
    assert plugin.ready(all_l1, {IDS["qvd"], IDS["ko_gu"]}), "no slot: left to its step"
    assert dict(plugin.slot_lru) == held, "no queued adapter evicted"
    plugin.ready(all_l1, {IDS["ko_gu"]})
    assert IDS["all_l1"] in plugin.slot_lru and IDS["qvd"] not in plugin.slot_lru
    assert plugin.slot_lru[IDS["all_l1"]] == held[IDS["qvd"]] and plugin.copies
    torch.cuda.synchronize()
    assert plugin.ready(all_l1, {IDS["ko_gu"]}), "its copy is done"
    _assert_rows_match_peft(llm, tiny, ["all_l1", "ko_gu", None], _prompts((9, 14, 6), seed=32))


@pytest.mark.gpu
def test_on_the_gpu_each_steps_slots_travel_from_pinned_memory(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step's row slots reach the device from pinned host memory: from pageable memory
    the copy would hold the host until everything queued before it had run, so no step could
    be prepared while the one before runs (on an H100, 2026-12-07, `nano` over 8 adapters left
    the GPU idle 17% of each decode step and 32% of each prompt step). Rows match PEFT."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pitstop.plugins.adapters.lora import slots as lora_slots

    staged: list[bool] = []
    original = lora_slots.host_tensor

    def spy(*args: Any) -> torch.Tensor:
        tensor = original(*args)
        staged.append(tensor.is_pinned())
        return tensor

    monkeypatch.setattr(lora_slots, "host_tensor", spy)
    llm = _llm(tiny, device="cuda", dtype="float32", kernels="fused")
    _assert_rows_match_peft(llm, tiny, ["qvd", None], _prompts((9, 14), seed=15))
    assert staged and all(staged), f"{staged.count(False)} of {len(staged)} steps not pinned"


@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
def test_stacked_layout_matches_peft_per_row(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch, merged: bool
) -> None:
    """``lora.kernel=stacked``: the slots' B as extra columns of each base weight (the
    parameter a view of them) and one GEMM over ``[x | h']`` a projection (the reference
    pack on the CPU); chunks of 24 rows and decode steps take it, rows without an adapter
    beside rows of three, in one q|k|v and gate|up merged layout too."""
    from pitstop.plugins.kernels import lora_reference
    from pitstop.plugins.kernels.reference import ReferenceKernels

    packs: list[int] = []
    pack = lora_reference.lora_pack
    monkeypatch.setattr(
        lora_reference, "lora_pack", lambda x, *a, **k: packs.append(x.shape[0]) or pack(x, *a, **k)
    )
    monkeypatch.setattr(ReferenceKernels, "merge_projections", merged)
    llm = _llm(tiny, scheduler="chunked", chunk_size=24, options={"lora.kernel": "stacked"})
    adapters = llm.engine.runner.adapters
    first = adapters.layers[0]
    assert first and all(p.ext is not None for p in first.values()), "every projection stacked"
    attn = llm.engine.runner.model.layers[0].self_attn
    name = "qkv_proj" if merged else "q_proj"
    weight, proj = getattr(attn, name), first[name]
    assert weight.data_ptr() == proj.ext.data_ptr(), "the base weight lives in W_ext"
    names = ["qvd", "ko_gu", None, "all_l1", "qvd", None]
    _assert_rows_match_peft(llm, tiny, names, _prompts((7, 30, 13, 41, 5, 19), seed=11))
    assert packs and max(packs) <= 24, "every step packed (chunks of 24 rows, then decodes)"


def test_stacked_layout_survives_sleep_at_both_levels(tiny: dict[str, Path]) -> None:
    """Sleep mode with stacked projections: level 1 keeps the adapters' columns that share the
    base weights' storage (the host copy is of whole storages); level 2 discards them, and
    after the base weights are written again each adapter loads again from the host cache."""
    llm = _llm(tiny, enable_sleep_mode=True, options={"lora.kernel": "stacked"})
    names = ["qvd", None, "ko_gu"]
    prompts = _prompts((9, 14, 6), seed=13)
    _assert_rows_match_peft(llm, tiny, names, prompts)
    llm.sleep(level=1)
    llm.wake_up()
    _assert_rows_match_peft(llm, tiny, names, prompts)
    llm.sleep(level=2)
    llm.wake_up()
    llm.update_weights_from_disk(tiny["base"])
    _assert_rows_match_peft(llm, tiny, names, prompts)


def test_stacked_layout_packs_large_steps_where_its_columns_are_few(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stacked projection that packs steps over the static buffer's rows too
    (``packs_large_steps``: N >= K, here every projection), into a buffer of their own,
    instead of the library GEMMs after the base one: steps of 16 rows at most in the
    static buffer, so the 24-row chunks take the large path. PEFT's tokens row for row."""
    from pitstop.plugins.adapters.lora import slots
    from pitstop.plugins.kernels import lora_reference

    monkeypatch.setattr(slots, "WORKSPACE_ROWS", 16)
    monkeypatch.setattr(slots, "packs_large_steps", lambda n, k: True)
    packs: list[int] = []
    pack = lora_reference.lora_pack
    monkeypatch.setattr(
        lora_reference, "lora_pack", lambda x, *a, **k: packs.append(x.shape[0]) or pack(x, *a, **k)
    )
    llm = _llm(tiny, scheduler="chunked", chunk_size=24, options={"lora.kernel": "stacked"})
    assert all(p.packs_large_steps for p in llm.engine.runner.adapters.layers[0].values())
    names = ["all_l1", None, "qvd", "ko_gu"]
    _assert_rows_match_peft(llm, tiny, names, _prompts((40, 9, 31, 12), seed=15))
    assert max(packs) > 16, f"a step over the static rows packed: {sorted(set(packs))}"


def test_stacked_layout_adds_large_steps_by_library_gemms(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stacked projection that does not pack large steps (``packs_large_steps``: K > N;
    here none) takes a step over the static
    buffer's rows (a prefill chunk) as the base GEMM, then ``h = x A_used^T`` over the slots
    the step runs, each row's own slot kept and scaled, and ``y += h B_used^T``
    (``_add_large``): here steps of 16 rows at most in the static buffer, so the 24-row chunks
    take it, with rows of no adapter beside rows of three. PEFT's tokens row for row; a step
    without any adapter adds nothing (no span of slots)."""
    from pitstop.plugins.adapters.lora import slots

    monkeypatch.setattr(slots, "WORKSPACE_ROWS", 16)
    monkeypatch.setattr(slots, "packs_large_steps", lambda n, k: False)
    spans: list[tuple[int, int] | None] = []
    add_large = slots.LoRASlots._add_large

    def spy(self: Any, x: torch.Tensor, y: torch.Tensor, proj: Any) -> None:
        spans.append(self.step_slots)
        add_large(self, x, y, proj)

    monkeypatch.setattr(slots.LoRASlots, "_add_large", spy)
    llm = _llm(tiny, scheduler="chunked", chunk_size=24, options={"lora.kernel": "stacked"})
    assert not any(p.packs_large_steps for p in llm.engine.runner.adapters.layers[0].values())
    names = ["all_l1", None, "qvd", "ko_gu"]
    _assert_rows_match_peft(llm, tiny, names, _prompts((40, 9, 31, 12), seed=15))
    assert any(span is not None for span in spans), f"no large step ran an adapter: {spans}"
    spans.clear()
    _assert_rows_match_peft(llm, tiny, [None, None], _prompts((30, 20), seed=16))
    assert spans and set(spans) == {None}, "a large step without adapters: no span"
