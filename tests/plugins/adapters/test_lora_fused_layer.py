"""LoRA inside the fused decoder layer (``fused.layer``, issues 44 and 47): exact against PEFT.

With ``fused.layer`` the model folds each RMSNorm's gain into the projection after it and
runs a layer as six ops; the ``lora`` plugin then hands each projection its
:class:`~pitstop.plugins.kernels.lora_reference.ProjectionLoRA`, the A of QKV and gate-up
taking the norm's gain too. Steps of at most ``fused.layer_rows`` rows add every row's
delta inside the Triton GEMMs (no LoRA launch of its own: the plugin's shrink/expand hook
never runs); longer steps (``layer_rows`` 0: all of them) take cuBLAS and the plugin's own
kernels after it. Either way each row of a batch that mixes adapters, ranks and rows of
the base model gives PEFT's ``merge_and_unload()`` tokens (fp32, greedy), through chunked
prefill and decode. The checkpoint's norm gains are drawn from U[0.5, 1.5], so that an A
without the gain, or with it twice, changes the tokens. Triton's interpreter runs the
GEMMs on a machine without CUDA (tests/plugins/adapters/conftest.py sets it).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.checkpoints import greedy_continuation, hf_model, save_random_lora

from pitstop import LLM, LoRARequest, SamplingParams
from pitstop.plugins.kernels.lora_reference import NEXT_LAYER_QKV

peft = pytest.importorskip("peft")
pytest.importorskip("triton")

from pitstop.plugins.adapters.lora import slots as lora_slots  # noqa: E402

# each step a whole model run in the interpreter: 3 tokens still give decodes beside the
# 24-token chunks and two decode-only steps, and change every adapter row's tokens
MAX_TOKENS = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, targets)
ADAPTERS: dict[str, tuple[int, list[str]]] = {
    "all8": (8, ALL),
    "qvd4": (4, ["q_proj", "v_proj", "down_proj"]),
    "kgu2": (2, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}
VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama whose norm gains are far from one, and one adapter folder per ADAPTERS."""
    from helpers.models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora-fused")
    # on the GPU heads of 64, so that q|k|v's borders (128, 192) fall on its 64-column tiles;
    # the interpreter's tiles are 16 columns wide, so the smaller default heads do there
    wide = (
        dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
        if torch.cuda.is_available()
        else {}
    )
    folders = {
        "base": make_tiny_checkpoint(
            root, "llama", seed=3, with_tokenizer=False, norm_gains=(0.5, 1.5),
            vocab_size=VOCAB, **wide,
        )
    }  # fmt: skip
    for i, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        folders[name] = save_random_lora(
            hf_model(folders["base"]), root / name, rank=rank, alpha=2 * rank,
            targets=targets, seed=10 + i, b_scale=20,
        )  # fmt: skip
    return folders


