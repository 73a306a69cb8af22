"""Penalties, logit bias, min_tokens, top-k logprobs and the grammar bitmask, in the sampler.

Each processor is checked exactly against its definition, written out per
row in plain Python here (the sampler does it batched on tensors), and once
by drawing: a chi-square test that the penalized distribution is the one
sampled. Then end to end on SmolLM2: ``min_tokens`` holds EOS and stop
tokens back, ``n`` samples share the prompt's pages, ``logprobs=k`` and
vLLM-style prompts and outputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import smollm2_gguf, transformers_smollm2

from pitstop import LLM, SamplingParams, TextPrompt, TokensPrompt
from pitstop.entrypoints.chat_template import apply_chat_template
from pitstop.errors import InvalidRequestError
from pitstop.plugin_system.sampler import RowInputs
from pitstop.plugins.samplers.batch import make_sampling_batch, make_step_inputs
from pitstop.plugins.samplers.standard import StandardSampler
from pitstop.requests.sequence import PENDING_TOKEN

CPU = torch.device("cpu")
VOCAB = 12


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """vLLM's definitions, one token at a time."""
    out = list(logits)
    for t in range(len(out)):
        if t in prompt or t in output:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    for t, b in p.logit_bias:
        out[t] += b
    return out


def processed(
    logits: torch.Tensor,
    params: list[SamplingParams],
    rows: list[RowInputs | None],
    pending: list[int] | None = None,
    last: torch.Tensor | None = None,
) -> tuple[StandardSampler, object]:
    batch = make_sampling_batch(params, [None] * len(params), CPU)
    last = last if last is not None else torch.zeros(len(params), dtype=torch.int64)
    batch = make_step_inputs(batch, rows, pending or [0] * len(params), last, logits.shape[-1])
    return StandardSampler(CPU, seed=0), batch


def test_penalties_and_bias_match_their_definitions() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 3
    prompts = [[1, 2, 3], [4, 4], [5], [0]]
    outputs = [[3, 3, 7], [8], [], [0, 0, 0, 9]]
    params = [
        SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0, repetition_penalty=1.7, logit_bias={2: 4.0, 11: -3}),
        SamplingParams(temperature=0),  # no processor: its row must be untouched
        SamplingParams(temperature=0, repetition_penalty=0.6, frequency_penalty=-1.0),
    ]
    rows = [
        RowInputs(history=p + o, num_prompt_tokens=len(p)) if params[i].needs_penalties else None
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]
    sampler, batch = processed(logits, params, rows)
    got = sampler.process(logits.clone(), batch)
    for i in range(4):
        want = reference_penalties(logits[i].tolist(), prompts[i], outputs[i], params[i])
        assert got[i].tolist() == pytest.approx(want, abs=1e-5), i
    # greedy takes the argmax of the processed logits
    out = sampler.sample(logits, batch)
    assert out.token_ids.tolist() == got.argmax(-1).tolist()


def test_a_pending_last_token_is_read_from_the_device() -> None:
    """Overlapped loop: the last output token is still -1 on the host; its value is on the device."""
    logits = torch.zeros(2, VOCAB)
    params = [SamplingParams(temperature=0, presence_penalty=2.0)] * 2
    rows = [
        RowInputs(history=[1, 5, PENDING_TOKEN], num_prompt_tokens=1),
        RowInputs(history=[1, PENDING_TOKEN], num_prompt_tokens=1),
    ]
    last = torch.tensor([9, 0, 6])  # the previous step's samples; rows 2 and 0 are ours
    sampler, batch = processed(logits, params, rows, pending=[2, 0], last=last)
    got = sampler.process(logits.clone(), batch)
    assert (got[0] == -2).nonzero().flatten().tolist() == [5, 6]
    assert (got[1] == -2).nonzero().flatten().tolist() == [9]


def test_token_histories_copy_only_new_tokens_and_keep_the_pending_slot() -> None:
    from pitstop.plugins.samplers.batch import TokenHistories

    histories = TokenHistories()
    tokens = [5, 6, 7]
    assert histories.row(1, tokens).tolist() == [5, 6, 7]
    tokens.append(PENDING_TOKEN)
    assert histories.row(1, tokens).tolist() == [5, 6, 7, -1]
    tokens[-1] = 9  # resolved
    tokens += list(range(200)) + [PENDING_TOKEN]  # grows past the first array
    assert histories.row(1, tokens).tolist() == [5, 6, 7, 9, *range(200), -1]
    tokens[0] = 99  # a known token never changes: the cache keeps what it copied
    assert histories.row(1, tokens)[0] == 5
    histories.forget([1])
    assert histories.row(1, tokens)[0] == 99


