"""Hugging Face checkpoints load exactly or refuse (issue 21): every configuration pitstop
accepts gives transformers' logits and greedy tokens; every one it cannot compute exactly
is refused with an error that names the field, its value and what is supported (the
``huggingface`` model source)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import (
    TINY_VOCAB,
    assert_matches_transformers,
    edit_config,
    hf_model,
)
from helpers.models import make_tiny_checkpoint

from pitstop.errors import ConfigError, ModelLoadError
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.weights import load_model_source
from pitstop.plugins.model_sources.huggingface.tokenizer import load_hf_tokenizer
from pitstop.plugins.models.llama_config import HF_FIELDS_READ, HF_FIELDS_WITHOUT_EFFECT
from pitstop.plugins.models.llama_rope import rope_frequencies


def _tiny(tmp_path: Path, arch: str, **overrides) -> Path:
    overrides.setdefault("vocab_size", TINY_VOCAB)
    return make_tiny_checkpoint(tmp_path, arch, with_tokenizer=False, **overrides)


def _rope(rope_type: str, theta: float = 10000.0, **params) -> dict:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **params}}


_LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
# (architecture, config overrides, max_model_len)
ACCEPTED = {
    "llama-attention-bias": ("llama", dict(attention_bias=True), 128),
    "llama-mlp-bias": ("llama", dict(mlp_bias=True), 128),
    "llama-both-biases-tied": (
        "llama",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        128,
    ),
    "rope-linear": ("llama", _rope("linear", factor=4.0), 128),
    "rope-dynamic": ("llama", _rope("dynamic", factor=4.0), 128),
    "rope-yarn": ("llama", _rope("yarn", factor=4.0, original_max_position_embeddings=64), 128),
    "rope-yarn-mscale": (
        "llama",
        _rope(
            "yarn",
            factor=8.0,
            original_max_position_embeddings=32,
            beta_fast=16.0,
            mscale=0.7,
            mscale_all_dim=0.5,
        ),
        128,
    ),
    "rope-llama3": (
        "llama",
        _rope("llama3", 500000.0, original_max_position_embeddings=64, **_LLAMA3),
        128,
    ),
    "qwen2": ("qwen2", {}, 128),
    # a window that never cuts: max_model_len <= sliding_window
    "qwen2-sliding-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=64, max_window_layers=1),
        64,
    ),
    "qwen3-attention-bias": ("qwen3", dict(attention_bias=True), 128),
    "qwen3-rope-yarn": (
        "qwen3",
        _rope("yarn", 1e6, factor=2.0, original_max_position_embeddings=256),
        128,
    ),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepted_configurations_match_transformers(tmp_path: Path, case: str) -> None:
    arch, overrides, max_model_len = ACCEPTED[case]
    folder = _tiny(tmp_path, arch, **overrides)
    hf = hf_model(folder)
    assert_matches_transformers(folder, hf, max_model_len=max_model_len)
    cfg = load_model_source(str(folder)).model_config
    if "rope_parameters" in overrides and cfg.rope_type != "dynamic":
        # the case is sensitive: pitstop's frequencies are not the default ones (dynamic NTK
        # is the default rope up to max_position_embeddings, past which it is refused)
        default = rope_frequencies(ModelConfig(**{**_fields(cfg), "rope_scaling": None}))
        scaled = rope_frequencies(cfg)
        assert not torch.allclose(scaled[0], default[0]) or scaled[1] != 1.0
    if overrides.get("attention_bias"):
        assert cfg.attention_bias and cfg.o_proj_bias
    if overrides.get("mlp_bias"):
        assert cfg.mlp_bias
    if arch == "qwen2":
        assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.mlp_bias
    if case == "qwen2-sliding-window":
        assert cfg.sliding_window == 64


def _fields(cfg: ModelConfig) -> dict:
    import attrs

    return attrs.asdict(cfg, recurse=False)


def test_rope_frequencies_are_transformers_own(tmp_path: Path) -> None:
    """cos/sin tables equal transformers' rotary embedding (yarn scales both)."""
    folder = _tiny(
        tmp_path, "llama", **_rope("yarn", factor=4.0, original_max_position_embeddings=64)
    )
    hf = hf_model(folder)
    from pitstop.model import rotary_cache

    cfg = load_model_source(str(folder)).model_config
    table = rotary_cache(cfg, 100, torch.device("cpu"))
    x = torch.zeros(1, 100, 16)
    cos, sin = hf.model.rotary_emb(x, torch.arange(100)[None])
    torch.testing.assert_close(table.cos, cos[0, :, :8], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(table.sin, sin[0, :, :8], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- refused, at max_model_len
def _llm_error(folder: Path, max_model_len: int) -> str:
    from pitstop.entrypoints.llm import LLM

    with pytest.raises(ConfigError) as info:
        LLM(str(folder), device="cpu", kv_cache_gib=0.01, max_model_len=max_model_len)
    return str(info.value)


def test_dynamic_rope_past_max_position_embeddings_is_refused(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama", **_rope("dynamic", factor=4.0))
    msg = _llm_error(folder, 1024)
    assert "rope_type='dynamic'" in msg and "max_position_embeddings=512" in msg
    assert "use max_model_len <= 512" in msg


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path: Path) -> None:
    folder = _tiny(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1
    )
    msg = _llm_error(folder, 128)
    assert "sliding_window=64" in msg and "max_model_len=128" in msg
    assert "use max_model_len <= 64" in msg


def test_sliding_window_switched_off_is_ignored(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "qwen2", use_sliding_window=False, sliding_window=16)
    assert load_model_source(str(folder)).model_config.sliding_window is None


# ---------------------------------------------------------------------- refused, at load
def _load_error(folder: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model_source(str(folder))
    return str(info.value)


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            _rope("longrope", factor=4.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8),
            "rope_type='longrope' is not supported; pitstop implements default, linear, "
            "dynamic, yarn, llama3",
        ),
        (
            {"partial_rotary_factor": 0.5},
            "partial_rotary_factor=0.5 is not supported; pitstop rotates the whole head (1.0)",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported; pitstop implements 'silu'"),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "quantization_config (quant_method='gptq')",
        ),
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"num_attention_heads": 0}, "num_attention_heads=0 is not a whole number between 1"),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads=4 is not a multiple of num_key_value_heads=3",
        ),
        ({"intermediate_size": 2**31}, "intermediate_size=2147483648 is not a whole number"),
    ],
)
def test_refused_config_fields(tmp_path: Path, changes: dict, expected: str) -> None:
    folder = _tiny(tmp_path, "llama")
    edit_config(folder, **changes)
    assert expected in _load_error(folder)


