"""Weight updates of an engine whose layers are fused (``fused.layer``, CPU, fp32): the
RMSNorm gains the model multiplied into its projections at load stay folded, however the
new tensors are batched, across sleep(level=2), and a batch that cannot keep them folded is
refused before anything is copied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import make_tiny_checkpoint

from pitstop.entrypoints.llm import LLM
from pitstop.entrypoints.rollout.errors import WeightUpdateError
from pitstop.entrypoints.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 93, 40, 2], [61, 8, 8, 120, 33, 7, 1]]
# the fused layer's ops through torch on the CPU (no Triton interpreter: fast)
SETTINGS = dict(
    device="cpu",
    dtype="float32",
    kv_cache_gib=0.01,
    max_model_len=128,
    kernels="fused",
    options={"fused.layer": True, "fused.layer_rows": 0},
    threads=1,
)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _save(folder: Path, like: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint ``like`` at ``folder`` holding ``tensors``."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(like, folder)
    for file in folder.glob("*.safetensors"):
        file.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _perturbed(tensors: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """Every tensor moved (the norms' gains drawn again from U[0.5, 1.5])."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            out[name] = 0.5 + torch.rand(t.shape, generator=gen)
        else:
            out[name] = t + 0.5 * t.std() * torch.randn(t.shape, generator=gen)
    return out


def _params(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool):
    assert got.keys() == want.keys()
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), name
        else:
            torch.testing.assert_close(got[name], want[name], rtol=2e-6, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused-rollout")
    original = make_tiny_checkpoint(
        root, "llama", seed=3, with_tokenizer=False, norm_gains=(0.5, 1.5), num_hidden_layers=2
    )
    changed = _save(root / "changed", original, _perturbed(_tensors(original)))
    return {"original": original, "changed": changed}


@pytest.fixture(scope="module")
def fresh(checkpoints: dict[str, Path]) -> dict[str, tuple[dict, list]]:
    """Each checkpoint's parameters and greedy tokens in a fresh fused engine."""
    out = {}
    for key, folder in checkpoints.items():
        with LLM(str(folder), **SETTINGS) as llm:
            assert llm.engine.runner.model.fused_layers
            out[key] = (_params(llm), _greedy(llm))
    assert out["original"][1] != out["changed"][1], "the change shows in the tokens"
    return out


def test_one_batch_gives_the_weights_of_a_fresh_load(checkpoints, fresh) -> None:
    """Every tensor in one batch: the parameters a fresh engine of the new checkpoint holds,
    bit for bit, and its tokens; then back from disk, the original's bit for bit."""
    with LLM(str(checkpoints["original"]), **SETTINGS) as llm:
        llm.update_weights(_tensors(checkpoints["changed"]).items())
        _assert_params(_params(llm), fresh["changed"][0], exact=True)
        assert _greedy(llm) == fresh["changed"][1]
        llm.update_weights_from_disk(checkpoints["original"])
        _assert_params(_params(llm), fresh["original"][0], exact=True)
        assert _greedy(llm) == fresh["original"][1]


@pytest.mark.parametrize("norms_first", [False, True])
def test_buckets_that_part_a_norm_from_its_projections(checkpoints, fresh, norms_first) -> None:
    """A trainer's buckets: each layer's norms in one batch and every other tensor in
    another (either order), and q_proj alone in a third: the new checkpoint's weights (the
    rows a gain rescaled rounded once more) and its tokens."""
    new = _tensors(checkpoints["changed"])
    norms = {n: t for n, t in new.items() if n.endswith("norm.weight")}
    q = {n: t for n, t in new.items() if n.endswith("q_proj.weight")}
    rest = {n: t for n, t in new.items() if n not in norms and n not in q}
    batches = [norms, rest, q] if norms_first else [rest, q, norms]
    with LLM(str(checkpoints["original"]), **SETTINGS) as llm:
        for batch in batches:
            llm.update_weights(batch.items())
        _assert_params(_params(llm), fresh["changed"][0], exact=False)
        assert _greedy(llm) == fresh["changed"][1]


def test_after_sleep_level_2_gains_fold_whenever_they_arrive(checkpoints, fresh) -> None:
    """sleep(level=2) discards the weights: projections written before their norms are kept
    as given until the gains arrive, then folded (one rounding, as at load)."""
    new = _tensors(checkpoints["changed"])
    norms = {n: t for n, t in new.items() if n.endswith("norm.weight")}
    rest = {n: t for n, t in new.items() if n not in norms}
    with LLM(str(checkpoints["original"]), enable_sleep_mode=True, **SETTINGS) as llm:
        llm.sleep(level=2)
        llm.wake_up()
        llm.update_weights(rest.items())
        llm.update_weights(norms.items())
        _assert_params(_params(llm), fresh["changed"][0], exact=True)
        assert _greedy(llm) == fresh["changed"][1]


def test_a_gain_with_a_zero_needs_its_projection_in_the_same_batch(tmp_path, checkpoints) -> None:
    """Rows multiplied by a zero gain at load lost their values: a new gain alone cannot be
    folded into them, so the batch is refused (nothing copied, the tensors to add named);
    with the projection's tensors beside it, it goes."""
    tensors = _tensors(checkpoints["original"])
    name = "model.layers.0.input_layernorm.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3] = 0.0
    folder = _save(tmp_path / "zero", checkpoints["original"], tensors)
    gain = torch.full_like(tensors[name], 0.75)
    with LLM(str(folder), **SETTINGS) as llm:
        before = _params(llm)
        with pytest.raises(WeightUpdateError, match="q_proj.*in the same batch"):
            llm.update_weights([(name, gain)])
        _assert_params(_params(llm), before, exact=True)
        projections = {n: t for n, t in tensors.items() if n.startswith("model.layers.0.self_attn")}
        llm.update_weights([(name, gain), *projections.items()])
        tensors[name] = gain
        with LLM(str(_save(tmp_path / "gain", folder, tensors)), **SETTINGS) as want:
            _assert_params(_params(llm), _params(want), exact=True)


def test_adapters_loaded_before_a_gain_changes_take_the_new_gain(
    tmp_path, checkpoints, fresh
) -> None:
    """The ``lora`` plugin multiplies a fused layer's norm gain into the A of QKV and gate-up
    as it loads an adapter: an update that writes the gains has it load the adapter again,
    so its rows give a fresh engine's tokens of the new checkpoint, with the same adapter."""
    pytest.importorskip("peft")
    from helpers.checkpoints import hf_model, save_random_lora

    from pitstop import LoRARequest

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    folder = save_random_lora(
        hf_model(checkpoints["original"]), tmp_path / "adapter", rank=4, alpha=8,
        targets=targets, seed=7, b_scale=20,
    )  # fmt: skip
    request = LoRARequest("adapter", 1, str(folder))
    settings = dict(SETTINGS, enable_lora=True, max_loras=2, max_lora_rank=8)

    def tokens(llm: LLM) -> list[list[int]]:
        outs = llm.generate(
            prompt_token_ids=PROMPTS, sampling_params=GREEDY, lora_request=request, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    with LLM(str(checkpoints["changed"]), **settings) as llm:
        assert llm.engine.runner.model.fused_layers
        want = tokens(llm)
    with LLM(str(checkpoints["original"]), **settings) as llm:
        before = tokens(llm)  # the adapter in its slot, its A times the original gains
        llm.update_weights(_tensors(checkpoints["changed"]).items())
        assert tokens(llm) == want
        assert _greedy(llm) == fresh["changed"][1]
    assert before != want, "the change shows in the adapter's tokens"