def test_penalized_distribution_is_the_one_sampled() -> None:
    """Chi-square: 20k draws from a frequency-penalized row follow softmax(penalized logits)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5]])
    p = SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.2)
    history = [4, 0, 0, 1]
    n = 20_000
    params = [p] * n
    rows = [RowInputs(history=history, num_prompt_tokens=1)] * n
    sampler, batch = processed(logits.expand(n, -1).contiguous(), params, rows)
    tokens = sampler.sample(logits.expand(n, -1).contiguous(), batch).token_ids
    counts = torch.bincount(tokens, minlength=6).double()
    want = torch.softmax(
        torch.tensor(reference_penalties(logits[0].tolist(), [4], [0, 0, 1], p)), -1
    ).double()
    chi2 = (((counts - n * want) ** 2) / (n * want)).sum().item()
    assert chi2 < 20.5  # the 0.999 quantile of chi-square with 5 degrees of freedom
    plain = torch.softmax(logits[0], -1).double()
    assert (((counts - n * plain) ** 2) / (n * plain)).sum().item() > 100  # the penalty shows


def test_blocked_tokens_and_bitmask_mask_to_minus_inf() -> None:
    logits = torch.zeros(2, 40)
    params = [SamplingParams(temperature=0)] * 2
    rows = [RowInputs(blocked_token_ids=(3, 7)), None]
    sampler, batch = processed(logits, params, rows)
    got = sampler.process(logits.clone(), batch)
    assert torch.isinf(got[0]).nonzero().flatten().tolist() == [3, 7]
    assert not torch.isinf(got[1]).any()
    from pitstop.plugins.samplers.processors import apply_bitmask

    mask = torch.full((2, 2), -1, dtype=torch.int32)
    mask[0, 0] = 0b1010  # row 0 allows tokens 1 and 3 of the first word only, and all of word 2
    mask[0, 1] = 0
    masked = apply_bitmask(torch.zeros(2, 40), mask)
    assert (masked[0] > -1).nonzero().flatten().tolist() == [1, 3]
    assert not torch.isinf(masked[1]).any()


def test_logprobs_k_are_the_top_k_of_the_processed_distribution() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(temperature=0, logprobs=3, logit_bias={5: 10.0}),
        SamplingParams(temperature=0.9, logprobs=0),
        SamplingParams(temperature=0),
    ]
    sampler, batch = processed(logits, params, [None] * 3)
    out = sampler.sample(logits, batch)
    lp = torch.log_softmax(sampler.process(logits.clone(), batch), -1)
    assert out.top_ids is not None and out.top_ids.shape == (3, 3)
    assert out.top_ids[0, 0].item() == 5 and out.token_ids[0].item() == 5
    assert torch.allclose(out.top_logprobs, lp.topk(3, -1).values)
    chosen = lp.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.logprobs, chosen)
    ranks = (lp > chosen.unsqueeze(1)).sum(-1) + 1
    assert out.ranks.tolist() == ranks.tolist() and out.ranks[0].item() == 1


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {3: 200}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one"),
        ({"structured_outputs": {"jsn": {}}}, "no field 'jsn'"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ],
)
def test_bad_sampling_values_name_the_field(kwargs: dict, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        SamplingParams(**kwargs)


def test_top_k_zero_disables_like_vllm() -> None:
    assert SamplingParams(top_k=0).top_k == -1


# ---------------------------------------------------------------- end to end (SmolLM2)
@pytest.fixture(scope="module")
def llm() -> LLM:
    smollm2_gguf()
    return LLM(
        "smollm2-135m",
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.25,
        allocator="prefix",
        overlap="on",
        page_size=16,
    )


def test_min_tokens_holds_back_eos_and_stop_tokens(llm: LLM) -> None:
    eos = set(llm.engine.eos_token_ids)
    chat = apply_chat_template(llm.engine.tokenizer, [{"role": "user", "content": "Say hi."}])
    prompt = TokensPrompt(prompt_token_ids=chat)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60))[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 30  # stops early by itself
    assert free.token_ids[-1] in eos
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, min_tokens=30))[0]
    assert len(held.token_ids) >= 30 and not set(held.token_ids[:30]) & eos
    stop_id = free.token_ids[0]
    early = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id], min_tokens=5)
    )[0]
    assert stop_id not in early.token_ids[:5] and len(early.token_ids) >= 5
    first = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id])
    )[0]
    assert first.token_ids == [stop_id] and first.outputs[0].stop_reason == stop_id


def test_n_samples_share_the_prompts_pages(llm: LLM) -> None:
    prompt = "The history of the city of Rome begins with its founding, " * 6
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    full_pages = (n_prompt - 1) // 16
    engine = llm.engine
    before = engine.allocator.stats()
    rid = engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8))
    shared_seen = 0
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
        stats = engine.allocator.stats()
        shared_seen = max(shared_seen, stats.tokens_shared)
    after = engine.allocator.stats()
    assert final is not None and len(final.outputs) == 4
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1  # four different samples
    # three siblings each reuse every full page of the prompt: one copy of it in the cache
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    assert hits == 3 * full_pages * 16
    assert shared_seen >= 3 * full_pages * 16
    assert after.tokens_held == 0


def test_n_greedy_samples_on_shared_paged_pages_equal_one_sample() -> None:
    """Under ``paged`` the siblings read the first sample's prompt KV: greedy, all equal the n=1 run."""
    smollm2_gguf()
    llm = LLM(
        "smollm2-135m",
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.1,
        max_model_len=512,
        allocator="paged",
        page_size=16,
        overlap="on",
    )
    prompt = "Write one sentence about the history of the city of Rome and its bridges. " * 3
    one = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(n=3, temperature=0, max_tokens=12))
    shared_seen, final = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
        shared_seen = max(shared_seen, engine.allocator.stats().tokens_shared)
    n_prompt = len(final.prompt_token_ids)
    assert [o.token_ids for o in final.outputs] == [one] * 3
    assert shared_seen == 2 * ((n_prompt - 1) // 16) * 16  # two siblings, every full prompt page
    stats = engine.allocator.stats()
    assert stats.tokens_held == 0 and stats.pages_free == stats.num_pages


def test_prompt_logprobs_match_transformers_across_chunks() -> None:
    """Each prompt token's log-probability and top-k, computed over 8-token chunks, equal HF's."""
    hf = transformers_smollm2()
    llm = LLM(
        "smollm2-135m",
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.1,
        max_model_len=256,
        scheduler="chunked",
        chunk_size=8,
        max_num_batched_tokens=8,
    )
    prompt = "The capital of France is Paris, and the capital of Italy is"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    assert len(ids) > 8 and out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for j in range(1, len(ids)):
        position = out.prompt_logprobs[j]
        assert position[ids[j]].logprob == pytest.approx(want[j - 1, ids[j]].item(), abs=2e-4)
        assert position[ids[j]].rank == int((want[j - 1] > want[j - 1, ids[j]]).sum()) + 1
        top = sorted((e.logprob for e in position.values() if e.rank <= 3), reverse=True)
        assert top == pytest.approx(want[j - 1].topk(3).values.tolist(), abs=2e-4)
    with pytest.raises(InvalidRequestError, match="prefix allocator"):
        LLM(
            "smollm2-135m",
            device="cpu",
            dtype="float32",
            kv_cache_gib=0.1,
            max_model_len=256,
            allocator="prefix",
        ).generate(prompt, SamplingParams(prompt_logprobs=1))


def test_vllm_prompt_forms_and_outputs(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=5, logprobs=2)
    ids = llm.get_tokenizer().encode("The capital of France is")
    outs = llm.generate(
        [TextPrompt(prompt="The capital of France is"), TokensPrompt(prompt_token_ids=ids)],
        greedy,
    )
    a, b = outs
    assert a.outputs[0].text == b.outputs[0].text == a.text
    c = a.outputs[0]
    assert c.index == 0 and c.finish_reason == "length" and len(c.logprobs) == len(c.token_ids)
    assert c.cumulative_logprob == pytest.approx(
        sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=True))
    )
    for token, position in zip(c.token_ids, c.logprobs, strict=True):
        assert position[token].rank == 1 and len(position) == 2  # greedy: chosen is the top one
        assert math.exp(position[token].logprob) <= 1
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate({"text": "hi"})
    with pytest.raises(InvalidRequestError, match="prompts\\[1\\]"):
        llm.generate(["hi", 5])


