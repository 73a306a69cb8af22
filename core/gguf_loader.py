"""Read a GGUF file: its model shape, its tensors (dequantized, Hugging Face names), a cache.

GGUF (llama.cpp's format) names tensors ``blk.N.attn_q.weight`` and so on; the
engine's models take Hugging Face names, so every tensor is renamed here and
dequantized to float32 in the Hugging Face shape. llama.cpp's converter
permutes the rows of a Llama model's ``attn_q`` and ``attn_k`` for its rotary
layout; :func:`unpermute_rotary_rows` undoes that (Qwen2 and Qwen3 GGUFs use
the NeoX layout and are stored unpermuted).

Every metadata field and tensor is checked before anything is allocated
(:func:`gguf_model_config`): a field pitstop does not implement, a count that
is zero or absurd, a shape that disagrees with the metadata or a byte range
outside the file is a :class:`ModelLoadError` naming it.

Dequantizing takes seconds, so :func:`load_gguf` keeps the result (one
safetensors file, the model config and the tokenizer) under
``${PITSTOP_CACHE_DIR:-~/.cache/pitstop}/gguf/<content hash>-v<version>/`` and
reads that next time; its size is logged when it is written, and
``pitstop cache list|clear`` shows and empties the cache.

``gguf`` is imported inside functions: a benchmark on dummy weights needs none of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from pitstop.errors import ModelLoadError
from pitstop.gguf_file import open_gguf, read_gguf_metadata, require_gguf
from pitstop.model_config import MAX_DIM, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, ModelConfig

if TYPE_CHECKING:
    from pitstop.checkpoint import ModelSource
    from pitstop.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# general.architecture -> the Hugging Face architecture name the model registry knows
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose q/k rows llama.cpp's converter permuted (the others keep HF order).
_PERMUTED_ARCHITECTURES = {"llama"}

# Bump when the cache layout or the conversion changes: old entries are then ignored.
CACHE_VERSION = 2

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp's Llama 3 rope scaling: read into ModelConfig.rope_freq_factors, not a weight.
_IGNORED = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for a tensor the models do not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a q or k projection (weight or bias).

    llama.cpp's ``convert_hf_to_gguf.py`` turns each head's rows ``[first half,
    second half]`` (HF's rotate-half layout) into interleaved pairs: it views the
    rows as ``(heads, 2, head_size/2)`` and swaps the last two axes. The inverse
    views them as ``(heads, head_size/2, 2)`` and swaps back.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"a q/k tensor of {rows} rows does not split into {num_heads} heads")
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


# ---------------------------------------------------------------------- reading
# ---------------------------------------------------------------------- shape and checks
# ``{arch}.`` metadata keys and what pitstop does with each; any other such key is refused.
_ARCH_KEYS_READ = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "vocab_size",
    "expert_count",
    "expert_used_count",
)
_ARCH_KEYS_WITHOUT_EFFECT = ("rope.scaling.finetuned",)
# GGUF rope scaling types implemented (llama.cpp's yarn differs from transformers' in details)
GGUF_ROPE_SCALING = ("none", "linear")


def _count(meta: dict[str, Any], key: str, path: Any, limit: int, default: Any = None) -> int:
    """A positive whole-number metadata field, else a ModelLoadError naming the key."""
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(
            f"GGUF file {path} lacks the metadata field {key}; the file is incomplete"
        )
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ModelLoadError(
            f"GGUF file {path}: {key}={value!r} is not a whole number between 1 and {limit:,}; "
            "the file is corrupt or describes no model pitstop can run"
        )
    return value


def _number(meta: dict[str, Any], key: str, path: Any, default: float, low: float, high: float):
    value = meta.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low < value < high
    ):
        raise ModelLoadError(
            f"GGUF file {path}: {key}={value!r} is not a number between {low} and {high}"
        )
    return float(value)


def gguf_model_config(reader: Any, path: str | Path = "") -> ModelConfig:
    """The :class:`ModelConfig` of an open GGUF file, from its metadata and tensor shapes.

    Every metadata field that shapes the model is checked (present, a positive whole
    number below a bound, consistent with the others), and so is every tensor: its
    name maps to a Hugging Face one, its shape is what the metadata makes it, and its
    bytes lie inside the file without overlapping another tensor's. All of it before
    anything proportional to a claimed size is allocated.
    """
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path} holds a model of architecture {arch!r}; pitstop supports "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(
            f"GGUF file {path} has no token_embd.weight tensor; it is not a complete model"
        )
    known = {f"{arch}.{k}" for k in _ARCH_KEYS_READ + _ARCH_KEYS_WITHOUT_EFFECT}
    for key in reader.fields:
        if key.startswith(f"{arch}.") and key not in known:
            value = meta.get(key, "<array>")
            raise ModelLoadError(
                f"GGUF file {path}: metadata field {key}={value!r} is not implemented by pitstop; "
                f"it reads {', '.join(sorted(known))}"
            )
    for key in (f"{arch}.expert_count", f"{arch}.expert_used_count"):
        if meta.get(key, 0) not in (0, None):
            raise ModelLoadError(
                f"GGUF file {path}: {key}={meta[key]!r}; pitstop does not run mixture-of-experts models"
            )

    k = f"{arch}."
    hidden = _count(meta, k + "embedding_length", path, MAX_DIM)
    heads = _count(meta, k + "attention.head_count", path, MAX_DIM)
    kv_heads = _count(meta, k + "attention.head_count_kv", path, MAX_DIM, default=heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"GGUF file {path}: {k}attention.head_count={heads} is not a multiple of "
            f"{k}attention.head_count_kv={kv_heads}"
        )
    if k + "attention.key_length" not in meta and hidden % heads:
        raise ModelLoadError(
            f"GGUF file {path}: {k}embedding_length={hidden} is not a multiple of "
            f"{k}attention.head_count={heads} and {k}attention.key_length is absent"
        )
    head_size = _count(meta, k + "attention.key_length", path, MAX_DIM, default=hidden // heads)
    for other in ("attention.value_length", "rope.dimension_count"):
        if meta.get(k + other, head_size) != head_size:
            raise ModelLoadError(
                f"GGUF file {path}: {k}{other}={meta[k + other]!r} differs from the head size "
                f"{head_size}; pitstop supports only value heads of the key size, rotating the whole head"
            )
    if head_size % 2:
        raise ModelLoadError(f"GGUF file {path}: the head size {head_size} is odd")
    layers = _count(meta, k + "block_count", path, MAX_LAYERS)
    ffn = _count(meta, k + "feed_forward_length", path, MAX_DIM)
    context = _count(meta, k + "context_length", path, MAX_POSITIONS, default=4096)
    embd_shape = [int(d) for d in tensors["token_embd.weight"].shape.tolist()]  # [cols, rows]
    if len(embd_shape) != 2 or embd_shape[0] != hidden:
        raise ModelLoadError(
            f"GGUF file {path}: token_embd.weight has shape {embd_shape[::-1]}, which is not "
            f"[vocabulary, {k}embedding_length={hidden}]"
        )
    vocab = embd_shape[1]
    if not 1 <= vocab <= MAX_VOCAB:
        raise ModelLoadError(f"GGUF file {path}: token_embd.weight claims {vocab:,} rows")
    token_field = reader.fields.get("tokenizer.ggml.tokens")
    claims = {k + "vocab_size": meta.get(k + "vocab_size")}
    if token_field is not None:
        claims["tokenizer.ggml.tokens"] = len(token_field.data)
    for key, n in claims.items():
        if n is not None and n != vocab:
            raise ModelLoadError(
                f"GGUF file {path}: token_embd.weight has {vocab:,} rows but {key} counts "
                f"{n!r} tokens; the embedding must hold one row per token"
            )

    rope_scaling = None
    scaling_type = meta.get(k + "rope.scaling.type") or "none"
    if scaling_type not in GGUF_ROPE_SCALING:
        raise ModelLoadError(
            f"GGUF file {path}: {k}rope.scaling.type={scaling_type!r} is not supported for GGUF "
            f"files (supported: {', '.join(GGUF_ROPE_SCALING)}); load the Hugging Face checkpoint"
        )
    if scaling_type == "linear":
        factor = _number(meta, k + "rope.scaling.factor", path, 1.0, 0.0, 1e6)
        rope_scaling = {"rope_type": "linear", "factor": factor}
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        if [int(d) for d in t.shape.tolist()] != [head_size // 2]:
            raise ModelLoadError(
                f"GGUF file {path}: rope_freqs.weight has shape {t.shape.tolist()}, not "
                f"[{head_size // 2}] (half the head size)"
            )
        _check_bytes(reader, [t], path)
        gguf = require_gguf()
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not np.isfinite(values).all() or (values <= 0).any():
            raise ModelLoadError(f"GGUF file {path}: rope_freqs.weight holds non-positive factors")
        freq_factors = tuple(float(x) for x in values.reshape(-1))

    eos = [
        int(meta[key])
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if isinstance(meta.get(key), int)
    ]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    config = ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        rms_norm_eps=_number(meta, k + "attention.layer_norm_rms_epsilon", path, 1e-6, 0.0, 1.0),
        rope_theta=_number(meta, k + "rope.freq_base", path, 10000.0, 1.0, 1e12),
        rope_scaling=rope_scaling,
        rope_freq_factors=freq_factors,
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )
    _check_tensors(reader, config, path)
    return config


def _check_tensors(reader: Any, config: ModelConfig, path: Any) -> None:
    """Each tensor's name and shape against the config, its bytes against the file."""
    from pitstop.plugin_manager import get_plugin_manager

    expected = get_plugin_manager().architecture(config.architecture).weight_shapes(config)
    unknown, seen = [], set()
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        name = hf_tensor_name(t.name)
        if name is None or name not in expected:
            unknown.append(t.name)
            continue
        seen.add(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != expected[name]:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {t.name} has shape {list(shape)}, but the metadata "
                f"(embedding_length={config.hidden_size}, feed_forward_length="
                f"{config.intermediate_size}, head counts {config.num_heads}/{config.num_kv_heads} "
                f"of {config.head_size}, {config.vocab_size} tokens) makes it {list(expected[name])}"
            )
    if unknown:
        raise ModelLoadError(
            f"GGUF file {path} has {len(unknown)} tensor(s) that map to nothing pitstop runs "
            f"(or that the other layers lack), e.g. {unknown[:5]}; it refuses rather than skips them"
        )
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ModelLoadError(
            f"GGUF file {path} lacks {len(missing)} tensor(s) a {config.architecture} needs, "
            f"e.g. {missing[:3]}; the file is incomplete"
        )
    _check_bytes(reader, reader.tensors, path)


