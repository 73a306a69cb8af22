"""Mixture-of-experts models (issue 48): tiny random Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints,
built with transformers' own config classes, give transformers' logits and greedy tokens
(fp32, poisoned memory, prompts chunked over several steps, then decode), with dense layers
among the sparse ones and ``norm_topk_prob`` either way; every configuration pitstop cannot
compute exactly is refused with the field named; the ``dummy:`` presets are the published
shapes."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from helpers.checkpoints import TINY_VOCAB, assert_matches_transformers, edit_config, hf_model
from helpers.models import make_tiny_checkpoint

from pitstop.entrypoints.llm import LLM
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.errors import ConfigError, ModelLoadError
from pitstop.loading.weights import load_model_source
from pitstop.plugins.models.llama_config import HF_FIELDS_READ, HF_FIELDS_WITHOUT_EFFECT
from pitstop.plugins.models.moe_config import (
    MOE_FIELDS_READ,
    MOE_FIELDS_WITHOUT_EFFECT,
    MoEModelConfig,
    moe_config_from_hf,
)
from pitstop.plugins.models.moe_presets import PRESETS

# prompts of 1 and 40 tokens, computed 16 tokens a step: the longer spans three steps, the
# shorter decodes beside its chunks
CHUNKED = dict(scheduler="chunked", chunk_size=16)

# (architecture, config overrides, the sparse layers pitstop must read)
ACCEPTED = {
    # layers 1 and 3 sparse, 0 and 2 dense SwiGLU (decoder_sparse_step=2)
    "qwen3-moe-sparse-step": (
        "qwen3_moe",
        dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=True),
        (1, 3),
    ),
    # layer 0 dense (mlp_only_layers), top-3 of 6 experts without renormalisation
    "qwen3-moe-mlp-only-no-norm": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            mlp_only_layers=[0],
            norm_topk_prob=False,
            num_experts=6,
            num_experts_per_tok=3,
        ),
        (1, 2),
    ),
    # a shared expert beside the routed ones, q/k/v biases, top-2 of 8 not renormalized
    "qwen2-moe-shared-expert": ("qwen2_moe", dict(num_hidden_layers=2), (0, 1)),
    # a window that never cuts (max_model_len 128), and the train-only jitter set
    "mixtral": ("mixtral", dict(sliding_window=128, router_jitter_noise=0.1), (0, 1)),
}


def _tiny(tmp_path: Path, arch: str, **overrides) -> Path:
    overrides.setdefault("vocab_size", TINY_VOCAB)
    return make_tiny_checkpoint(tmp_path, arch, with_tokenizer=False, **overrides)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE checkpoint (2 sparse layers, 8 experts, top-2), read-only."""
    return _tiny(tmp_path_factory.mktemp("qwen3-moe"), "qwen3_moe")


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_tiny_checkpoints_match_transformers_through_chunked_prefill(
    tmp_path: Path, case: str
) -> None:
    arch, overrides, sparse = ACCEPTED[case]
    folder = _tiny(tmp_path, arch, **overrides)
    hf = hf_model(folder)
    cfg = load_model_source(str(folder)).model_config
    assert isinstance(cfg, MoEModelConfig) and cfg.sparse_layers == sparse
    # every expert is resident: the engine sizes memory by all of them
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    assert_matches_transformers(folder, hf, lengths=(1, 40), max_tokens=5, **CHUNKED)


def test_config_reads_every_moe_field(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1, 9])
    cfg = load_model_source(str(folder)).model_config
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and not cfg.routing_weights_float32
    assert cfg.sparse_layers == (0, 2, 3)  # an index past the last layer is ignored, as there
    mixtral = load_model_source(str(_tiny(tmp_path, "mixtral"))).model_config
    assert mixtral.norm_topk_prob and mixtral.routing_weights_float32
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 32)
    assert not mixtral.qk_norm and not mixtral.attention_bias
    qwen2 = load_model_source(str(_tiny(tmp_path, "qwen2_moe", qkv_bias=False))).model_config
    assert qwen2.shared_expert_intermediate_size == 48 and not qwen2.norm_topk_prob
    assert not qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm


def test_every_field_of_the_moe_config_classes_is_decided() -> None:
    """A field pitstop has not decided is refused when set (the dense family's rule); here
    none of transformers' Qwen3-MoE, Qwen2-MoE and Mixtral fields is left undecided."""
    import transformers

    generic = set(transformers.PreTrainedConfig().to_dict())
    decided = (
        generic
        | set(HF_FIELDS_READ)
        | set(HF_FIELDS_WITHOUT_EFFECT)
        | set(MOE_FIELDS_READ)
        | set(MOE_FIELDS_WITHOUT_EFFECT)
    )
    for cls in (
        transformers.Qwen3MoeConfig,
        transformers.Qwen2MoeConfig,
        transformers.MixtralConfig,
    ):
        assert set(cls().to_dict()) - decided == set(), cls.__name__


def _raw(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


REFUSED = {
    "top-k above the experts": ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    "no experts": ("mixtral", dict(num_local_experts=0), "num_local_experts=0"),
    "sparse step zero": ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    "activation": ("mixtral", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "norm_topk_prob not a bool": ("qwen3_moe", dict(norm_topk_prob="yes"), "norm_topk_prob"),
    "mlp_only_layers not indices": ("qwen3_moe", dict(mlp_only_layers="0"), "mlp_only_layers"),
    "quantized": (
        "qwen3_moe",
        dict(quantization_config={"quant_method": "fp8"}),
        "quantization_config",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_configurations_name_the_field(qwen3_moe: Path, tmp_path: Path, case: str) -> None:
    arch, changes, expected = REFUSED[case]
    folder = qwen3_moe if arch == "qwen3_moe" else _tiny(tmp_path, arch)
    with pytest.raises(ModelLoadError, match=expected.replace("(", r"\(")):
        moe_config_from_hf({**_raw(folder), **changes})


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "mixtral")
    edit_config(folder, sliding_window=64)
    with pytest.raises(ConfigError, match="sliding_window=64.*max_model_len <= 64"):
        LLM(str(folder), device="cpu", kv_cache_gib=0.01, max_model_len=128)


def test_gguf_weights_are_refused(qwen3_moe: Path) -> None:
    with pytest.raises(ConfigError, match="gguf"):
        LLM(str(qwen3_moe), device="cpu", kv_cache_gib=0.01, max_model_len=64, weights="gguf")


def test_fp8_experts_are_e4m3_and_run_close_to_dense(qwen3_moe: Path) -> None:
    """``weights="fp8"``: each expert in e4m3 with a scale per output row; the first step's
    logits within fp8's rounding of dense ones, the first greedy tokens equal, fewer bytes."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [9] * 20, [3]]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(**settings):
        llm = LLM(str(qwen3_moe), device="cpu", kv_cache_gib=0.01, max_model_len=64, **settings)
        seen: list[torch.Tensor] = []
        llm.engine.observe_logits(lambda inputs, seqs, logits: seen.append(logits.clone()))
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        return llm, [o.token_ids for o in outs], seen

    dense, dense_tokens, dense_logits = run()
    fp8, tokens, logits = run(weights="fp8")
    block = fp8.engine.runner.model.layers[0].mlp
    e, f, h = 8, block.cfg.moe_intermediate_size, block.cfg.hidden_size
    assert block.gate_up.dtype == block.down.dtype == torch.float8_e4m3fn
    assert block.gate_up_scale.shape == (e, 2 * f) and block.down_scale.shape == (e, h)
    assert block.router.dtype == torch.float32  # the router stays dense
    err = (logits[0] - dense_logits[0]).abs().max() / dense_logits[0].abs().max()
    assert err.item() <= 0.1  # fp8's rounding of every projection (0.1 for the dense models)
    assert [t[:1] for t in tokens] == [t[:1] for t in dense_tokens]
    assert fp8.engine.runner.weight_bytes() < 0.5 * dense.engine.runner.weight_bytes()


def test_the_moe_models_support_tensor_parallelism(qwen3_moe: Path) -> None:
    # exactness at tp=2: tests/plugins/executors/test_tensor_parallel.py
    from pitstop.plugin_system.protocols import ModelBase

    llm = LLM(str(qwen3_moe), device="cpu", kv_cache_gib=0.01, max_model_len=64)
    assert ModelBase.of(llm.engine.runner.model, "supports_tensor_parallel") is True


def test_missing_or_extra_experts_are_refused(qwen3_moe: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(qwen3_moe / "model.safetensors"))
    for name, change in (
        ("model.layers.0.mlp.experts.8.up_proj.weight", "map to nothing"),
        ("model.layers.1.mlp.experts.3.down_proj.weight", "lacks"),
    ):
        folder = tmp_path / change.replace(" ", "-")
        folder.mkdir()
        (folder / "config.json").write_text((qwen3_moe / "config.json").read_text())
        edited = dict(tensors)
        if name in edited:
            del edited[name]
        else:
            edited[name] = torch.zeros(32, 64)
        save_file(edited, str(folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=f"{change}.*{name.replace('.', r'.')}"):
            LLM(str(folder), device="cpu", kv_cache_gib=0.01, max_model_len=64)


# Qwen/Qwen3-30B-A3B's published config.json (the fields that shape the model)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_the_qwen3_30b_a3b_preset_is_the_published_config() -> None:
    preset = PRESETS["qwen3-30b-a3b"]
    read = moe_config_from_hf(QWEN3_30B_A3B)
    # generation_config.json adds <|endoftext|> as an end of sequence, as the dense presets do
    assert attrs.evolve(read, eos_token_ids=preset.eos_token_ids) == preset
    assert round(preset.num_params / 1e9, 1) == 30.5  # "30.5B in total, 3.3B activated"
    assert 3.3 <= preset.active_params / 1e9 < 3.4  # embedding and head counted
    source = load_model_source("dummy:qwen3-30b-a3b")
    assert source.model_config is preset
    assert round(PRESETS["mixtral-8x7b"].num_params / 1e9, 1) == 46.7


def test_dummy_weights_fill_every_expert() -> None:
    """A preset's dummy weights are drawn per checkpoint tensor, experts included (shrunk)."""
    from pitstop.plugins.kernels.reference import ReferenceKernels
    from pitstop.plugins.models.moe import MoEForCausalLM

    cfg = attrs.evolve(
        PRESETS["qwen3-30b-a3b"],
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        num_experts=4,
        moe_intermediate_size=8,
        num_experts_per_tok=2,
        sparse_layers=(1,),
    )
    model = MoEForCausalLM(cfg, ReferenceKernels(torch.device("cpu"), torch.float32))
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.init_dummy(seed=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.layers[1].mlp.gate_up.shape == (4 * 2 * 8, 32)
    assert model.layers[0].mlp.gate_proj.shape == (cfg.intermediate_size, 32)


def test_a_set_that_takes_the_router_gets_its_weight_and_no_logits() -> None:
    """A kernel set declaring ``moe_takes_router`` gets the router's weight (``router=``) and
    ``None`` logits, and projects ``x`` itself; one that does not gets the ``linear`` logits.
    The block's output is the same either way (here both project with torch's ``linear``)."""
    from pitstop.plugins.kernels import reference
    from pitstop.plugins.kernels.reference import ReferenceKernels
    from pitstop.plugins.models.moe import SparseMoeBlock

    calls: list[dict] = []

    def moe_op(x, logits, gate_up, down, top_k, *, router=None, residual=None, **kw):
        calls.append({"logits": logits, "router": router, "residual": residual})
        if logits is None:
            logits = torch.nn.functional.linear(x, router)
        out = reference.moe(x, logits, gate_up, down, top_k, **kw)
        return out if residual is None else residual + out

    cfg = attrs.evolve(
        PRESETS["qwen3-30b-a3b"], hidden_size=32, num_experts=4, moe_intermediate_size=8,
        num_experts_per_tok=2,
    )  # fmt: skip
    outs = []
    for takes_router in (False, True):
        kernels = ReferenceKernels(torch.device("cpu"), torch.float32)
        kernels._moe = moe_op
        kernels.moe_takes_router = takes_router
        block = SparseMoeBlock(cfg, kernels, True, kernels.linear)
        for p in block.parameters():
            p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        outs.append(block(torch.randn(3, 32, generator=torch.Generator().manual_seed(4))))
    assert calls[0]["router"] is None and calls[0]["logits"].shape == (3, 4)
    assert calls[1]["logits"] is None and calls[1]["router"].shape == (4, 32)
    assert torch.equal(outs[0], outs[1])
    assert not block.adds_residual  # the set does not declare moe_adds_residual
    kernels.moe_adds_residual = True
    block = SparseMoeBlock(cfg, kernels, True, kernels.linear)
    assert block.adds_residual
    x, stream = torch.randn(3, 32), torch.randn(3, 32)
    with torch.no_grad():
        block.load_state_dict({k: torch.randn(v.shape) for k, v in block.state_dict().items()})
        assert torch.equal(block(x, residual=stream), stream + block(x))
    assert calls[-2]["residual"] is stream and calls[-1]["residual"] is None
    qwen2 = attrs.evolve(cfg, shared_expert_intermediate_size=16)
    assert not SparseMoeBlock(qwen2, kernels, True, kernels.linear).adds_residual