# ---------------------------------------------------------------- on the GPU (the H200)
def _device_model() -> str:
    """The SmolLM2 GGUF on the GPU machine ($SMOLLM_GGUF, /tmp/smollm2.gguf) or the wheel's."""
    import os
    from pathlib import Path

    for candidate in (os.environ.get("SMOLLM_GGUF"), "/tmp/smollm2.gguf"):
        if candidate and Path(candidate).is_file():
            return candidate
    return str(smollm2_gguf())


@pytest.mark.gpu
def test_processors_on_cuda_match_the_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = torch.device("cuda")
    torch.manual_seed(3)
    vocab = 49152
    logits = torch.randn(8, vocab) * 4
    params = [
        SamplingParams(
            temperature=0,
            presence_penalty=0.5 * (i % 3),
            frequency_penalty=0.25 * (i % 2),
            repetition_penalty=1.0 + 0.1 * i,
            logit_bias={i: 3.0, 100 + i: -50.0},
            logprobs=5,
        )
        for i in range(8)
    ]
    rows = [
        RowInputs(
            history=list(range(i, 300 + 7 * i)) + [PENDING_TOKEN],
            num_prompt_tokens=50,
            blocked_token_ids=(2, 0) if i % 2 else (),
        )
        for i in range(8)
    ]
    last = torch.arange(8) * 11
    pending = list(range(8))
    outs = []
    for device in (CPU, cuda):
        batch = make_sampling_batch(params, [None] * 8, device)
        batch = make_step_inputs(batch, rows, pending, last.to(device), vocab)
        sampler = StandardSampler(device, seed=0)
        processed_logits = sampler.process(logits.to(device), batch).cpu()
        outs.append((processed_logits, sampler.sample(logits.to(device), batch)))
    (cpu_logits, cpu_out), (gpu_logits, gpu_out) = outs
    assert torch.allclose(cpu_logits, gpu_logits, atol=1e-4)
    assert cpu_out.token_ids.tolist() == gpu_out.token_ids.cpu().tolist()
    assert torch.allclose(cpu_out.top_logprobs, gpu_out.top_logprobs.cpu(), atol=1e-4)