def test_every_field_of_the_config_classes_is_decided() -> None:
    """A field a newer transformers adds makes this fail: decide it (read or no effect)."""
    import transformers

    generic = set(transformers.PretrainedConfig().to_dict())
    decided = generic | set(HF_FIELDS_READ) | set(HF_FIELDS_WITHOUT_EFFECT)
    for cls in (transformers.LlamaConfig, transformers.Qwen2Config, transformers.Qwen3Config):
        assert set(cls().to_dict()) - decided == set(), cls.__name__


def test_an_undecided_field_at_a_non_default_value_is_refused(tmp_path, monkeypatch) -> None:
    import pitstop.plugins.models.llama_config as mc

    monkeypatch.setattr(
        mc,
        "HF_FIELDS_WITHOUT_EFFECT",
        {k: v for k, v in mc.HF_FIELDS_WITHOUT_EFFECT.items() if k != "attention_dropout"},
    )
    folder = _tiny(tmp_path, "llama", attention_dropout=0.25)
    msg = _load_error(folder)
    assert "attention_dropout=0.25 is a LlamaConfig field pitstop does not implement" in msg
    assert "at its default, 0.0" in msg


def test_unknown_config_keys_are_ignored_as_transformers_ignores_them(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama")
    edit_config(folder, some_custom_note="fine-tuned by us", sliding_window=8)
    assert load_model_source(str(folder)).model_config.sliding_window is None


# ---------------------------------------------------------------------- tensors
def _rewrite_safetensors(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_unknown_tensor_is_an_error_naming_it(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama")
    _rewrite_safetensors(
        folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)})
    )
    msg = _load_error(folder)
    assert "model.layers.0.mlp.extra_proj.weight" in msg and "refuses rather than skips" in msg