@cache
def _expected(base: Path, adapter: Path | None, prompt: tuple[int, ...]) -> list[int]:
    model = hf_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    return greedy_continuation(model, prompt, MAX_TOKENS)


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture
def hook_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How often the plugin's own delta ran after or inside a cuBLAS GEMM: the shrink and
    expand after it (``_add_delta``, ``lora.kernel=shrink_expand``) or the stacked layout's
    pack into it (``_stacked``, the default); and how often a fused-layer projection read the
    shrink the GEMM before it summed (``FusedLayer._reads_summed``); ``[delta, stacked,
    summed]``."""
    from pitstop.plugins.kernels import fused_layer

    calls = [0, 0, 0]
    for i, name in enumerate(("_add_delta", "_stacked")):
        method = getattr(lora_slots.LoRASlots, name)

        def counted(self: Any, *args: Any, _i: int = i, _m: Any = method, **kwargs: Any) -> Any:
            calls[_i] += 1
            return _m(self, *args, **kwargs)

        monkeypatch.setattr(lora_slots.LoRASlots, name, counted)
    reads = fused_layer.FusedLayer._reads_summed

    def counted_reads(self: Any, lora: Any) -> bool:
        found = reads(self, lora)
        calls[2] += found
        return found

    monkeypatch.setattr(fused_layer.FusedLayer, "_reads_summed", counted_reads)
    return calls


# (layer_rows, max_loras, lora.kernel): every step of up to 64 rows in the Triton GEMMs, the
# deltas inside them where a tile cannot mix adapters (one slot, or one row), the plugin's
# delta in or after cuBLAS where it can (three slots, several rows); every step in cuBLAS
ROWS_AND_SLOTS = [
    (64, 1, "stacked"),
    (64, 1, "stacked+shrink_before"),
    (64, 3, "stacked"),
    (0, 3, "stacked"),
    (0, 3, "shrink_expand"),
]


def _options(layer_rows: int, kernel: str) -> dict[str, Any]:
    """The engine options of a ROWS_AND_SLOTS row (``+shrink_before``: lora.shrink_before on:
    each projection's shrink summed by the Triton GEMM before it)."""
    kernel, _, before = kernel.partition("+")
    options: dict[str, Any] = {"fused.layer_rows": layer_rows, "lora.kernel": kernel}
    if before:
        options["lora.shrink_before"] = True
    return options


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's test (GPU: below)")
@pytest.mark.parametrize(("layer_rows", "max_loras", "kernel"), ROWS_AND_SLOTS)
def test_fused_layer_rows_match_peft_merged(
    tiny: dict[str, Path], hook_calls: list[int], layer_rows: int, max_loras: int, kernel: str
) -> None:
    """Chunks of 24 beside decodes, rows of three adapters (one with one slot) and none."""
    options = _options(layer_rows, kernel)
    _check_rows(tiny, hook_calls, layer_rows, "cpu", options, max_loras=max_loras)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize(("layer_rows", "max_loras", "kernel"), ROWS_AND_SLOTS)
def test_on_the_gpu_with_cuda_graphs(
    tiny: dict[str, Path], hook_calls: list[int], layer_rows: int, max_loras: int, kernel: str
) -> None:
    """On CUDA (fp32, each op's way chosen by the rule, not timed): decode steps replayed from
    CUDA graphs, the rows' slots in the static buffer the fused GEMMs read; PEFT's tokens."""
    options = {**_options(layer_rows, kernel), "fused.layer_tune": False}
    # decode graphs of at most 8 rows: the runner captures every graph size at start-up, and
    # those over layer_rows take cuBLAS with the plugin's delta (H200, 2026-12-06: 192 calls
    # from the 80..256-row captures of the default 256)
    llm = _check_rows(
        tiny, hook_calls, layer_rows, "cuda", options, max_loras=max_loras, max_batch_size=8
    )
    assert llm.engine.runner.graphs is not None, "decode should run from CUDA graphs"


def _check_rows(
    tiny: dict[str, Path],
    hook_calls: list[int],
    layer_rows: int,
    device: str,
    options: dict,
    max_loras: int,
    **engine: Any,
) -> LLM:
    llm = LLM(
        str(tiny["base"]),
        device=device,
        dtype="float32",
        kv_cache_gib=0.01,
        max_model_len=128,
        poison_memory=True,
        kernels="fused",
        options={"fused.layer": True, **options},
        scheduler="chunked",
        chunk_size=24,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=8,
        **engine,
    )
    model = llm.engine.runner.model
    assert all(layer.fused for layer in model.layers), "the layers must stay fused"
    own = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    before = bool(options.get("lora.shrink_before"))
    next_qkv = {NEXT_LAYER_QKV} if before else set()  # the down GEMM's, with lora.shrink_before
    assert set(model.layers[0].projection_lora) == own | next_qkv
    assert set(model.layers[-1].projection_lora) == own
    if before:
        first, second = model.layers[0].projection_lora, model.layers[1].projection_lora
        assert first[NEXT_LAYER_QKV] is second["qkv_proj"]
    names = ["all8", None, "qvd4", "kgu2", "all8", None, "kgu2"]
    if max_loras == 1:  # one adapter beside rows without one
        names = ["all8", None, "all8", None, "all8", None, "all8"]
    prompts = _prompts((9, 30, 17, 5, 33, 12, 3), seed=layer_rows)
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=GREEDY,
        lora_request=[None if n is None else LoRARequest(n, IDS[n], str(tiny[n])) for n in names],
        use_tqdm=False,
    )
    changed = 0
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        want = _expected(tiny["base"], None if name is None else tiny[name], tuple(prompt))
        assert out.token_ids == want, f"adapter {name} at prompt length {len(prompt)}"
        changed += name is not None and want != _expected(tiny["base"], None, tuple(prompt))
    assert changed >= 3, "the adapters should change the greedy tokens of most of their rows"
    delta, stacked, summed = hook_calls
    if layer_rows and max_loras == 1:
        assert delta == stacked == 0, "the deltas should run inside the fused GEMMs"
    elif options.get("lora.kernel") == "shrink_expand":
        assert delta > 0 and stacked == 0, "the plugin's shrink and expand after cuBLAS"
    else:  # cuBLAS steps, and steps of several rows that may mix adapters in a tile
        assert stacked > 0 and delta == 0, "the stacked pack inside the cuBLAS GEMMs"
    # lora.shrink_before: QKV (past the first layer), gate-up and down read the shrink that the
    # GEMM before them summed, in steps both run in Triton
    assert (summed > 0) == (before and layer_rows > 0 and max_loras == 1), summed
    return llm
