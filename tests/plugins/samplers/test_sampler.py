"""The ``standard`` sampler: determinism, greedy, filters, and the distribution it draws from."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop import EngineConfig, SamplingParams
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.plugin_system.protocols import Sampler
from pitstop.plugin_system.sampler import make_generator
from pitstop.plugins.samplers.batch import SamplingBatch, make_sampling_batch
from pitstop.plugins.samplers.standard import StandardSampler

CPU = torch.device("cpu")

# Upper 0.999 quantiles of the chi-square distribution, by degrees of freedom
# (scipy.stats.chi2.ppf(0.999, df)); every test below is seeded, so a
# threshold this strict only guards against a genuinely wrong distribution.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])


def sampler(seed: int = 0) -> StandardSampler:
    """A sampler built straight from the class (the plugin route is tested separately)."""
    return StandardSampler(CPU, seed=seed)


def batch_of(params: list[SamplingParams], seeds: list[int | None] | None = None) -> SamplingBatch:
    """A batch with one generator per given seed (None: the shared generator)."""
    seeds = seeds if seeds is not None else [None] * len(params)
    gens = [make_generator(s, CPU) if s is not None else None for s in seeds]
    return make_sampling_batch(params, gens, CPU)


def draw_counts(
    probs_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 1234
) -> torch.Tensor:
    """Counts of each token over ``n`` draws from one logits row (one batch of ``n`` copies)."""
    logits = probs_row.unsqueeze(0).expand(n, -1).contiguous()
    out = sampler(seed).sample(logits, batch_of([params] * n))
    return torch.bincount(out.token_ids, minlength=logits.shape[1])


def assert_fits(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """Chi-square goodness of fit on the support of ``expected_probs``; nothing outside it."""
    n = int(counts.sum())
    support = expected_probs > 0
    assert int(counts[~support].sum()) == 0, f"drew excluded tokens: {counts.tolist()}"
    observed = counts[support].double()
    expected = expected_probs[support].double() * n
    assert float(expected.min()) >= 5, "sample too small for a chi-square test"
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert stat < CHI2_999[df], (
        f"chi2={stat:.2f} (df={df}) counts={counts.tolist()} expected={expected.tolist()}"
    )


# ---------------------------------------------------------------- plugin and batch


def test_loads_through_the_plugin_manager() -> None:
    # Narrowed to this entry point so an unrelated half-written plugin cannot break the test.
    pm = PluginManager(allow=["samplers-standard"])
    s = pm.create("sampler", "standard", EngineConfig(), torch.device("cpu"))
    assert isinstance(s, Sampler)
    assert isinstance(s, StandardSampler)
    assert pm.get("sampler", "standard").module == "pitstop.plugins.samplers.standard"
    out = s.sample(torch.randn(3, 11), batch_of([SamplingParams()] * 3))
    assert out.token_ids.shape == (3,) and out.token_ids.dtype == torch.int64


def test_make_sampling_batch_flags() -> None:
    b = batch_of(
        [
            SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1),
            SamplingParams(temperature=0.8, top_k=1),
            SamplingParams(temperature=0.8, top_p=0.9, logprobs=0),
        ],
        [None, 3, None],
    )
    assert b.temperature.tolist() == pytest.approx([0.0, 0.0, 0.8])
    assert b.top_k.tolist() == [-1, -1, -1]
    assert b.top_k.dtype == torch.int64 and b.temperature.dtype == torch.float32
    assert b.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert not b.all_greedy and not b.needs_top_k and b.needs_top_p and not b.needs_min_p
    assert b.want_logprobs
    assert b.generators[0] is None and isinstance(b.generators[1], torch.Generator)
    g = batch_of([SamplingParams(temperature=0), SamplingParams(top_k=1)])
    assert g.all_greedy and not g.want_logprobs
    with pytest.raises(ValueError):
        make_sampling_batch([SamplingParams()], [], CPU)


# ---------------------------------------------------------------- determinism and greedy


def test_same_seed_same_tokens_whatever_the_rest_of_the_batch() -> None:
    torch.manual_seed(0)
    vocab = 50
    mine = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=40)

    def run(others: int, position: int, other_seed: int) -> list[int]:
        gen = make_generator(42, CPU)
        s = sampler(seed=other_seed)
        tokens = []
        for step in range(20):
            other_logits = torch.randn(
                others, vocab, generator=torch.Generator().manual_seed(step + other_seed)
            )
            rows = list(other_logits)
            rows.insert(position, mine)
            logits = torch.stack(rows)
            ps = [SamplingParams(temperature=0.5 + 0.1 * i) for i in range(others)]
            ps.insert(position, params)
            gens: list[torch.Generator | None] = [None] * others
            gens.insert(position, gen)
            out = s.sample(logits, make_sampling_batch(ps, gens, CPU))
            tokens.append(int(out.token_ids[position]))
        return tokens

    alone = run(0, 0, 0)
    assert run(3, 1, 7) == alone
    assert run(7, 7, 99) == alone
    assert len(set(alone)) > 1  # it really sampled
    # Another seed gives another sequence.
    gen = make_generator(43, CPU)
    other = [
        int(
            sampler()
            .sample(mine.unsqueeze(0), make_sampling_batch([params], [gen], CPU))
            .token_ids[0]
        )
        for _ in range(20)
    ]
    assert other != alone


def test_unseeded_rows_follow_the_config_seed() -> None:
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(5))
    b = batch_of([SamplingParams()] * 16)
    a = sampler(seed=3).sample(logits, b).token_ids
    assert torch.equal(a, sampler(seed=3).sample(logits, b).token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_temperature_zero_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(1)).to(dtype)
    b = batch_of([SamplingParams(temperature=0.0)] * 32)
    out = sampler().sample(logits, b)
    assert torch.equal(out.token_ids, logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_batch_takes_the_argmax_without_a_float32_copy(dtype: torch.dtype) -> None:
    """All rows greedy, no processor, no log-probs: the argmax on the logits' own dtype, which
    is the float32 argmax (ties included: both take the first), and no [B, V] float32 copy."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 1000, generator=gen).to(dtype)
    logits[:, 500] = logits.max(dim=-1).values  # a tie with each row's first maximum
    logits[3] = 0.0  # a row of equal values: the first index
    b = batch_of([SamplingParams(temperature=0.0)] * 64)
    seen: list[torch.dtype] = []

    class Watched(StandardSampler):
        @staticmethod
        def process(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
            seen.append(raw.dtype)
            return StandardSampler.process(raw, batch)

    out = Watched(CPU).sample(logits, b)
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.token_ids[3] == 0 and seen == []
    # a processor (a penalty here) or log-probs take the float32 path again
    for params in (
        SamplingParams(temperature=0.0, logit_bias={7: 50.0}),
        SamplingParams(temperature=0.0, logprobs=1),
    ):
        batch = batch_of([params] * 64)
        out = Watched(CPU).sample(logits, batch)
        assert seen[-1] == torch.float32
        assert torch.equal(out.token_ids, sampler().process(logits.float(), batch).argmax(-1))


@pytest.mark.parametrize("temperature", [0.01, 0.3, 1.0, 5.0, 100.0])
def test_top_k_one_is_argmax_at_any_temperature(temperature: float) -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=temperature, top_k=1)] * 32
    expected = logits.argmax(-1)
    assert torch.equal(sampler().sample(logits, batch_of(params)).token_ids, expected)
    # The same through the sampling path itself (a batch that does not mark the rows greedy).
    b = SamplingBatch(
        temperature=torch.full((32,), temperature),
        top_k=torch.ones(32, dtype=torch.int64),
        top_p=torch.ones(32),
        min_p=torch.zeros(32),
        generators=[None] * 32,
        all_greedy=False,
        needs_top_k=True,
        needs_top_p=False,
        needs_min_p=False,
    )
    assert torch.equal(sampler().sample(logits, b).token_ids, expected)