def test_bias_tensors_the_config_does_not_declare_are_refused(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama", mlp_bias=True)
    edit_config(folder, mlp_bias=False)
    msg = _load_error(folder)
    assert "model.layers.0.mlp." in msg and ".bias" in msg


def test_missing_tensor_is_an_error(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama", attention_bias=True)
    _rewrite_safetensors(folder, lambda t: t.pop("model.layers.1.self_attn.o_proj.bias"))
    assert "model.layers.1.self_attn.o_proj.bias" in _load_error(folder)


def test_tensor_shape_against_config_is_checked_before_allocation(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama")
    edit_config(folder, intermediate_size=100_000)
    msg = _load_error(folder)
    assert "'model.layers.0.mlp." in msg and "intermediate_size=100000" in msg
    assert "has shape (128, 64)" in msg or "has shape (64, 128)" in msg


def test_tied_head_that_differs_from_the_embedding_is_refused(tmp_path: Path) -> None:
    from pitstop.entrypoints.llm import LLM

    folder = _tiny(tmp_path, "llama")
    edit_config(folder, tie_word_embeddings=True)
    with pytest.raises(ModelLoadError, match="lm_head.weight differs from model.embed_tokens"):
        LLM(str(folder), device="cpu", kv_cache_gib=0.01, max_model_len=64)


def test_quantized_dtype_is_refused(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama")
    _rewrite_safetensors(
        folder,
        lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int8)}),
    )
    msg = _load_error(folder)
    assert "'model.norm.weight' has dtype I8" in msg and "F32, F16, BF16" in msg


def _write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize(
    "header, data, expected",
    [
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "beyond"),
        ({"a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 16]}}, b"\0" * 16, "needs"),
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            },
            b"\0" * 16,
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16, "beyond"),
        ({"a": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, b"\0" * 16, "malformed"),
    ],
)
def test_hostile_safetensors_headers_are_refused_before_allocation(
    tmp_path: Path, header: dict, data: bytes, expected: str
) -> None:
    from pitstop.plugins.model_sources.huggingface.safetensors import read_safetensors_header

    file = tmp_path / "model.safetensors"
    _write_raw_safetensors(file, header, data)
    with pytest.raises(ModelLoadError) as info:
        read_safetensors_header(file)
    assert expected in str(info.value) and "corrupt or truncated" in str(info.value)


def test_header_length_beyond_the_file_is_refused(tmp_path: Path) -> None:
    from pitstop.plugins.model_sources.huggingface.safetensors import read_safetensors_header

    file = tmp_path / "model.safetensors"
    file.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelLoadError, match="header claims"):
        read_safetensors_header(file)


def test_sharded_checkpoint_reads_the_files_its_index_names(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    from safetensors.torch import save_file

    save_file({"stray": torch.zeros(1)}, str(folder / "adapter.safetensors"))
    source = load_model_source(str(folder))
    assert "stray" not in dict(source.weights())


def test_tensors_arrive_in_the_checkpoint_dtype(tmp_path: Path) -> None:
    folder = _tiny(tmp_path, "llama", attention_bias=True)
    model = hf_model(folder).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "bf16"))
    tensors = dict(load_model_source(str(tmp_path / "bf16")).weights())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    ref = model.state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in tensors.items())


