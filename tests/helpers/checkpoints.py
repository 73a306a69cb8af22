"""Helpers of the checkpoint tests: pitstop against transformers on the same weights, and
small GGUF files written from a Hugging Face checkpoint (import them:
``from helpers.checkpoints import ...``)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

TINY_VOCAB = 512  # small: the tests compare logits, not text


def prefill_logits(llm: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """pitstop's logits at every prompt position, all prompts prefilled in one step."""
    from pitstop.ground.step import SeqInput

    runner = llm.engine.runner
    pages = -(-max(map(len, prompts)) // runner.page_size)
    seqs = [
        SeqInput(i, p, 0, list(range(i * pages, (i + 1) * pages)), True)
        for i, p in enumerate(prompts)
    ]
    ids, meta, _ = runner.build_metadata(seqs)
    with torch.inference_mode():
        logits = runner.model.compute_logits(
            runner.model(ids, runner.rotary, runner.kv_cache, meta)
        ).float()
    out, start = [], 0
    for p in prompts:
        out.append(logits[start : start + len(p)])
        start += len(p)
    return out


def relative_error(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """max |mine - ref| / max |ref|."""
    return ((mine.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def assert_matches_transformers(
    model: str | Path,
    hf_model: Any,
    *,
    max_model_len: int = 128,
    lengths: tuple[int, ...] = (1, 6, 23, 48),
    max_tokens: int = 10,
    vocab: int = TINY_VOCAB,
    **settings: Any,
) -> None:
    """Logits at every prompt position within 1e-4 (relative, fp32) and greedy tokens
    identical, for prompts of several lengths run as one batch. ``settings``: more engine
    settings (``scheduler="chunked", chunk_size=16`` spreads the prompts over steps)."""
    from pitstop.entrypoints.llm import LLM
    from pitstop.entrypoints.sampling_params import SamplingParams

    llm = LLM(str(model), device="cpu", kv_cache_gib=0.01, max_model_len=max_model_len, **settings)
    gen = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    for p, mine in zip(prompts, prefill_logits(llm, prompts), strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0]
        rel = relative_error(mine, ref)
        assert rel < 1e-4, f"relative logit error {rel:.2e} at prompt length {len(p)}"
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )
    for p, out in zip(prompts, outs, strict=True):
        ref = greedy_continuation(hf_model, p, max_tokens)
        assert out.token_ids == ref, f"greedy tokens differ at prompt length {len(p)}"


def greedy_continuation(model: Any, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """A transformers model's ``max_tokens`` greedy tokens after ``prompt`` (EOS ignored)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()


def save_random_lora(
    model: Any, out: Path, *, rank: int, alpha: int, targets: list[str], seed: int, b_scale: float,
    **config: Any,
) -> Path:  # fmt: skip
    """A PEFT LoRA adapter on ``model`` (a transformers model, left unchanged) with random A
    and B (``init_lora_weights=False``), B multiplied by ``b_scale`` so that it changes the
    greedy tokens, saved with ``save_pretrained`` under ``out``; ``config``: more LoraConfig."""
    import copy

    import peft

    torch.manual_seed(seed)
    lora = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config
    )
    adapted = peft.get_peft_model(copy.deepcopy(model), lora)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    adapted.save_pretrained(out)
    return out


def hf_model(folder: str | Path) -> Any:
    """transformers' own load of a checkpoint folder, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def edit_config(folder: Path, **changes: Any) -> None:
    """Change fields of a checkpoint's config.json (None deletes one)."""
    file = folder / "config.json"
    cfg = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    file.write_text(json.dumps(cfg))


# ---------------------------------------------------------------------- GGUF writing
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face tensor."""
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in glob:
        return glob[hf_name]
    _, _, idx, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{idx}.{_GGUF_LAYER[module]}.{kind}"


def permute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute of a q/k weight or bias."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3 rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tokenizer(writer: Any, vocab: int, bos_token_id: int = 1) -> None:
    """A minimal BPE tokenizer of ``vocab`` tokens (transformers builds it in well under a
    second); ``bos_token_id`` may be set outside the vocabulary, to craft a bad file."""
    # ends with <|endoftext|>, which transformers' GGUF converter adds when it is missing
    # (a tokenizer one token larger than the vocabulary is refused at load)
    tokens = ["t", "1", "t1"] + [f"x{i}" for i in range(vocab - 4)] + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_merges(["t 1"])
    writer.add_bos_token_id(bos_token_id)
    writer.add_eos_token_id(2)


def write_gguf_from_hf(
    folder: Path,
    path: Path,
    *,
    meta: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    tokens: int | None = None,
    bos_token_id: int = 1,
) -> Path:
    """A float32 GGUF of a Hugging Face checkpoint, as llama.cpp's converter lays it out
    (Llama q/k rows permuted; Llama 3 rope scaling as rope_freqs). ``meta`` overrides
    metadata fields (``{arch}.`` keys without the prefix; None deletes one), ``tokens``
    the vocabulary size of the tokenizer: both to craft bad files."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["model_type"]
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "block_count": cfg["num_hidden_layers"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "rope.freq_base": float(theta),
        "rope.dimension_count": head_dim,
    }
    if arch == "qwen3":
        fields |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    if rope.get("rope_type") == "linear":
        fields |= {"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])}
    fields |= meta or {}
    arrays = {}
    if rope.get("rope_type") == "llama3":
        arrays["rope_freqs.weight"] = llama3_rope_factors(rope, theta, head_dim)
    for name, t in tensors.items():
        a = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            a = permute_rotary_rows(a, heads)
        elif arch == "llama" and ".k_proj." in name:
            a = permute_rotary_rows(a, kv)
        arrays[gguf_name(name)] = np.ascontiguousarray(a)
    arrays |= extra_tensors or {}
    fields = {f"{arch}.{key}": value for key, value in fields.items() if value is not None}
    return write_gguf(
        path, arch, fields, arrays, tokens or cfg["vocab_size"], bos_token_id=bos_token_id
    )


def write_gguf(
    path: Path,
    arch: str,
    fields: dict[str, Any],
    tensors: dict[str, np.ndarray],
    vocab: int,
    *,
    bos_token_id: int = 1,
) -> Path:
    """A GGUF file of general.architecture ``arch``: metadata ``fields`` (full key -> str,
    float or int), a tiny BPE tokenizer of ``vocab`` tokens, and ``tensors`` as given."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    write_tokenizer(w, vocab, bos_token_id)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
