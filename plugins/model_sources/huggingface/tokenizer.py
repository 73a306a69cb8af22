"""A Hugging Face tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``), read and
written.

The ``huggingface`` source reads a checkpoint's own tokenizer and a ``tokenizer=`` folder
through :func:`load_hf_tokenizer`; the ``gguf`` source writes a converted file's tokenizer
into its cache with :func:`save_hf_tokenizer` and reads it back. ``transformers`` is
imported inside the functions, so a benchmark on dummy weights runs without it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pitstop.errors import ModelLoadError
from pitstop.loading.tokenizer import Tokenizer


def load_hf_tokenizer(path: str | Path) -> Tokenizer:
    """Load from a folder holding ``tokenizer.json`` (+ ``tokenizer_config.json``), or a
    ``tokenizer.json`` file itself. EOS ids of ``generation_config.json`` and
    ``config.json`` in the same folder are added to the tokenizer's own."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(
            f"tokenizer path {path} does not exist; pass a folder with tokenizer.json"
        )
    folder = path.parent if path.is_file() else path
    if path.is_file() and path.name != "tokenizer.json":
        raise ModelLoadError(
            f"{path} is not a tokenizer.json file; pass a folder with tokenizer.json"
        )
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"no tokenizer.json in {folder}; pass --tokenizer with a folder that has one"
        )
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if (folder / "tokenizer_config.json").is_file():
            hf = AutoTokenizer.from_pretrained(str(folder))
        else:
            hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    except Exception as exc:  # transformers raises many kinds
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {exc}") from exc
    return Tokenizer(hf, eos_token_ids=_extra_eos_ids(folder), name=str(folder))


def save_hf_tokenizer(tokenizer: Tokenizer, folder: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (chat template included), and
    ``generation_config.json`` when the tokenizer has more than one EOS id."""
    folder = Path(folder)
    tokenizer.hf.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if tokenizer.hf.chat_template is not None:
        config["chat_template"] = tokenizer.hf.chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    if len(tokenizer.eos_token_ids) > 1:
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": list(tokenizer.eos_token_ids)}, indent=2)
        )


def _extra_eos_ids(folder: Path) -> list[int]:
    """EOS ids a checkpoint folder declares besides the tokenizer's own."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids
