"""Read a GGUF file: its model shape, its tensors (dequantized, Hugging Face names), a cache.

GGUF (llama.cpp's format) names tensors ``blk.N.attn_q.weight`` and so on; the
engine's models take Hugging Face names, so every tensor is renamed here and
dequantized to float32 in the Hugging Face shape. llama.cpp's converter
permutes the rows of a Llama model's ``attn_q`` and ``attn_k`` for its rotary
layout; :func:`unpermute_rotary_rows` undoes that (Qwen2 and Qwen3 GGUFs use
the NeoX layout and are stored unpermuted).

Dequantizing takes seconds, so :func:`load_gguf` keeps the result (one
safetensors file, the model config and the tokenizer) under
``${PITSTOP_CACHE_DIR:-~/.cache/pitstop}/gguf/<key>/`` and reads that next time.

``gguf`` is imported inside functions: a benchmark on dummy weights needs none of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from pitstop.errors import ModelLoadError
from pitstop.model_config import ModelConfig

if TYPE_CHECKING:
    from pitstop.tokenizer import Tokenizer
    from pitstop.weights import ModelSource

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
CACHE_VERSION = 1

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
# Tensors llama.cpp stores that have no Hugging Face counterpart.
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
def _require_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError(
            "loading a GGUF file needs the 'gguf' package: pip install 'pitstop[gguf]' (or pip install gguf)"
        ) from exc
    return gguf


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path``; a missing, foreign or corrupt file is a ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); "
            "pass a .gguf file, a Hugging Face checkpoint folder, or a model name"
        )
    gguf = _require_gguf()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError, ...
        raise ModelLoadError(
            f"GGUF file {path} is corrupt or truncated ({type(exc).__name__}: {exc}); download it again"
        ) from exc


def _field_value(field: Any) -> Any:
    if hasattr(field, "contents"):
        return field.contents()
    # older gguf: decode the first data part by hand
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8")
    return part.tolist()[0] if len(part) == 1 else part.tolist()


def read_gguf_metadata(source: str | Path | Any, *, with_arrays: bool = False) -> dict[str, Any]:
    """Metadata of a GGUF file (a path or an open reader). Large arrays (the
    vocabulary, merges, scores) are left out unless ``with_arrays``."""
    reader = open_gguf(source) if isinstance(source, str | Path) else source
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if not with_arrays and len(field.data) > 64:
            continue
        try:
            meta[key] = _field_value(field)
        except Exception:  # an odd field must not stop the load
            log.debug("skipping GGUF metadata field %s", key)
    return meta


def gguf_model_config(reader: Any, path: str | Path = "") -> ModelConfig:
    """The :class:`ModelConfig` of an open GGUF file, from its metadata and tensor shapes."""
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

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(
                f"GGUF file {path} lacks the metadata field {full}; the file is incomplete"
            )
        return meta[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_size = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes are [cols, rows]
    rope_scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling = {
            "rope_type": scaling_type,
            "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    if "rope_freqs.weight" in tensors:
        log.warning(
            "GGUF file %s carries rope_freqs (Llama 3.1 rope scaling); pitstop ignores it, which "
            "changes outputs slightly. Load the Hugging Face checkpoint for exact results.",
            path,
        )
    eos = [
        int(meta[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if isinstance(meta.get(k), int)
    ]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def iter_gguf_tensors(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an open GGUF file: Hugging Face name, float32, HF shape, on CPU."""
    gguf = _require_gguf()
    arch = str(read_gguf_metadata(reader).get("general.architecture"))
    permuted = arch in _PERMUTED_ARCHITECTURES
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            if t.name not in _IGNORED:
                log.warning("ignoring GGUF tensor %s (no Hugging Face counterpart)", t.name)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape.tolist())])
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_rotary_rows(w, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_rotary_rows(w, config.num_kv_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(w).copy())


# ---------------------------------------------------------------------- cache
def cache_root() -> Path:
    return Path(os.environ.get("PITSTOP_CACHE_DIR") or Path.home() / ".cache" / "pitstop")


def cache_dir_for(path: str | Path) -> Path:
    """Where the converted form of a GGUF file lives: keyed by its path, size and mtime."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0v{CACHE_VERSION}"
    return cache_root() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:24]


_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "pitstop_config.json"


def _config_to_json(config: ModelConfig) -> str:
    data = attrs.asdict(config)
    data["eos_token_ids"] = list(config.eos_token_ids)
    return json.dumps(data, indent=2)


def _config_from_json(text: str) -> ModelConfig:
    data = json.loads(text)
    data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
    return ModelConfig(**data)


def _write_cache(target: Path, config: ModelConfig, reader: Any, tokenizer: Tokenizer) -> None:
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
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _CONFIG_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _iter_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name).to(torch.float32)


def load_gguf(path: str | Path, *, tokenizer: Tokenizer | None = None) -> ModelSource:
    """A :class:`ModelSource` for a GGUF file, converted once and cached.

    ``tokenizer`` replaces the file's own tokenizer when given.
    """
    from pitstop.tokenizer import Tokenizer
    from pitstop.weights import ModelSource

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    cache = cache_dir_for(path)
    if not (cache / _CONFIG_FILE).is_file():
        reader = open_gguf(path)
        config = gguf_model_config(reader, path)
        own_tokenizer = Tokenizer.from_gguf(path, read_gguf_metadata(reader))
        try:
            _write_cache(cache, config, reader, own_tokenizer)
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
                weights=lambda: iter_gguf_tensors(rd, cfg),
                description=f"GGUF {path} (not cached: {exc})",
            )
        tokenizer = tokenizer or own_tokenizer
    try:
        config = _config_from_json((cache / _CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"the GGUF cache {cache} is damaged ({exc}); delete that folder and load again"
        ) from exc
    weights_file = cache / _WEIGHTS_FILE
    return ModelSource(
        model_config=config,
        tokenizer=tokenizer or Tokenizer.from_pretrained(cache),
        weights=lambda: _iter_safetensors(weights_file),
        description=f"GGUF {path} (cached at {cache})",
    )
