"""Launches the ``lora`` plugin costs per decoder layer on the Triton ops (issue 47), and their tokens.

The cost of multi-LoRA at small batches is the number of small launches per layer,
not bytes. A tiny Llama in the fused kernel set's layout (q|k|v and gate|up merged)
serves a batch mixing three adapters (two on all seven projections, one on q, v and
down; ranks 8 and 4) and rows of the base model, on the Triton ops (through Triton's
interpreter on a machine without CUDA, compiled with one). Every launch is counted
over whole steps: each launch of a kernel of ``triton_ops.lora``
(``JITFunction[grid](...)``, patched at ``KernelInterface.__getitem__``) and each torch
op that would launch a kernel (a ``TorchDispatchMode``: everything but views and
allocations) inside the plugin's per-projection hook. The base model runs on the
reference kernels on CPU, on the fused kernel set on CUDA (eagerly: the count is that
of the launches a captured graph holds).

Per step: one ``lora_meta`` launch; per layer and LoRA'd projection (qkv, o, gate_up,
down: 4): with ``lora.kernel=fused`` one launch and no torch op (no zeroing, no copy,
no intermediate); with the default ``shrink_expand`` two (the shrink, the expand) and no
torch op (their workspace is zeroed once a step, for every projection). The generated tokens must be PEFT's merged model's, row for row.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import pytest  # noqa: E402
from helpers.checkpoints import greedy_continuation, hf_model, save_random_lora  # noqa: E402
from helpers.launches import KernelLaunches, count_triton_launches  # noqa: E402
from helpers.models import make_tiny_checkpoint  # noqa: E402

from pitstop import LLM, LoRARequest, SamplingParams  # noqa: E402

peft = pytest.importorskip("peft")
triton = pytest.importorskip("triton")

from pitstop.plugins.adapters.lora import slots as lora_slots  # noqa: E402
from pitstop.plugins.kernels.triton_ops import lora as lora_ops  # noqa: E402
from pitstop.plugins.kernels.triton_ops import lora_pack  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAUNCHES_PER_LAYER = 4  # LoRA'd projections a layer: qkv, o, gate_up, down
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Launches(KernelLaunches):
    """Counts the LoRA ops' Triton launches and kernel-launching torch ops inside the hook."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_calls = 0
        self.steps = 0


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch):
    """A :class:`Launches` over everything run inside the ``with``-less test body."""
    counter = Launches()
    # not the base model's (on CUDA): the LoRA ops' kernels only
    mine = (lora_ops.__name__, lora_pack.__name__)
    count_triton_launches(monkeypatch, counter, lambda kernel: kernel.fn.__module__ in mine)
    hook = lora_slots.LoRASlots._add_delta

    def counted_hook(self: Any, *args: Any) -> Any:
        counter.hook_calls += 1
        counter.scope += 1
        try:
            return hook(self, *args)
        finally:
            counter.scope -= 1

    monkeypatch.setattr(lora_slots.LoRASlots, "_add_delta", counted_hook)
    prepare = lora_slots.LoRASlots._prepare

    def counted_prepare(self: Any, seqs: Any) -> Any:
        counter.steps += 1
        return prepare(self, seqs)

    monkeypatch.setattr(lora_slots.LoRASlots, "_prepare", counted_prepare)
    # the Triton ops on CPU too (the plugin picks the reference there)
    monkeypatch.setattr(lora_slots, "kernel_ops", lambda device: lora_ops)
    from pitstop.plugins.kernels.reference import ReferenceKernels

    monkeypatch.setattr(ReferenceKernels, "merge_projections", True)
    return counter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_launches")
    base = make_tiny_checkpoint(root, "llama")
    folders = {"base": base}
    for i, (name, rank, targets) in enumerate(
        [("all8", 8, ALL), ("all4", 4, ALL), ("qvd", 8, ["q_proj", "v_proj", "down_proj"])]
    ):
        folders[name] = save_random_lora(
            hf_model(base), root / name, rank=rank, alpha=2 * rank, targets=targets,
            seed=i + 1, b_scale=20,
        )  # fmt: skip
    return folders


def _generate(tiny: dict[str, Path], launches: Launches, kernel: str, seed: int, max_tokens: int):
    """A tiny merged-layout engine on the LoRA ``kernel``, eager (the count is that of the
    launches a captured graph holds), four prompts under three adapters and none, generated
    inside ``launches``; returns the engine, the adapters' names, the prompts and the outputs."""
    llm = LLM(
        str(tiny["base"]),
        device=DEVICE,
        dtype="float32",
        kv_cache_gib=0.01,
        max_model_len=128,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        kernels="fused" if DEVICE == "cuda" else "reference",
        enforce_eager=True,
        options={"lora.kernel": kernel},
    )
    names = ["all8", None, "qvd", "all4"]
    ids = {"all8": 1, "all4": 2, "qvd": 3}
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (7, 12, 5, 9)]
    requests = [None if n is None else LoRARequest(n, ids[n], str(tiny[n])) for n in names]
    with launches:
        outs = llm.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            lora_request=requests,
            use_tqdm=False,
        )
    return llm, names, prompts, outs