def test_greedy_rows_mixed_with_sampled_rows() -> None:
    vocab = 20
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, top_p=0.3),
        SamplingParams(temperature=2.0, top_k=3),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.0),
    ]
    s = sampler()
    greedy = [0, 2, 5]
    seen_sampled: set[tuple[int, int]] = set()
    for i in range(50):
        b = batch_of(params, [None, i, None, None, None, 7])
        out = s.sample(logits, b)
        assert torch.equal(out.token_ids[greedy], logits[greedy].argmax(-1))
        probs = s.probabilities(logits, b)
        assert bool((probs.gather(1, out.token_ids.unsqueeze(1)) > 0).all())
        seen_sampled.update((r, int(out.token_ids[r])) for r in (1, 3, 4))
    assert len(seen_sampled) > 3  # the sampled rows did vary
    probs = s.probabilities(logits, batch_of(params))
    assert torch.equal(
        probs[greedy], torch.nn.functional.one_hot(logits[greedy].argmax(-1), vocab).float()
    )


# ---------------------------------------------------------------- distributions (chi-square)


def test_temperature_distribution() -> None:
    expected = torch.softmax(LOGITS8.double() / 0.7, -1)
    assert_fits(draw_counts(LOGITS8, SamplingParams(temperature=0.7), 20_000), expected)


