"""GGUF files load exactly or refuse (issues 21 and 22.4): GGUFs written from tiny Hugging
Face checkpoints give transformers' logits on that checkpoint; crafted files (zero or absurd
counts, shapes that disagree with the metadata, unknown tensors and fields) are refused with
a ModelLoadError naming the key before anything of the claimed size is allocated; the cache
is keyed by content and `pitstop cache list|clear` manage it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.checkpoints import (
    TINY_VOCAB,
    assert_matches_transformers,
    hf_model,
    write_gguf_from_hf,
)
from helpers.models import make_tiny_checkpoint

from pitstop.errors import ModelLoadError
from pitstop.loading.weights import load_model_source


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch) -> Path:
    cache = tmp_path / "pitstop-cache"
    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(cache))
    return cache


def _tiny(tmp_path: Path, arch: str = "llama", **overrides) -> Path:
    overrides.setdefault("vocab_size", TINY_VOCAB)
    return make_tiny_checkpoint(tmp_path, arch, with_tokenizer=False, **overrides)


_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama3-rope-freqs": ("llama", dict(rope_parameters=_LLAMA3)),
    "rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0})),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_of_a_checkpoint_matches_transformers_on_it(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    folder = _tiny(tmp_path, arch, **overrides)
    gguf = write_gguf_from_hf(folder, tmp_path / f"{case}.gguf")
    assert_matches_transformers(gguf, hf_model(folder))
    cfg = load_model_source(str(gguf)).model_config
    if case == "llama3-rope-freqs":
        assert cfg.rope_freq_factors is not None and max(cfg.rope_freq_factors) == 8.0
    if case == "llama-biases":
        assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias


# ---------------------------------------------------------------------- crafted files
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("gguf-base"), "llama", num_hidden_layers=1)


def _refused(tmp_path: Path, folder: Path, **kwargs) -> str:
    """The error of loading a crafted file: load_model_source reads metadata and headers
    only, so a refusal there comes before any model (of any claimed size) is built."""
    path = write_gguf_from_hf(folder, tmp_path / "crafted.gguf", **kwargs)
    with pytest.raises(ModelLoadError) as info:
        load_model_source(str(path))
    return str(info.value)


@pytest.mark.parametrize(
    "meta, expected",
    [
        ({"attention.head_count": 0}, "llama.attention.head_count=0 is not a whole number"),
        ({"attention.head_count_kv": 0}, "llama.attention.head_count_kv=0 is not a whole number"),
        ({"block_count": 0}, "llama.block_count=0 is not a whole number"),
        (
            {"feed_forward_length": 2**31},
            "llama.feed_forward_length=2147483648 is not a whole number between 1 and 1,048,576",
        ),
        ({"embedding_length": 0}, "llama.embedding_length=0 is not a whole number"),
        ({"embedding_length": None}, "lacks the metadata field llama.embedding_length"),
        ({"attention.head_count": 3}, "is not a multiple of llama.attention.head_count_kv=2"),
        ({"feed_forward_length": 129}, "tensor blk.0.ffn_"),
        ({"block_count": 2}, "lacks 9 tensor(s)"),
        ({"context_length": 0}, "llama.context_length=0 is not a whole number"),
        ({"rope.dimension_count": 8}, "llama.rope.dimension_count=8 differs from the head size 16"),
        ({"rope.scaling.type": "yarn"}, "llama.rope.scaling.type='yarn' is not supported"),
        ({"expert_count": 8}, "llama.expert_count=8; pitstop does not run mixture-of-experts"),
        ({"attention.sliding_window": 16}, "llama.attention.sliding_window=16 is not implemented"),
        ({"attention.layer_norm_rms_epsilon": -1.0}, "layer_norm_rms_epsilon=-1.0 is not a number"),
    ],
)
def test_crafted_metadata_is_refused_naming_the_key(
    tmp_path: Path, tiny_llama: Path, meta: dict, expected: str
) -> None:
    assert expected in _refused(tmp_path, tiny_llama, meta=meta)


def test_embedding_that_disagrees_with_the_vocabulary_is_refused(tmp_path, tiny_llama) -> None:
    msg = _refused(tmp_path, tiny_llama, tokens=TINY_VOCAB - 10)
    assert f"token_embd.weight has {TINY_VOCAB} rows" in msg
    assert f"tokenizer.ggml.tokens counts {TINY_VOCAB - 10} tokens" in msg


def test_vocab_size_field_that_disagrees_is_refused(tmp_path, tiny_llama) -> None:
    msg = _refused(tmp_path, tiny_llama, meta={"vocab_size": TINY_VOCAB * 2})
    assert f"llama.vocab_size counts {TINY_VOCAB * 2} tokens" in msg


def test_unknown_tensor_is_refused_naming_it(tmp_path, tiny_llama) -> None:
    extra = {"blk.0.attn_sinks.weight": np.zeros(4, dtype=np.float32)}
    msg = _refused(tmp_path, tiny_llama, extra_tensors=extra)
    assert "blk.0.attn_sinks.weight" in msg and "refuses rather than skips" in msg


def test_truncated_tensor_data_is_refused(tmp_path, tiny_llama) -> None:
    good = write_gguf_from_hf(tiny_llama, tmp_path / "good.gguf")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    with pytest.raises(ModelLoadError, match="corrupt or truncated|truncated"):
        load_model_source(str(bad))


def test_overlapping_or_out_of_file_byte_ranges_are_refused() -> None:
    """The byte checks on their own (GGUFWriter cannot write such a file)."""
    import gguf

    from pitstop.plugins.model_sources.gguf.file import check_tensor_bytes as _check_bytes

    class Tensor:
        def __init__(self, name, offset, n, data=None):
            self.name, self.data_offset = name, offset
            self.shape = np.array([n], dtype=np.uint64)
            self.tensor_type = gguf.GGMLQuantizationType.F32
            self.data = np.zeros(n, dtype=np.float32) if data is None else data

    class Reader:
        data = np.zeros(1000, dtype=np.uint8)

    _check_bytes(Reader(), [Tensor("a", 0, 100), Tensor("b", 400, 100)], "f.gguf")
    with pytest.raises(ModelLoadError, match="tensors a and b overlap"):
        _check_bytes(Reader(), [Tensor("a", 0, 100), Tensor("b", 200, 100)], "f.gguf")
    with pytest.raises(ModelLoadError, match="beyond the file's 1,000"):
        _check_bytes(Reader(), [Tensor("a", 800, 100)], "f.gguf")


# ---------------------------------------------------------------------- cache
def test_cache_is_keyed_by_content_and_reports_its_size(tmp_path, tiny_llama, caplog) -> None:
    from pitstop.plugins.model_sources.gguf.cache import cache_dir_for, cache_entries

    first = write_gguf_from_hf(tiny_llama, tmp_path / "a.gguf")
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    assert cache_dir_for(first) == cache_dir_for(copy)  # same bytes, one entry
    with caplog.at_level(logging.WARNING, logger="pitstop.plugins.model_sources.gguf.cache"):
        load_model_source(str(first)).weights()  # the first dense read writes the cache
    created = [r.getMessage() for r in caplog.records if "cached its dequantized" in r.message]
    assert len(created) == 1 and "kB on disk" in created[0] and "pitstop cache clear" in created[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pitstop.plugins.model_sources.gguf.cache"):
        assert "cached at" in load_model_source(str(copy)).description
    assert not caplog.records  # the copy reuses the entry: nothing converted, nothing logged
    assert len(cache_entries()) == 1

    other = write_gguf_from_hf(
        _tiny(tmp_path / "seed1", "llama", num_hidden_layers=1, seed=1), tmp_path / "c.gguf"
    )
    assert cache_dir_for(other) != cache_dir_for(first)


def test_pitstop_cache_list_and_clear(tmp_path, tiny_llama, capsys, _own_cache) -> None:
    from pitstop.entrypoints.cli import main

    path = write_gguf_from_hf(tiny_llama, tmp_path / "listed.gguf")
    load_model_source(str(path)).weights()
    stale = _own_cache / "gguf" / "0123abcd-v1"  # an older pitstop's entry
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 5000)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and str(path) in out and "stale" in out and "kB" in out
    assert main(["cache", "clear", "0123abcd-v1"]) == 0
    assert "removed 1 cache entries, 5.0 kB" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 cache entries" in capsys.readouterr().out
    assert main(["cache", "list"]) == 0
    assert "0 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "nope"]) == 2
    assert "no cache entry 'nope'" in capsys.readouterr().err
