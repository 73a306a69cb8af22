"""The weight-format kind (``weights=``): listed, selected, checked; ``dense`` is today's path
bit for bit; ``fp8``'s GEMMs compute the same arithmetic and run the engine end to end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, EngineConfig, SamplingParams
from pitstop.bench import floor as floors
from pitstop.errors import ConfigError, PluginError
from pitstop.plugin_system.kinds import KINDS
from pitstop.plugin_system.plugin_manager import PluginManager, get_plugin_manager
from pitstop.plugins.models.llama_presets import PRESETS
from pitstop.plugins.weight_formats import fp8
from pitstop.runner.model_runner import weights_keyword
from pitstop.testing.kernels import TOLERANCE
from pitstop.testing.weights import _check_one, check_weight_format, relative_error

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [9] * 20, [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# fp8 against the float32 product, over its terms' magnitude (check_weight_format): two e4m3
# roundings of each term (2**-4 each at most) and the dtype's
FP8_TOLERANCE = 0.15
# fp8's first-step logits against dense ones on the tiny random models below, relative to the
# largest |logit|: measured 0.055 (llama) and 0.067 (qwen3) on CPU, float32
FP8_LOGITS_TOLERANCE = 0.1


def _format(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32, **options):
    pm = get_plugin_manager()
    config = EngineConfig(weights=name, options=options)
    kernels = pm.create("kernels", "reference", config, torch.device(device), dtype)
    return pm.create("weights", name, config, kernels, torch.device(device), dtype)


def _maker(name: str, **options):
    def make(device: torch.device, dtype: torch.dtype):
        return _format(name, str(device), dtype, **options)

    return make


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama checkpoint (hidden 64, 2 layers, untied head), no tokenizer."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", with_tokenizer=False)
    return str(folder)


def _run(model: str, **settings) -> tuple[LLM, list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of PROMPTS and every step's logits."""
    llm = LLM(model, device="cpu", page_size=4, max_num_pages=64, max_model_len=48, **settings)
    seen: list[torch.Tensor] = []
    llm.engine.observe_logits(lambda inputs, seqs, logits: seen.append(logits.clone()))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], seen


# ---------------------------------------------------------------- the kind


def test_the_kind_is_in_the_table_and_listed(capsys: pytest.CaptureFixture[str]) -> None:
    from pitstop.entrypoints.cli import main

    kind = KINDS["weights"]
    assert (kind.hook, kind.selected_by) == ("register_weight_formats", "weights")
    assert {"dense", "fp8"} <= set(get_plugin_manager().names("weights"))
    assert EngineConfig().weights == "dense"
    assert main(["plugins", "--settings"]) == 0
    text = capsys.readouterr().out
    assert "weights      fp8" in text and "weights      dense" in text
    assert "fp8.activation_scale" in text and "fp8.lm_head" in text and "fp8.gemm" in text


def test_a_misspelled_format_is_refused_with_the_nearest_name() -> None:
    pm = PluginManager()
    with pytest.raises(PluginError, match=r"unknown weights 'fp9' \(did you mean 'fp8'\?\)"):
        pm.resolve(EngineConfig(weights="fp9"))
    with pytest.raises(PluginError, match="did you mean 'dense'.*registered weights names"):
        pm.resolve(EngineConfig(weights="dens"))


def test_fp8_settings_are_typed_and_checked() -> None:
    pm = PluginManager()
    resolved = pm.resolve(EngineConfig(weights="fp8", options={"fp8.lm_head": True}))
    assert resolved.of("weights") == fp8.Fp8Settings(lm_head=True)
    with pytest.raises(ConfigError, match="fp8.activation_scale must be one of"):
        pm.resolve(EngineConfig(weights="fp8", options={"fp8.activation_scale": "per-row"}))
    with pytest.raises(ConfigError, match="fp8.lm_haed"):
        pm.resolve(EngineConfig(weights="fp8", options={"fp8.lm_haed": True}))


def test_a_model_without_a_weights_keyword_runs_dense_only() -> None:
    def factory(model_config, kernels):  # an architecture written before weight formats
        return None

    plugins = SimpleNamespace(get=lambda kind, name: SimpleNamespace(factory=factory))
    runner = SimpleNamespace(
        model_config=SimpleNamespace(architecture="ToyForCausalLM"),
        config=EngineConfig(),
        weights=object(),
    )
    assert weights_keyword(runner, plugins) == {}
    runner.config = EngineConfig(weights="fp8")
    with pytest.raises(ConfigError, match="ToyForCausalLM model plugin takes no weight format"):
        weights_keyword(runner, plugins)