@pytest.mark.gpu
def test_overlapped_loop_on_cuda_gives_the_serial_loops_tokens() -> None:
    """Penalties, min_tokens, bias and logprobs read pending tokens on the device: same tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _device_model()
    params = [
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, logprobs=5),
        SamplingParams(temperature=0, max_tokens=24, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=20, logit_bias={28: 5.0}),
        SamplingParams(temperature=0.9, seed=11, max_tokens=24, n=3, frequency_penalty=0.3),
    ]
    params.append(SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3))
    prompts = ["The capital of France is", "List the planets:", "Hi", "Once upon a time", "A B C"]
    results = {}
    for overlap in ("off", "on"):
        llm = LLM(
            model,
            device="cuda",
            dtype="float32",
            kv_cache_gib=1,
            overlap=overlap,
            allocator="paged",
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[overlap] = [[c.token_ids for c in o.outputs] for o in outs]
        lp = outs[0].outputs[0].logprobs
        assert lp is not None and all(len(p) == 5 for p in lp)
        prompt_lp = outs[4].prompt_logprobs
        assert prompt_lp is not None and len(prompt_lp) == len(outs[4].prompt_token_ids)
        assert all(len(p) in (3, 4) for p in prompt_lp[1:])
        del llm
        torch.cuda.empty_cache()
    assert results["on"] == results["off"]


def test_chat_template_options(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    ids = apply_chat_template(tok, messages, add_generation_prompt=False, chat_template=template)
    assert tok.decode(ids) == "[user] Hi\n[assistant] Hello, I am\n"
    params = SamplingParams(temperature=0, max_tokens=3)
    cont = llm.chat(messages, params, add_generation_prompt=False, continue_final_message=True)
    rendered = tok.decode(cont[0].prompt_token_ids, skip_special_tokens=False)
    assert rendered.rstrip().endswith("Hello, I am")  # the assistant turn is left open
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        llm.chat(messages, params, continue_final_message=True)
    assert llm.chat(messages[:1], params, chat_template=template)[0].outputs[0].text


def test_a_sampler_without_processors_is_refused_them(tmp_path) -> None:
    """A third-party sampler that does not declare supports_logits_processors never gets them."""
    import types

    import pitstop
    from pitstop.plugin_system.plugin_manager import PluginManager
    from pitstop.plugins.samplers.standard import StandardSampler

    class PlainSampler(StandardSampler):
        supports_logits_processors = False
        prompt_logprobs = None  # nor prompt log-probabilities (SamplerBase's default)

    module = types.ModuleType("plain_sampler_plugin")

    @pitstop.hookimpl
    def register_samplers(register):
        register("plain", lambda config, device: PlainSampler(device))

    module.register_samplers = register_samplers
    plugins = PluginManager()
    plugins.add_module(module, distribution="test", version="0")
    smollm2_gguf()
    llm = LLM(
        "smollm2-135m",
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.05,
        max_model_len=256,
        sampler="plain",
        plugins=plugins,
    )
    for bad in (
        {"presence_penalty": 1.0},
        {"logprobs": 2},
        {"min_tokens": 2},
        {"structured_outputs": {"regex": "a+"}},
        {"logit_bias": {1: 1.0}},
    ):
        with pytest.raises(InvalidRequestError, match="'plain' sampler does not apply"):
            llm.generate("Hi", SamplingParams(max_tokens=2, **bad))
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2, logprobs=0))[0].text
    with pytest.raises(InvalidRequestError, match="'plain' sampler does not compute prompt_logp"):
        llm.generate("Hi", SamplingParams(max_tokens=2, prompt_logprobs=1))