def test_temperature_distribution_of_one_seeded_request_over_steps() -> None:
    s = sampler()
    gen = make_generator(2024, CPU)
    b = make_sampling_batch([SamplingParams(temperature=0.7, seed=2024)], [gen], CPU)
    logits = LOGITS8.unsqueeze(0)
    tokens = torch.cat([s.sample(logits, b).token_ids for _ in range(3000)])
    assert_fits(torch.bincount(tokens, minlength=8), torch.softmax(LOGITS8.double() / 0.7, -1))


def test_top_k_distribution() -> None:
    scaled = LOGITS8.double() / 0.7
    expected = torch.zeros(8, dtype=torch.float64)
    expected[:3] = torch.softmax(scaled[:3], -1)
    params = SamplingParams(temperature=0.7, top_k=3)
    assert_fits(draw_counts(LOGITS8, params, 20_000), expected)


def test_top_p_distribution() -> None:
    scaled = LOGITS8.double() / 0.7
    full = torch.softmax(scaled, -1)
    # Smallest prefix reaching 0.8; LOGITS8 is sorted, so the prefix is the first tokens.
    keep = int((torch.cumsum(full, 0) < 0.8).sum()) + 1
    assert 2 < keep < 8
    expected = torch.zeros(8, dtype=torch.float64)
    expected[:keep] = full[:keep] / full[:keep].sum()
    params = SamplingParams(temperature=0.7, top_p=0.8)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])  # the order of the vocab must not matter
    counts = draw_counts(LOGITS8[perm], params, 20_000)
    assert_fits(counts, expected[perm])


def test_top_k_then_top_p_then_min_p_distribution() -> None:
    scaled = LOGITS8.double() / 0.7
    expected = torch.zeros(8, dtype=torch.float64)
    top5 = torch.softmax(scaled[:5], -1)  # top-k 5
    keep = int((torch.cumsum(top5, 0) < 0.9).sum()) + 1  # then top-p 0.9 of what is left
    p = top5[:keep] / top5[:keep].sum()
    p = torch.where(p >= 0.3 * p.max(), p, torch.zeros_like(p))  # then min-p 0.3
    expected[:keep] = p / p.sum()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.3)
    assert_fits(draw_counts(LOGITS8, params, 20_000), expected)
    b = batch_of([params])
    assert torch.allclose(
        sampler().probabilities(LOGITS8.unsqueeze(0), b)[0].double(), expected, atol=1e-6
    )


# ---------------------------------------------------------------- filters never leak (Hypothesis)


def _excluded_top_p(scaled: torch.Tensor, top_p: float, slack: float = 1e-4) -> torch.Tensor:
    """Tokens that top-p clearly drops (float64 reference, with slack at the boundary).

    Token i is dropped when the tokens clearly more likely than it already hold
    ``top_p``; near-ties may sort either way, so they never count as "before" it.
    """
    probs = torch.softmax(scaled.double(), -1)
    clearly_more = probs.unsqueeze(0) > probs.unsqueeze(1) + slack  # [i, j]: j clearly above i
    before = (clearly_more * probs.unsqueeze(0)).sum(1)
    return before >= top_p + slack


def _excluded_min_p(scaled: torch.Tensor, min_p: float, slack: float = 1e-5) -> torch.Tensor:
    """Tokens that min-p clearly drops (float64 reference)."""
    probs = torch.softmax(scaled.double(), -1)
    return probs < min_p * probs.max() - slack