# ---------------------------------------------------------------- dense


def test_dense_is_the_kernel_sets_own_linear() -> None:
    dense = _format("dense")
    assert dense.linear == dense.kernels.linear  # no call in between
    w = torch.randn(8, 4)
    assert dense.prepare("layers.0.mlp.down_proj", w) is w
    assert dense.resident_bytes(w) == 8 * 4 * 4
    check_weight_format(_maker("dense"), tolerance=TOLERANCE, max_examples=10)


def test_dense_gives_todays_tokens_bit_for_bit(tiny: str) -> None:
    default, tokens, logits = _run(tiny)
    named, named_tokens, named_logits = _run(tiny, weights="dense")
    assert named_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(named_logits, logits, strict=True))
    # the model holds its weights as parameters, exactly as before the kind existed
    names = dict(named.engine.runner.model.named_parameters())
    assert "layers.0.self_attn.q_proj" in names and "lm_head" in names
    assert named.engine.runner.weight_bytes() == sum(
        p.numel() * p.element_size() for p in named.engine.runner.model.parameters()
    ) + sum(b.numel() * b.element_size() for b in named.engine.runner.model.buffers())


# ---------------------------------------------------------------- fp8


def test_fp8_weights_are_per_channel_e4m3() -> None:
    w = torch.randn(32, 64) * torch.logspace(-3, 1, 32).unsqueeze(1)  # rows of every magnitude
    w[5] = 0
    resident = _format("fp8").prepare("layers.0.mlp.down_proj", w)
    assert resident.qweight.dtype == torch.float8_e4m3fn and resident.scale.shape == (1, 32)
    wide = resident.qweight.float()
    assert torch.equal(wide.abs().amax(dim=1)[torch.arange(32) != 5], torch.full((31,), 448.0))
    assert torch.equal(wide[5], torch.zeros(64))  # a zero row stays zero (no 0 / 0)
    back = wide * resident.scale.reshape(-1, 1)
    normal = wide.abs() >= 2.0**-6  # e4m3's normal range: relative rounding at most 2**-4
    assert ((back - w).abs() <= 2.0**-4 * w.abs() + 1e-30)[normal].all()


def test_fp8_linear_equals_its_reference_and_the_dense_product() -> None:
    # the CPU path is the reference itself; against the float32 product within fp8's rounding
    check_weight_format(_maker("fp8"), tolerance=FP8_TOLERANCE, max_examples=25)
    check_weight_format(
        _maker("fp8", **{"fp8.activation_scale": "per-tensor", "fp8.lm_head": True}),
        tolerance=FP8_TOLERANCE,
        max_examples=15,
    )
    # torch._scaled_mm (which torch runs on CPU too) against the float32 reference GEMM
    check_weight_format(
        _maker("fp8", **{"fp8.gemm": "scaled-mm"}),
        tolerance=FP8_TOLERANCE,
        reference=lambda fmt: fmt.reference_linear,
        reference_tolerance=TOLERANCE,
        max_examples=25,
    )


def test_fp8_error_is_measured_against_the_terms_of_a_cancelling_product() -> None:
    # the case check_weight_format drew in CI (qkv_proj (2, 10) x (2, 10), float32, magnitude
    # 0.02, seed 11, no bias): the one nonzero output is 1/57 of the sum of its terms' sizes, so
    # fp8's rounding (a few % of the terms) was 1.13 of the product itself
    fmt = _format("fp8", **{"fp8.gemm": "scaled-mm"})
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(2, 10, generator=gen) * 0.02
    w[0] = 0
    x = torch.randn(2, 10, generator=gen)
    x[0] = 0
    out = fmt.linear(x, fmt.prepare("layers.0.self_attn.qkv_proj", w))
    assert relative_error(out, x @ w.T) > 1  # measured against the product, fp8 cannot pass
    assert relative_error(out, x @ w.T, x.abs() @ w.abs().T) < 0.03
    # and the harness's whole check of one drawn case passes it
    name, reference = "layers.0.self_attn.qkv_proj", fmt.reference_linear
    _check_one(fmt, w, x, None, name, FP8_TOLERANCE, reference, TOLERANCE[torch.float32])