def test_merged_projections_place_every_bias(tmp_path: Path) -> None:
    """The fused kernels' merged q/k/v and gate/up parameters carry the biases too."""
    from pitstop.model import LlamaForCausalLM
    from pitstop.plugins.kernels.reference import ReferenceKernels

    folder = _tiny(tmp_path, "llama", attention_bias=True, mlp_bias=True)
    source = load_model_source(str(folder))
    kernels = ReferenceKernels(torch.device("cpu"), torch.float32)
    kernels.merge_projections = True
    model = LlamaForCausalLM(source.model_config, kernels)
    model.load_weights(source.weights())
    ref = dict(source.weights())
    p = "model.layers.1."
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    qkv = torch.cat([ref[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(attn.qkv_bias, qkv)
    assert torch.equal(attn.o_bias, ref[p + "self_attn.o_proj.bias"])
    gate_up = torch.cat([ref[p + "mlp.gate_proj.bias"], ref[p + "mlp.up_proj.bias"]])
    assert torch.equal(mlp.gate_up_bias, gate_up)
    assert torch.equal(mlp.down_bias, ref[p + "mlp.down_proj.bias"])


# ---------------------------------------------------------------------- memory
_PEAK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from pitstop.model import LlamaForCausalLM
    from pitstop.plugins.kernels.reference import ReferenceKernels
    from pitstop.loading.weights import load_model_source

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    source = load_model_source(sys.argv[1])
    kernels = ReferenceKernels(torch.device("cpu"), torch.bfloat16)
    torch.ones(4, dtype=torch.bfloat16).copy_(torch.ones(4))  # first-use set-up, not loading
    before = rss("VmRSS:")
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(source.model_config, kernels)
    with torch.inference_mode():
        model.load_weights(source.weights())
    print(rss("VmHWM:") - before)
    """
)


def test_loading_a_bf16_checkpoint_peaks_below_1_2x_its_size(tmp_path: Path) -> None:
    """Tensors are read in their own dtype straight into memory and cast once: the peak is
    the final weights plus one tensor, not a float32 copy of everything."""
    from safetensors.torch import save_file

    hidden, inter, layers, vocab = 512, 1536, 8, 2048
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    folder = tmp_path / "bf16"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    (folder / "config.json").write_text(json.dumps(config))
    size = (folder / "model.safetensors").stat().st_size
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    peak = int(out.stdout.strip().splitlines()[-1])
    print(f"loading a bf16 checkpoint of {size / 1e6:.1f} MB peaked at {peak / size:.3f}x its size")
    assert peak < 1.2 * size, f"loading peaked at {peak / size:.2f}x the checkpoint's size"
    assert peak > 0.9 * size  # the measurement sees the weights themselves


# ---------------------------------------------------------------------- model ids
def _hub_cache_entry(cache: Path, repo_id: str, folder: Path) -> Path:
    """Lay a checkpoint into a Hugging Face hub cache the way huggingface_hub does:
    content-addressed blobs, a snapshot of symlinks per commit, refs/main."""
    import hashlib

    from huggingface_hub.file_download import _create_symlink

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        _create_symlink(str(blob), str(snapshot / file.name))
    return snapshot


def test_model_id_resolves_from_the_local_hf_cache(tmp_path: Path, monkeypatch) -> None:
    from huggingface_hub import scan_cache_dir

    folder = _tiny(tmp_path, "qwen3")
    cache = tmp_path / "hub"
    snapshot = _hub_cache_entry(cache, "tiny-org/tiny-qwen3", folder)
    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos}  # huggingface_hub reads it back
    assert repos["tiny-org/tiny-qwen3"].nb_files == len(list(folder.iterdir()))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = load_model_source("tiny-org/tiny-qwen3")
    assert source.model_config.architecture == "Qwen3ForCausalLM"
    assert str(snapshot) in source.description
    assert set(dict(source.weights())) == set(dict(load_model_source(str(folder)).weights()))


def test_model_id_not_in_the_cache_names_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelLoadError) as info:
        load_model_source("Qwen/Qwen3-0.6B")
    msg = str(info.value)
    assert "'Qwen/Qwen3-0.6B' is not in the local Hugging Face cache" in msg
    assert str(tmp_path / "empty-hub") in msg and "hf download Qwen/Qwen3-0.6B" in msg


def test_extra_eos_from_generation_config(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "qwen3")
    (folder / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    tok = load_hf_tokenizer(folder)
    assert tok.eos_token_ids == (2, 0)
