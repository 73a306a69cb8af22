"""The fused decoder layer (``fused.layer``, issue 44): the norms' gains folded into the
projections at load, the residual adds inside the O and down projections, SiLU·mul inside
the gate-up projection. Whole models match transformers (fp32, greedy) with it on, through
prefill, chunked prefill and decode; the model falls back to the unfused layer wherever
folding would not be exact (weights not dense); the kernel set reports its ops."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # the fused layer's Triton GEMMs run in Triton's interpreter on the CPU (as in
    # tests/plugins/kernels/test_fused_kernels.py, set before anything imports triton)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from helpers.checkpoints import TINY_VOCAB, hf_model, prefill_logits, relative_error  # noqa: E402

from pitstop.entrypoints.llm import LLM  # noqa: E402
from pitstop.entrypoints.sampling_params import SamplingParams  # noqa: E402
from pitstop.plugins.kernels import reference  # noqa: E402

LAYER = {"fused.layer": True}
# greedy tokens compared after each prompt: a prefill, then decode steps, every one a whole
# model run in Triton's interpreter on the CPU (about 0.6 s a step); the 30-token prompt's
# decodes still write across its page border (32)
MAX_TOKENS = 4


def _checkpoint(tmp_path: Path, arch: str, **overrides) -> Path:
    """A tiny random ``arch`` checkpoint whose RMSNorm gains are far from one (U[0.5, 1.5]),
    so that a gain folded into the wrong weight, or twice, changes the logits."""
    from helpers.models import make_tiny_checkpoint

    overrides.setdefault("vocab_size", TINY_VOCAB)
    return make_tiny_checkpoint(
        tmp_path, arch, seed=7, with_tokenizer=False, norm_gains=(0.5, 1.5), **overrides
    )


UNFUSED = {"fused.layer": False}  # the unfused layer, whatever the default


def _fused_llm(folder: Path, **extra) -> LLM:
    options = {**LAYER, **extra.pop("options", {})}
    return LLM(
        str(folder),
        device="cpu",
        kv_cache_gib=0.01,
        max_model_len=128,
        kernels="fused",
        options=options,
        **extra,
    )


CASES = {
    "llama": ("llama", {}),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-qk-norm-apart": ("qwen3", {}),
}


@pytest.mark.parametrize(
    "case,layer_rows",
    [(case, 64) for case in CASES if case != "qwen3-qk-norm-apart"]
    + [("llama-biases", 0), ("qwen3", 0), ("qwen3-qk-norm-apart", 0)],
)
def test_fused_layer_matches_transformers(tmp_path: Path, case: str, layer_rows: int) -> None:
    """``layer_rows`` 0: every step takes the cuBLAS way (the row scale inside rotary and
    SiLU·mul, the residual added in place; with biases, or with Qwen3's q/k norms run apart
    from rotary, ``fused.qk_norm`` off, the scale before the QKV GEMM)."""
    arch, overrides = CASES[case]
    folder = _checkpoint(tmp_path, arch, **overrides)
    hf = hf_model(folder)
    options = {"fused.layer_rows": layer_rows}
    if case == "qwen3-qk-norm-apart":
        options["fused.qk_norm"] = False
    llm = _fused_llm(folder, options=options)
    model = llm.engine.runner.model
    assert model.fused_layers and all(layer.fused for layer in model.layers)
    _assert_matches(llm, hf, lengths=(1, 7, 30), seed=3)


def _assert_matches(llm: LLM, hf: object, lengths: tuple[int, ...], seed: int) -> None:
    """Prefill logits within 1e-4 of transformers' and greedy tokens identical, for random
    prompts of ``lengths`` run as one batch."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in lengths]
    for p, mine in zip(prompts, prefill_logits(llm, prompts), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        assert relative_error(mine, ref) < 1e-4
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )[0, len(p) :].tolist()
        assert out.token_ids == ref, f"greedy tokens differ at prompt length {len(p)}"