def test_fp8_resident_bytes_are_about_half_of_bf16() -> None:
    fmt = _format("fp8", dtype=torch.bfloat16)
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    resident = fmt.prepare("layers.0.mlp.gate_up_proj", w)
    dense = w.numel() * w.element_size()
    assert fmt.resident_bytes(resident) == 256 * 512 + 4 * 256
    assert fmt.resident_bytes(resident) / dense == pytest.approx(0.5, abs=0.01)
    head = fmt.prepare("lm_head", w)  # the head stays dense unless fp8.lm_head
    assert head is w and fmt.resident_bytes(head) == dense


def test_fp8_refuses_a_gpu_without_fp8_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError, match=r"NVIDIA A100-SXM4-80GB has 8\.0.*weights='dense'"):
        fp8.choose_gemm(fp8.Fp8Settings(), cuda, torch.bfloat16)
    assert fp8.choose_gemm(fp8.Fp8Settings(gemm="reference"), cuda, torch.bfloat16)[0] is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.choose_gemm(fp8.Fp8Settings(), cuda, torch.bfloat16) == (
        True,
        "compute capability 9.0",
    )
    assert fp8.choose_gemm(fp8.Fp8Settings(), cuda, torch.float16)[0] is False  # bf16 out only
    with pytest.raises(ConfigError, match="writes bfloat16"):
        fp8.choose_gemm(fp8.Fp8Settings(gemm="scaled-mm"), cuda, torch.float16)


def test_fp8_runs_the_engine_close_to_dense(tiny: str) -> None:
    _, dense_tokens, dense_logits = _run(tiny)
    llm, tokens, logits = _run(tiny, weights="fp8")
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].self_attn.q_proj, fp8.Fp8Weight)
    assert isinstance(model.lm_head, torch.nn.Parameter)  # fp8.lm_head = false: dense
    assert relative_error(logits[0], dense_logits[0]) <= FP8_LOGITS_TOLERANCE
    # the tiny random model's logits are nearly tied, so greedy paths part after a few
    # tokens (23 of these 64 tokens equal, measured); the first two agree for every prompt
    assert [t[:2] for t in tokens] == [t[:2] for t in dense_tokens]
    held = llm.engine.runner.weight_bytes()
    dense_bytes = _run(tiny)[0].engine.runner.weight_bytes()
    assert held < dense_bytes
    with_head = _run(tiny, weights="fp8", options={"fp8.lm_head": True})[0]
    assert with_head.engine.runner.weight_bytes() < held
    assert "1 dense (the output head)" in llm.engine.runner.weights.describe()["linear"]


def test_the_bench_floor_counts_the_formats_bytes() -> None:
    mc = PRESETS["qwen3-8b"]
    lengths = [(128, 256)] * 8
    dense = floors.floor(mc, lengths)
    assert dense.weight_bytes == 2 * mc.num_params
    half = dense.with_weight_bytes(dense.weight_bytes // 2)
    assert half.weights_s == pytest.approx(dense.weights_s / 2)
    assert (half.prefill_s, half.kv_s) == (dense.prefill_s, dense.kv_s)
    given = floors.floor(mc, lengths, weight_bytes_total=dense.weight_bytes // 2)
    assert given.weights_s == pytest.approx(half.weights_s)


# ---------------------------------------------------------------- on the H200


@pytest.mark.gpu
def test_scaled_mm_equals_the_reference_on_cuda() -> None:
    check_weight_format(
        _maker("fp8"),
        device="cuda",
        dtypes=(torch.bfloat16,),
        tolerance=FP8_TOLERANCE,
        reference=lambda fmt: fmt.reference_linear,
        reference_tolerance=TOLERANCE,
        max_examples=50,
    )
    assert "torch._scaled_mm" in _format("fp8", "cuda", torch.bfloat16).describe()["linear"]


@pytest.mark.gpu
def test_fp8_engine_on_cuda_graphs_and_eager_agree(tmp_path: Path) -> None:
    folder = str(make_tiny_checkpoint(tmp_path, "qwen3", with_tokenizer=False))

    def run(**settings):
        # a fixed KV budget: three engines are alive at once here (see test_gguf_weights)
        llm = LLM(
            folder, device="cuda", dtype="bfloat16", max_model_len=48, kv_cache_gib=1, **settings
        )
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outs]

    graphs, tokens = run(weights="fp8")
    assert "torch._scaled_mm" in graphs.engine.runner.weights.describe()["linear"]
    assert run(weights="fp8", enforce_eager=True)[1] == tokens
    dense, _ = run()
    assert graphs.engine.runner.weight_bytes() < dense.engine.runner.weight_bytes()
