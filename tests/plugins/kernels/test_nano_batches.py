"""Nano-batches (``fused.nano_batch_rows``, issue 44): a large decode step in two halves.

A decode step of at least ``fused.nano_batch_rows`` sequences runs as two halves, each
with the step's metadata sliced to its rows and (on CUDA) on its own stream and split-K
workspace lane. The halves' arithmetic is the whole step's: whole models match
transformers token for token (fp32, greedy) with the split on, through chunked prefill
(never split) and decode (split), with CUDA graphs on the GPU. Triton's interpreter runs
the fused kernels on a machine without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers.checkpoints import greedy_continuation, hf_model  # noqa: E402
from helpers.models import make_tiny_checkpoint  # noqa: E402

from pitstop import LLM, SamplingParams  # noqa: E402
from pitstop.errors import ConfigError  # noqa: E402
from pitstop.plugins.kernels import nano_batches  # noqa: E402
from pitstop.testing.kernels import metadata_from_tables  # noqa: E402

pytest.importorskip("triton")

MAX_TOKENS = 5
VOCAB = 512


def test_split_slices_a_decode_step_by_rows() -> None:
    """Each half's metadata is the step's rows ``[lo, hi)``: views of its tensors, query
    offsets from zero, the step's max context kept; prefill and small steps stay whole."""
    tables = [[3, 4], [5], [6, 7, 8], [9], [10, 11]]
    ctx = [20, 9, 40, 1, 17]
    meta = metadata_from_tables([1] * 5, ctx, tables, 16)
    nb = nano_batches.NanoBatches(4, torch.device("cpu"), lambda i: None)
    halves = nb.split(meta)
    assert halves is not None
    (rows_a, a), (rows_b, b) = halves
    assert (rows_a, rows_b) == (slice(0, 3), slice(3, 5))
    assert a.num_decodes == 3 and b.num_decodes == 2 and a.num_prefills == b.num_prefills == 0
    assert torch.equal(b.positions, meta.positions[3:5])
    assert torch.equal(b.slot_mapping, meta.slot_mapping[3:5])
    assert torch.equal(b.block_tables, meta.block_tables[3:5])
    assert torch.equal(b.context_lens, meta.context_lens[3:5])
    assert b.cu_query_lens.tolist() == [0, 1, 2]
    assert b.context_lens_list == ctx[3:] and a.max_context_len == b.max_context_len == 40
    assert b.block_tables.data_ptr() == meta.block_tables[3].data_ptr(), "a view"
    assert nb.split(metadata_from_tables([1] * 3, ctx[:3], tables[:3], 16)) is None
    mixed = metadata_from_tables([4, 1, 1, 1, 1], ctx, tables, 16)
    assert nb.split(mixed) is None, "a step with a prefill runs whole"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nano")
    return make_tiny_checkpoint(root, "qwen3", seed=5, with_tokenizer=False, vocab_size=VOCAB)


def _check(tiny: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> LLM:
    split = nano_batches.NanoBatches.split
    taken = []

    def counted(self, meta):  # noqa: ANN001, ANN202
        halves = split(self, meta)
        taken.append(halves is not None)
        return halves

    monkeypatch.setattr(nano_batches.NanoBatches, "split", counted)
    llm = LLM(
        str(tiny),
        device=device,
        dtype="float32",
        kv_cache_gib=0.01,
        max_model_len=128,
        poison_memory=True,
        kernels="fused",
        options={"fused.nano_batch_rows": 4},
        scheduler="chunked",
        chunk_size=32,
    )
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 9, 30, 3, 12)]
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    model = hf_model(tiny)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == greedy_continuation(model, prompt, MAX_TOKENS), len(prompt)
    assert any(taken), "some decode step should have run in two halves"
    return llm


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's test (GPU: below)")
def test_split_decode_steps_match_transformers(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the halves run one after the other: the same tokens as transformers."""
    _check(tiny, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
def test_on_the_gpu_two_streams_with_cuda_graphs(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA: the halves on two streams (forked and joined inside the captured decode
    graphs), each with its own split-K workspace; transformers' tokens."""
    llm = _check(tiny, "cuda", monkeypatch)
    assert llm.engine.runner.graphs is not None, "decode should run from CUDA graphs"


def test_refused_with_the_one_launch_merge(tiny: Path) -> None:
    with pytest.raises(ConfigError, match="decode_merge=separate"):
        LLM(
            str(tiny), device="cpu", kv_cache_gib=0.01, max_model_len=64, kernels="fused",
            options={"fused.nano_batch_rows": 8, "fused.decode_merge": "last-program"},
        )  # fmt: skip