def _check_bytes(reader: Any, tensors: list[Any], path: Any) -> None:
    """Each tensor's byte count from its type and shape, inside the file, no two overlapping."""
    gguf = require_gguf()
    size = len(reader.data)
    spans = []
    for t in tensors:
        dims = [int(d) for d in t.shape.tolist()]
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        except KeyError:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {t.name} has type {t.tensor_type!r}, which gguf cannot dequantize"
            ) from None
        numel = math.prod(dims)
        if not dims or dims[0] % block:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {t.name} has rows of {dims[:1]} values, not a whole "
                f"number of {t.tensor_type.name} blocks of {block}"
            )
        n_bytes = numel // block * type_size
        if t.data_offset < 0 or t.data_offset + n_bytes > size or t.data.nbytes != n_bytes:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {t.name} claims bytes {t.data_offset:,}..."
                f"{t.data_offset + n_bytes:,}, beyond the file's {size:,}; the file is truncated"
            )
        spans.append((t.data_offset, t.data_offset + n_bytes, t.name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ModelLoadError(
                f"GGUF file {path}: tensors {a} and {b} overlap; the file is corrupt"
            )


def iter_gguf_tensors(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an open GGUF file: Hugging Face name, float32, HF shape, on CPU.

    The file must have passed :func:`gguf_model_config` (every name maps, every shape fits).
    """
    gguf = require_gguf()
    arch = str(read_gguf_metadata(reader).get("general.architecture"))
    permuted = arch in _PERMUTED_ARCHITECTURES
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:  # rope_freqs: part of the config, not a weight
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape.tolist())])
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_rotary_rows(w, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_rotary_rows(w, config.num_kv_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(w).copy())


# ---------------------------------------------------------------------- cache
# Layout: ${PITSTOP_CACHE_DIR:-~/.cache/pitstop}/gguf/<sha256 of the file>-v<version>/ holds
# model.safetensors (float32), pitstop_config.json, the tokenizer and source.json;
# gguf/digests/ remembers each file's hash by (path, size, mtime) so it is computed once.
_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "pitstop_config.json"
_SOURCE_FILE = "source.json"
_DIGESTS = "digests"


def cache_root() -> Path:
    """The pitstop cache folder: ``$PITSTOP_CACHE_DIR``, else ``~/.cache/pitstop``."""
    return Path(os.environ.get("PITSTOP_CACHE_DIR") or Path.home() / ".cache" / "pitstop")


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's content, remembered per (path, size, mtime) under the cache."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
    memo = cache_root() / "gguf" / _DIGESTS / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    try:
        digest = memo.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            return digest
    except OSError:
        pass
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError as exc:  # an unwritable cache only costs hashing the file again next time
        log.info(
            "could not keep the hash of %s in %s (%s); it will be hashed again", path, memo, exc
        )
    return digest


def cache_dir_for(path: str | Path) -> Path:
    """Where the converted form of a GGUF file lives: keyed by its content (SHA-256), so
    two copies of one file share an entry and a changed file gets a new one."""
    return cache_root() / "gguf" / f"{file_sha256(path)[:32]}-v{CACHE_VERSION}"


def _config_to_json(config: ModelConfig) -> str:
    data = attrs.asdict(config)
    data["eos_token_ids"] = list(config.eos_token_ids)
    if config.rope_freq_factors is not None:
        data["rope_freq_factors"] = list(config.rope_freq_factors)
    return json.dumps(data, indent=2)


def _config_from_json(text: str) -> ModelConfig:
    data = json.loads(text)
    data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
    if data.get("rope_freq_factors") is not None:
        data["rope_freq_factors"] = tuple(data["rope_freq_factors"])
    return ModelConfig(**data)


def _folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _write_cache(
    target: Path, config: ModelConfig, reader: Any, tokenizer: Tokenizer, source: Path
) -> None:
    """Convert into a temporary folder next to ``target``, then rename it into place
    (atomic: a reader never sees half a cache; a concurrent writer's copy wins or loses whole)."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tensors = dict(iter_gguf_tensors(reader, config))
        save_file(tensors, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        del tensors
        tokenizer.save(tmp)
        (tmp / _CONFIG_FILE).write_text(_config_to_json(config))
        record = {
            "source": str(source.resolve()),
            "sha256": file_sha256(source),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "cache_version": CACHE_VERSION,
        }
        (tmp / _SOURCE_FILE).write_text(json.dumps(record, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _CONFIG_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
            return
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning(
        "converted %s once and cached its dequantized weights at %s: %s on disk "
        "(`pitstop cache list` shows the cache, `pitstop cache clear` empties it)",
        source.name,
        target,
        format_size(_folder_size(target)),
    )


def _iter_cached(file: Path, shard: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    from pitstop.checkpoint import iter_safetensors, read_safetensors_headers

    return iter_safetensors(read_safetensors_headers([file]), shard)


def load_gguf(path: str | Path, *, tokenizer: Tokenizer | None = None) -> ModelSource:
    """A :class:`ModelSource` for a GGUF file, checked, converted once and cached.

    ``tokenizer`` replaces the file's own tokenizer when given.
    """
    from pitstop.checkpoint import ModelSource
    from pitstop.tokenizer import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    cache = cache_dir_for(path)
    if not (cache / _CONFIG_FILE).is_file():
        reader = open_gguf(path)
        config = gguf_model_config(reader, path)
        own_tokenizer = Tokenizer.from_gguf(path, read_gguf_metadata(reader))
        try:
            _write_cache(cache, config, reader, own_tokenizer, path)
        except OSError as exc:
            log.warning(
                "cannot cache GGUF file %s under %s (%s); converting on every load",
                path,
                cache,
                exc,
            )
            rd, cfg = reader, config
            return ModelSource(
                model_config=config,
                tokenizer=tokenizer or own_tokenizer,
                weights=lambda shard=None: (
                    iter_gguf_tensors(rd, cfg)
                    if shard is None
                    else shard.take_all(iter_gguf_tensors(rd, cfg))
                ),
                description=f"GGUF {path} (not cached: {exc})",
            )
        tokenizer = tokenizer or own_tokenizer
    try:
        config = _config_from_json((cache / _CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"the GGUF cache {cache} is damaged ({exc}); run `pitstop cache clear` and load again"
        ) from exc
    weights_file = cache / _WEIGHTS_FILE
    return ModelSource(
        model_config=config,
        tokenizer=tokenizer or Tokenizer.from_pretrained(cache),
        weights=lambda shard=None: _iter_cached(weights_file, shard),
        description=f"GGUF {path} (cached at {cache})",
    )


# ---------------------------------------------------------------------- pitstop cache
@attrs.frozen
class CacheEntry:
    """One converted GGUF file in the cache."""

    key: str
    path: Path
    size_bytes: int
    source: str  # the GGUF file it was converted from ("?" when unknown)
    created: str
    current: bool  # False: written by another cache version, never read again


def cache_entries() -> list[CacheEntry]:
    """Every entry of the GGUF cache, newest first."""
    root = cache_root() / "gguf"
    if not root.is_dir():
        return []
    entries = []
    for folder in root.iterdir():
        if not folder.is_dir() or folder.name == _DIGESTS or folder.name.startswith("."):
            continue
        try:
            record = json.loads((folder / _SOURCE_FILE).read_text())
        except (OSError, ValueError):
            record = {}
        entries.append(
            CacheEntry(
                key=folder.name,
                path=folder,
                size_bytes=_folder_size(folder),
                source=str(record.get("source", "?")),
                created=str(record.get("created", "?")),
                current=folder.name.endswith(f"-v{CACHE_VERSION}") and bool(record),
            )
        )
    return sorted(entries, key=lambda e: e.created, reverse=True)


def clear_cache(keys: list[str] | None = None) -> tuple[int, int]:
    """Delete the given entries (every entry, unfinished conversions and the hash memo
    when ``keys`` is None); returns (entries removed, bytes freed)."""
    root = cache_root() / "gguf"
    if not root.is_dir():
        return 0, 0
    entries = {e.key: e for e in cache_entries()}
    if keys is not None:
        unknown = [k for k in keys if k not in entries]
        if unknown:
            raise ModelLoadError(
                f"no cache entry {unknown[0]!r}; `pitstop cache list` shows the keys"
            )
        doomed = [entries[k].path for k in keys]
    else:
        doomed = [p for p in root.iterdir() if p.is_dir()]
    count = sum(1 for p in doomed if p.name in entries)
    freed = sum(_folder_size(p) for p in doomed)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return count, freed


def format_size(n: int) -> str:
    """``517.3 MB``: bytes in decimal units, as ``du -h --si`` and file managers write them."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _cmd_cache(args: Any) -> int:
    if args.cache_command == "list":
        entries = cache_entries()
        print(
            f"GGUF cache at {cache_root() / 'gguf'}: {len(entries)} entries, "
            f"{format_size(sum(e.size_bytes for e in entries))}"
        )
        width = max((len(e.key) for e in entries), default=0)
        for e in entries:
            stale = "" if e.current else "  (stale: an older pitstop wrote it; clear it)"
            print(
                f"  {e.key:<{width}}  {format_size(e.size_bytes):>9}  {e.created:<24}  "
                f"{e.source}{stale}"
            )
        return 0
    count, freed = clear_cache(args.keys or None)
    print(f"removed {count} cache entries, {format_size(freed)}, from {cache_root() / 'gguf'}")
    return 0


def add_subcommand(sub: Any) -> None:
    """``pitstop cache list`` and ``pitstop cache clear [KEY...]``."""
    p = sub.add_parser("cache", help="list or clear the cache of converted GGUF files")
    cache_sub = p.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("list", help="every cached conversion: key, size, date, source file")
    clear = cache_sub.add_parser("clear", help="delete cached conversions (all unless keys given)")
    clear.add_argument("keys", nargs="*", help="keys from `pitstop cache list` (default: all)")
    p.set_defaults(func=_cmd_cache)
