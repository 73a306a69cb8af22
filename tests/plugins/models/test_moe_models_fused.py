"""The ``fused`` kernel set serves mixture-of-experts models: its Triton ``moe`` op (in
Triton's interpreter on the CPU) inside a whole tiny Qwen3-MoE, and a Qwen2-MoE with its
shared expert, gives transformers' tokens,
and on a GPU the fused set gives the reference set's tokens, CUDA graphs included."""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # the Triton ops run in the interpreter on the CPU (set before anything imports triton)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from helpers.checkpoints import TINY_VOCAB, assert_matches_transformers, hf_model  # noqa: E402
from helpers.models import make_tiny_checkpoint  # noqa: E402

from pitstop.entrypoints.llm import LLM  # noqa: E402
from pitstop.entrypoints.sampling_params import SamplingParams  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE: layer 1 sparse (8 experts, top-2), layer 0 dense."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3-moe"),
        "qwen3_moe",
        with_tokenizer=False,
        vocab_size=TINY_VOCAB,
        num_hidden_layers=2,
        decoder_sparse_step=2,
    )


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-MoE: one sparse layer with a shared expert (merged gate-up here)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen2-moe"),
        "qwen2_moe",
        with_tokenizer=False,
        vocab_size=TINY_VOCAB,
        num_hidden_layers=1,
    )


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_fused_kernels_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    """Every op but ``linear`` in Triton (the interpreter here), the projections merged,
    prompts chunked over steps."""
    folder = request.getfixturevalue(arch)
    assert_matches_transformers(
        folder,
        hf_model(folder),
        lengths=(3, 21),
        max_tokens=4,
        kernels="fused",
        scheduler="chunked",
        chunk_size=16,
    )


def _logits_and_tokens(folder: Path, device: str = "cpu", **settings) -> tuple[list, list]:
    """Every step's logits and the greedy tokens of three prompts (chunked beside decodes)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(
        str(folder),
        device=device,
        dtype="float32",
        kv_cache_gib=0.02,
        max_model_len=128,
        scheduler="chunked",
        chunk_size=16,
        poison_memory=True,
        **settings,
    )
    seen: list[torch.Tensor] = []
    llm.engine.observe_logits(lambda inputs, seqs, logits: seen.append(logits.float().cpu()))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    return seen, [o.token_ids for o in outs]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_experts_in_the_fused_op_equal_the_reference_loop(qwen3_moe: Path, device: str) -> None:
    """``weights="fp8"``: the Triton op's weight-only GEMMs over e4m3 experts (the interpreter
    on the CPU) and the reference loop over the same experts widened give the same tokens,
    their logits within float32 summation order."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fused = _logits_and_tokens(qwen3_moe, device, kernels="fused", weights="fp8")
    reference = _logits_and_tokens(qwen3_moe, device, kernels="reference", weights="fp8")
    assert fused[1] == reference[1]
    assert len(fused[0]) == len(reference[0])
    for got, want in zip(fused[0], reference[0], strict=True):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [False, True], ids=["", "fused-layer"])
def test_fused_set_serves_the_reference_sets_tokens_on_the_gpu(
    qwen3_moe: Path, layer: bool
) -> None:
    """On the GPU, fp32: the fused set (Triton MoE, decode in CUDA graphs; with ``fused.layer``
    the sparse layer's attention half fused too) and the reference set (the loop over
    experts, eager) give the same greedy tokens for a batch of prompts whose prefills are
    chunked beside decodes."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for kernels in ("fused", "reference"):
        llm = LLM(
            str(qwen3_moe),
            device="cuda",
            dtype="float32",
            kernels=kernels,
            kv_cache_gib=0.05,
            max_model_len=128,
            chunk_size=16,
            options={"fused.layer": True} if layer and kernels == "fused" else {},
        )
        runner = llm.engine.runner
        if kernels == "fused":
            assert runner.kernels.describe()["moe"] == "triton"
            assert runner.model.fused_layers == layer
            assert runner.graphs is not None  # the fused MoE op is captured with the rest
        else:
            assert runner.graphs is None  # the reference loop reads the experts hit on the host
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
        tokens[kernels] = [o.token_ids for o in outs]
        del llm, runner
        torch.cuda.empty_cache()
    assert tokens["fused"] == tokens["reference"]


def test_the_one_launch_router_can_be_turned_off(qwen3_moe: Path) -> None:
    """``fused.moe_router`` false: the sparse block takes its logits from ``linear`` (the set
    no longer declares ``moe_takes_router``), and the tokens are those with it on (both in
    the interpreter here: decode steps of two tokens take the one-launch router when on)."""
    on = _logits_and_tokens(qwen3_moe, kernels="fused")
    off_llm_settings = dict(kernels="fused", options={"fused.moe_router": False})
    off = _logits_and_tokens(qwen3_moe, **off_llm_settings)
    assert on[1] == off[1]
    for got, want in zip(on[0], off[0], strict=True):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    from pitstop.entrypoints.llm import LLM as _LLM

    llm = _LLM(
        str(qwen3_moe), device="cpu", kv_cache_gib=0.01, max_model_len=64, **off_llm_settings
    )
    assert not llm.engine.runner.kernels.moe_takes_router
    assert not llm.engine.runner.model.layers[1].mlp.moe_takes_router


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's test")
def test_weight_updates_keep_the_sparse_layers_norms_folded(qwen3_moe: Path, tmp_path) -> None:
    """``fused.layer`` folds the post-attention norm of a sparse layer into its router and
    its experts' gate-up rows (the op takes the norm): a weight update of every tensor gives
    a fresh engine's parameters bit for bit, and the norms given in a batch of their own
    after the rest gives them to one more rounding, and its tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    old = {}
    for file in sorted(qwen3_moe.glob("*.safetensors")):
        old.update(load_file(str(file)))
    gen = torch.Generator().manual_seed(1)
    new = {
        name: (0.5 + torch.rand(t.shape, generator=gen))
        if name.endswith("norm.weight")
        else t + 0.5 * t.std() * torch.randn(t.shape, generator=gen)
        for name, t in old.items()
    }
    folder = tmp_path / "changed"
    shutil.copytree(qwen3_moe, folder)
    for file in folder.glob("*.safetensors"):
        file.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(new, str(folder / "model.safetensors"))
    settings = dict(
        device="cpu", dtype="float32", kv_cache_gib=0.01, max_model_len=64, kernels="fused",
        options={"fused.layer": True, "fused.layer_rows": 0},
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 93, 40], [61, 8, 120, 33, 7]]

    def state(llm: LLM) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        params = {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        return params, [list(o.outputs[0].token_ids) for o in outs]

    with LLM(str(folder), **settings) as fresh:
        assert len(fresh.engine.runner.model.layers[1].norms_to_fold()) == 3  # qkv, router, experts
        want, tokens = state(fresh)
    with LLM(str(qwen3_moe), **settings) as llm:
        llm.update_weights(new.items())
        got, got_tokens = state(llm)
        assert all(torch.equal(got[n], want[n]) for n in want) and got_tokens == tokens
        llm.update_weights_from_disk(qwen3_moe)
        norms = {n: t for n, t in new.items() if n.endswith("norm.weight")}
        llm.update_weights((n, t) for n, t in new.items() if n not in norms)
        llm.update_weights(norms.items())
        got, got_tokens = state(llm)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=2e-6, atol=1e-7, msg=name)
        assert got_tokens == tokens
