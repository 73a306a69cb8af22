"""The tokenizer a GGUF file stores in its ``tokenizer.ggml.*`` metadata, as a pitstop
:class:`~pitstop.loading.tokenizer.Tokenizer` (transformers builds the fast tokenizer).

Slow (seconds): the loader builds it once per file and keeps it in the cache beside the
dequantized weights (:mod:`pitstop.plugins.model_sources.gguf.cache`), as ``tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pitstop.errors import ModelLoadError
from pitstop.loading.tokenizer import Tokenizer
from pitstop.plugins.model_sources.gguf.file import gguf_eos_token_ids, read_gguf_metadata


def gguf_tokenizer(path: str | Path, metadata: dict[str, Any] | None = None) -> Tokenizer:
    """Build the tokenizer stored in a GGUF file's metadata. ``metadata`` (from
    :func:`~pitstop.plugins.model_sources.gguf.file.read_gguf_metadata`) saves parsing the
    file again."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if metadata is None:
        metadata = read_gguf_metadata(path)
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # AutoTokenizer reads a transformers model config from the file first, so it
        # takes only the architectures transformers runs; the tokenizer itself is
        # described by the tokenizer.ggml.* fields alone, which the generic fast
        # tokenizer reads for any other (a third-party plugin's) architecture.
        known = _transformers_reads_gguf(metadata.get("general.architecture"))
        builder = AutoTokenizer if known else PreTrainedTokenizerFast
        hf = builder.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot build the tokenizer of GGUF file {path}: {exc}") from exc
    if hf.chat_template is None and metadata.get("tokenizer.chat_template"):
        hf.chat_template = metadata["tokenizer.chat_template"]
    return Tokenizer(hf, eos_token_ids=gguf_eos_token_ids(metadata), name=str(path))


def _transformers_reads_gguf(architecture: Any) -> bool:
    """Whether transformers' own GGUF loader knows ``general.architecture`` (a
    transformers without the list is assumed to: it is then asked as before)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return True
    return architecture in GGUF_SUPPORTED_ARCHITECTURES