def test_fused_layer_equals_unfused_through_chunks_and_decode(tmp_path: Path) -> None:
    """Chunked prefill (prompts cut into 5-token chunks mixed with decodes) gives the same
    greedy tokens with the fused layer as without it."""
    folder = _checkpoint(tmp_path, "qwen3")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 26)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chunked = dict(scheduler="chunked", chunk_size=5)
    fused = _fused_llm(folder, **chunked).generate(prompt_token_ids=prompts, sampling_params=params)
    plain = _fused_llm(folder, options=UNFUSED, **chunked).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]


def test_norm_gains_are_folded_once(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, "llama")
    plain = _fused_llm(folder, options=UNFUSED)
    fused = _fused_llm(folder)
    a, b = plain.engine.runner.model.layers[0], fused.engine.runner.model.layers[0]
    expected = a.self_attn.qkv_proj * a.input_layernorm[None, :]
    torch.testing.assert_close(b.self_attn.qkv_proj, expected, rtol=1e-6, atol=0)
    expected = a.mlp.gate_up_proj * a.post_attention_layernorm[None, :]
    torch.testing.assert_close(b.mlp.gate_up_proj, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.self_attn.o_proj, a.self_attn.o_proj, rtol=0, atol=0)


def test_describe_names_the_layer_ops(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, "llama")
    on = _fused_llm(folder).engine.runner.kernels.describe()
    off = _fused_llm(folder, options=UNFUSED)
    off_desc = off.engine.runner.kernels.describe()
    for op in reference.LAYER_OPS:
        assert on[op] == (
            "triton up to 64 rows, else cuBLAS (row scale in rope_and_store / silu_and_mul, "
            "residual added in place)"
        ), on[op]
        assert off_desc[op] == "unused (config flag fused.layer is off)"
    assert not off.engine.runner.model.fused_layers


def test_fused_layer_needs_merged_projections(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path, "llama")
    llm = _fused_llm(folder, options={"fused.qkv": False})
    assert not llm.engine.runner.model.fused_layers
    assert llm.engine.runner.kernels.describe()["norm_linear"] == "unused (fused_qkv is off)"