logit_rows = st.lists(
    st.floats(min_value=-20, max_value=20, allow_nan=False, allow_infinity=False),
    min_size=2,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    row=logit_rows,
    temperature=st.floats(min_value=0.05, max_value=3.0),
    top_p=st.floats(min_value=0.01, max_value=1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_top_p_never_emits_an_excluded_token(
    row: list[float], temperature: float, top_p: float, seed: int
) -> None:
    logits = torch.tensor(row)
    n = 64
    params = SamplingParams(temperature=temperature, top_p=top_p)
    b = batch_of([params] * n, [seed + i for i in range(n)])
    s = sampler(seed)
    tokens = s.sample(logits.expand(n, -1), b).token_ids
    excluded = _excluded_top_p(logits / temperature, top_p)
    assert not bool(excluded[tokens].any())
    probs = s.probabilities(logits.unsqueeze(0), batch_of([params]))[0]
    assert not bool((probs[excluded] > 0).any())
    assert bool((probs[tokens] > 0).all())
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    row=logit_rows,
    temperature=st.floats(min_value=0.05, max_value=3.0),
    min_p=st.floats(min_value=0.0, max_value=1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_min_p_never_emits_an_excluded_token(
    row: list[float], temperature: float, min_p: float, seed: int
) -> None:
    logits = torch.tensor(row)
    n = 64
    params = SamplingParams(temperature=temperature, min_p=min_p)
    s = sampler(seed)
    tokens = s.sample(logits.expand(n, -1), batch_of([params] * n)).token_ids
    excluded = _excluded_min_p(logits / temperature, min_p)
    assert not bool(excluded[tokens].any())
    probs = s.probabilities(logits.unsqueeze(0), batch_of([params]))[0]
    assert not bool((probs[excluded] > 0).any())
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(2, 64),
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 2, 5, 100]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
)
def test_probabilities_sum_to_one_and_vanish_exactly_on_excluded_tokens(
    rows: int, vocab: int, seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    b = batch_of([params] * rows)
    s = sampler(seed)
    probs = s.probabilities(logits, b)
    assert probs.shape == (rows, vocab) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(rows), atol=1e-5)
    # Reference, in float64, of the kept set: top-k (ties kept), then top-p, then min-p.
    for r in range(rows):
        row = logits[r].double()
        if temperature == 0 or top_k == 1:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[row.argmax()] = True
        else:
            scaled = row / temperature
            keep = torch.ones(vocab, dtype=torch.bool)
            if top_k != -1 and top_k < vocab:
                keep &= scaled >= scaled.sort(descending=True).values[top_k - 1]
            masked = scaled.masked_fill(~keep, -math.inf)
            if top_p < 1:
                keep &= ~_excluded_top_p(masked, top_p, slack=0.0)
            masked = scaled.masked_fill(~keep, -math.inf)
            p = torch.softmax(masked, -1)
            keep &= p >= min_p * p.max()
        # randn logits times 4 leave no float32 boundary ties in practice; compare exactly.
        assert torch.equal(probs[r] > 0, keep), (r, probs[r].tolist(), keep.tolist())
    # Whatever is sampled has positive probability.
    tokens = s.sample(logits, b).token_ids
    assert bool((probs.gather(1, tokens.unsqueeze(1)) > 0).all())


# ---------------------------------------------------------------- logprobs


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.7, top_k=5, logprobs=0),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.1, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = sampler().sample(logits, batch_of(params, [None, 1, None, 2, None]))
    assert (
        out.logprobs is not None
        and out.logprobs.dtype == torch.float32
        and out.logprobs.shape == (5,)
    )
    ref = torch.log_softmax(logits.float(), -1).gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.logprobs, ref)
    assert sampler().sample(logits, batch_of([SamplingParams()] * 5)).logprobs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_rows_and_device() -> None:
    dev = torch.device("cuda")
    s = StandardSampler(dev, seed=0)
    logits = torch.randn(4, 1000, device=dev, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, logprobs=0)] * 4

    def run(extra: int) -> int:
        gens = [make_generator(11, dev)] + [None] * (3 + extra)
        lg = torch.cat([logits, torch.randn(extra, 1000, device=dev, dtype=torch.bfloat16)])
        out = s.sample(lg, make_sampling_batch(params + params[:1] * extra, gens, dev))
        assert out.token_ids.device.type == "cuda" and out.logprobs is not None
        return int(out.token_ids[0])

    assert run(0) == run(5)
    assert (
        s.probabilities(logits, make_sampling_batch(params, [None] * 4, dev)).device.type == "cuda"
    )