def _assert_peft_tokens(tiny: dict[str, Path], names, prompts, outs, max_tokens: int) -> None:
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        model_ = hf_model(tiny["base"])
        if name is not None:
            model_ = peft.PeftModel.from_pretrained(model_, str(tiny[name])).merge_and_unload()
        want = greedy_continuation(model_.eval(), tuple(prompt), max_tokens)
        assert out.token_ids == want, f"adapter {name}"


@pytest.mark.parametrize("kernel", ["fused", "shrink_expand"])
def test_launches_per_lora_projection_and_layer(
    tiny: dict[str, Path], launches, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lora.kernel=fused``: one launch a LoRA'd projection, no torch op; the default
    ``shrink_expand``: a shrink and an expand (two; the workspace they share is zeroed once
    a step, outside the projections), measured faster on the H200. The workspace holds 16
    rows here: the first step's 33 prompt rows are over it, as a prefill chunk is, and its
    shrinks go unsplit into intermediates of their own, still with no memset in the hook;
    the decode steps' 4 rows shrink into the workspace."""
    monkeypatch.setattr(lora_slots, "WORKSPACE_ROWS", 16)
    max_tokens = 3
    llm, names, prompts, outs = _generate(tiny, launches, kernel, 5, max_tokens)
    model = llm.engine.runner.model
    assert hasattr(model.layers[0].self_attn, "qkv_proj"), "the merged layout"
    assert llm.engine.runner.adapters.ops is lora_ops
    layers = len(model.layers)
    steps = launches.steps
    assert steps >= max_tokens
    assert launches.hook_calls == steps * layers * LAUNCHES_PER_LAYER
    per_step = launches.triton["_meta_kernel"]
    layer_launches = sum(launches.triton.values()) - per_step + sum(launches.torch.values())
    counts = f"Triton {dict(launches.triton)}, torch {dict(launches.torch)} over {steps} steps"
    assert per_step == steps, f"lora_meta once a step: {counts}"
    per_projection = 1 if kernel == "fused" else 2
    want = steps * layers * LAUNCHES_PER_LAYER * per_projection
    assert layer_launches == want, (
        f"{layer_launches / (steps * layers):g} launches a layer, not "
        f"{LAUNCHES_PER_LAYER * per_projection}: {counts}"
    )
    projections = steps * layers * LAUNCHES_PER_LAYER
    assert launches.torch == Counter(), f"torch ops inside the LoRA hook: {counts}"
    if kernel == "fused":
        assert launches.triton["_fused_kernel"] == projections, counts
    else:
        assert launches.triton["_shrink_kernel"] == launches.triton["_expand_kernel"] == projections
    _assert_peft_tokens(tiny, names, prompts, outs, max_tokens)


def test_stacked_layout_packs_once_a_projection(
    tiny: dict[str, Path], launches, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lora.kernel=stacked`` on the Triton ops (the interpreter on CPU): a step within the
    workspace's rows runs one ``lora_pack`` launch a LoRA'd projection and no torch op in it
    (the GEMM that follows is the base one, over ``[x | h']``: no expand); the first step's
    33 prompt rows, over the 16 here, take ``_add_large`` (no projection packs steps that
    large here: ``packs_large_steps`` says no): three library calls a projection (the
    GEMM into the used slots' columns, the rows' scales, the GEMM adding into y) and no
    Triton launch. Tokens are PEFT's."""
    monkeypatch.setattr(lora_slots, "WORKSPACE_ROWS", 16)
    monkeypatch.setattr(lora_slots, "packs_large_steps", lambda n, k: False)
    pack = lora_slots.LoRASlots._pack
    packs: list[int] = []

    def counted_pack(self: Any, x: torch.Tensor, proj: Any) -> torch.Tensor:
        packs.append(x.shape[0])
        launches.scope += 1
        try:
            return pack(self, x, proj)
        finally:
            launches.scope -= 1

    monkeypatch.setattr(lora_slots.LoRASlots, "_pack", counted_pack)
    add_large = lora_slots.LoRASlots._add_large
    larges: list[int] = []

    def counted_large(self: Any, x: torch.Tensor, y: torch.Tensor, proj: Any) -> None:
        larges.append(x.shape[0])
        launches.scope += 1
        try:
            add_large(self, x, y, proj)
        finally:
            launches.scope -= 1

    monkeypatch.setattr(lora_slots.LoRASlots, "_add_large", counted_large)
    max_tokens = 3
    llm, names, prompts, outs = _generate(tiny, launches, "stacked", 6, max_tokens)
    layers = len(llm.engine.runner.model.layers)
    counts = f"Triton {dict(launches.triton)}, torch {dict(launches.torch)}"
    decode_steps = launches.steps - 1  # the prompts' 33 rows in one step, then 4 rows a step
    assert decode_steps >= max_tokens - 1 and set(packs) == {4}, packs
    assert len(packs) == decode_steps * layers * LAUNCHES_PER_LAYER
    assert launches.triton["_pack_kernel"] == len(packs), counts
    assert set(larges) == {33} and len(larges) == layers * LAUNCHES_PER_LAYER, larges
    assert launches.hook_calls == 0, "no shrink or expand: the prompt step's deltas are GEMMs"
    library = {"matmul": 1, "mul_": 1, "addmm_": 1}
    want = Counter({op: n * len(larges) for op, n in library.items()})
    assert launches.torch == want, f"three library calls a large step's projection: {counts}"
    _assert_peft_tokens(tiny, names, prompts, outs, max_tokens)