@pytest.mark.parametrize("rows", [1, 5])
def test_reference_layer_ops_are_the_unfused_arithmetic(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 32, generator=gen)
    w = torch.randn(48, 32, generator=gen)
    g = torch.rand(32, generator=gen) + 0.5
    b = torch.randn(48, generator=gen)
    normed = reference.rms_norm(x, g, 1e-6)[0]
    torch.testing.assert_close(
        reference.norm_linear(x, w * g[None, :], 1e-6, b),
        torch.nn.functional.linear(normed, w, b),
    )
    torch.testing.assert_close(
        reference.norm_gate_up(x, w * g[None, :], 1e-6),
        reference.silu_and_mul(torch.nn.functional.linear(normed, w)),
    )
    r = torch.randn(rows, 48, generator=gen)
    torch.testing.assert_close(reference.linear_residual(x, w, r, b), r + x @ w.T + b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
def test_fused_layer_with_cuda_graphs_matches_reference_on_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU in float32: the fused layer's Triton GEMMs (short steps, captured in CUDA
    graphs, and the cuBLAS path above ``layer_rows``) give the reference kernels' greedy tokens,
    through chunks mixed with decodes, and every page comes back."""
    folder = _checkpoint(tmp_path, "qwen3", num_hidden_layers=3, head_dim=64)
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 40, 130, 7)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 5, 24, 12, 40)
    ]

    def run(**settings) -> list[list[int]]:
        llm = LLM(
            str(folder),
            device="cuda",
            dtype="float32",
            max_model_len=256,
            kv_cache_gib=0.25,
            **settings,
        )
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = llm.engine.allocator.stats()
        assert stats.pages_free == stats.num_pages
        return [o.token_ids for o in outs]

    expected = run(kernels="reference")
    layer = dict(kernels="fused", fused_precision="fp32", scheduler="chunked", chunk_size=32)
    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path / "cache"))
    assert run(options={"fused.layer": True}, **layer) == expected
    # each op's Triton-or-cuBLAS choice was timed before the graphs were captured, and kept
    choices = json.loads((tmp_path / "cache" / "fused_layer.json").read_text())
    assert {key.split("|")[0] for key in choices} == {
        "norm_linear",
        "norm_gate_up",
        "linear_residual",
    }, choices
    assert run(options={"fused.layer": True, "fused.layer_tune": False}, **layer) == expected
    # every step through the cuBLAS path (the row scale deferred to rotary and SiLU·mul, the
    # residual added in place)
    assert run(options={"fused.layer": True, "fused.layer_rows": 0}, **layer) == expected


def test_moe_models_fuse_their_attention_half(tmp_path: Path) -> None:
    """A Qwen3-MoE checkpoint with a dense layer between sparse ones (``mlp_only_layers``):
    with ``fused.layer`` the dense layer runs fused whole, the sparse ones their attention
    half (the input norm's gain folded into ``qkv_proj``) and their post-attention norm
    inside the MoE op (its gain folded into the router and the experts' gate-up rows, once),
    and the model matches transformers (fp32, greedy) through prefill and decode; the MoE
    op (in the interpreter) takes the router's weight and projects, routes and groups
    decode steps of one and two tokens in one launch (with each token's 1/rms), and adds its output to the
    residual stream in its last kernel. With ``fused.moe_router`` off the op takes no norm:
    the sparse layers keep their norm launch and their weights unfolded, same tokens."""
    from pitstop.plugins.models.moe import SparseDecoderLayer

    folder = _checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    hf = hf_model(folder)
    llm = _fused_llm(folder)
    model = llm.engine.runner.model
    assert model.fused_layers and all(layer.fused for layer in model.layers)
    sparse = [isinstance(layer, SparseDecoderLayer) for layer in model.layers]
    assert sparse == [True, False, True]
    block = model.layers[0].mlp
    assert block.moe_takes_router and block.adds_residual and block.takes_norm
    plain = _fused_llm(folder, options=UNFUSED)
    a, b = plain.engine.runner.model.layers[0], model.layers[0]
    gain = a.post_attention_layernorm[None, :]
    torch.testing.assert_close(b.mlp.router, a.mlp.router * gain, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.mlp.gate_up, a.mlp.gate_up * gain, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.mlp.down, a.mlp.down, rtol=0, atol=0)
    _assert_matches(llm, hf, lengths=(1, 9), seed=5)
    _assert_matches(llm, hf, lengths=(6,), seed=6)  # decode steps of one token: one row a block
    off = _fused_llm(folder, options={"fused.moe_router": False})
    block = off.engine.runner.model.layers[0].mlp
    assert not block.takes_norm
    torch.testing.assert_close(block.router, a.mlp.router, rtol=0, atol=0)
    _assert_matches(off, hf, lengths=(1, 9), seed=5)


def test_the_layer_is_fused_by_default_on_a_gpu(tmp_path: Path) -> None:
    """``fused.layer`` unset: on where its ops run in Triton on a GPU, adapters or not; off
    on the CPU (the reference's ops, no faster); set, it decides everywhere."""
    from pitstop.plugins.kernels.fused import layer_wanted

    assert layer_wanted(None, True) == (True, "")
    assert layer_wanted(None, False) == (
        False,
        "fused.layer unset: its ops would not run in Triton on a GPU",
    )
    assert layer_wanted(True, False)[0] is True
    assert layer_wanted(False, True)[0] is False
    folder = _checkpoint(tmp_path, "llama", num_hidden_layers=1)
    with LLM(
        str(folder), device="cpu", kv_cache_gib=0.01, max_model_len=64, kernels="fused"
    ) as llm:
        assert not llm.engine.runner.model.fused_layers
        status = llm.engine.runner.kernels.describe()
        assert "its ops would not run in Triton on a GPU" in str(status), status
