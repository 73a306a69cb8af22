"""The fused MoE op (:mod:`pitstop.plugins.kernels.triton_ops.moe`) against the loop over experts.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` before
Triton's first import, hence the first lines). Truth is :mod:`moe_reference`'s loop in
float64 over the routing the kernel chose; the routing itself is checked against
``torch.softmax`` + ``torch.topk`` (values, and the set of experts wherever no tie
straddles the k-th place; ties are ordered as a stable sort orders them). Logits are
multiples of 1/2, so probabilities are either exactly tied or far apart. The autotune
is tested only through its cache, with a fake timer.
"""

from __future__ import annotations

import itertools
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pitstop.plugins.kernels import moe_reference as ref  # noqa: E402

pytest.importorskip("triton")

from helpers.poison import poisoned_outputs  # noqa: E402

from pitstop.plugins.kernels.triton_ops import moe, moe_routing, moe_tiles  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |fused - truth| / max |truth| per activation dtype (truth: float64 of the same routing)
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
WEIGHT_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
FEW = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def relative_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest difference from the float64 ``truth``, over its largest magnitude."""
    return ((out.cpu().double() - truth).abs().max() / truth.abs().max().clamp_min(1e-6)).item()


def make_logits(gen: torch.Generator, t: int, e: int, mode: str) -> torch.Tensor:
    """Logits in steps of 1/2: ``random`` in [-4, 4], ``same`` (every token's top experts are
    those of token 0, with their order), ``flat`` (all equal: one big tie)."""
    if mode == "flat":
        return torch.zeros(t, e)
    logits = torch.randint(-8, 9, (t, e), generator=gen).float() / 2
    if mode == "same":
        logits = logits[:1].expand(t, e) + 0.0
    return logits


def check_routing(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    """The kernel's routing is a top-k of torch's softmax, ties in stable-sort order."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    assert torch.equal(ids.long().cpu(), order[:, :top_k]), "ids: not the stable top-k"
    tk_values, tk_ids = torch.topk(probs, top_k, dim=-1)
    torch.testing.assert_close(values[:, :top_k], tk_values)  # the same values as torch.topk
    e = logits.shape[1]
    for row in range(logits.shape[0]):
        straddles = top_k < e and values[row, top_k - 1] == values[row, top_k]
        if not straddles:
            assert set(tk_ids[row].tolist()) == set(ids[row].tolist())
    want, _ = ref.route(logits, top_k, renormalize, weights_dtype)
    assert weights.dtype == (weights_dtype or torch.float32)
    tol = WEIGHT_TOL[weights_dtype or torch.float32]
    torch.testing.assert_close(weights.float().cpu(), want.float(), atol=tol, rtol=tol)


@FEW
@given(
    t=st.integers(1, 9),
    e=st.integers(1, 8),
    k_frac=st.floats(0, 1),
    h=st.sampled_from([16, 24, 40]),
    f=st.sampled_from([8, 16, 24]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    renormalize=st.booleans(),
    mode=st.sampled_from(["random", "random", "same", "flat"]),
    seed=st.integers(0, 2**16),
)
@example(
    t=1, e=8, k_frac=0.0, h=16, f=8, dtype=torch.bfloat16, renormalize=True, mode="random", seed=1
)
@example(
    t=5, e=4, k_frac=1.0, h=24, f=16, dtype=torch.float32, renormalize=False, mode="random", seed=2
)
@example(
    t=9, e=8, k_frac=0.3, h=40, f=24, dtype=torch.bfloat16, renormalize=True, mode="same", seed=3
)
def test_fused_moe_equals_the_loop_over_experts(
    t: int,
    e: int,
    k_frac: float,
    h: int,
    f: int,
    dtype: torch.dtype,
    renormalize: bool,
    mode: str,
    seed: int,
) -> None:
    """fused_moe == the float64 loop over experts, for k = 1..E, T from 1, with ties, experts
    choosing no token, and every token choosing the same experts."""
    top_k = 1 + round(k_frac * (e - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    logits = make_logits(gen, t, e, mode).to(dtype)
    gate_up = (torch.randn(e, 2 * f, h, generator=gen) / h**0.5).to(dtype)
    down = (torch.randn(e, h, f, generator=gen) / f**0.5).to(dtype)
    weights_dtype = dtype if renormalize else None  # Qwen3-MoE's cast, Mixtral's float32
    args = [a.to(DEVICE) for a in (x, logits, gate_up, down)]
    with poisoned_outputs():
        out = moe.fused_moe(*args, top_k, renormalize=renormalize, weights_dtype=weights_dtype)
        weights, ids = moe_routing.route(args[1], top_k, renormalize, weights_dtype)
    check_routing(logits, top_k, renormalize, weights_dtype, weights, ids)
    truth = ref.experts(
        x.double(), weights.cpu().double(), ids.cpu(), gate_up.double(), down.double()
    )
    assert out.dtype == dtype and out.shape == (t, h)
    assert torch.isfinite(out).all(), "an unwritten or NaN output element"
    err = relative_error(out, truth)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"
    # the reference (transformers' own rounding) agrees within the same bound
    want = ref.experts(x, weights.cpu(), ids.cpu(), gate_up, down)
    ref_err = relative_error(want, truth)
    assert ref_err <= 2 * TOL[dtype]


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` as e4m3 with a float32 scale per row (the ``fp8`` format's rounding)."""
    from pitstop.plugins.weight_formats.fp8 import quantize_rows

    q, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
    return q.reshape(w.shape), scale.reshape(w.shape[:2]).contiguous()


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    t=st.integers(1, 9),
    e=st.integers(1, 6),
    k_frac=st.floats(0, 1),
    h=st.sampled_from([16, 40]),
    f=st.sampled_from([8, 24]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    mode=st.sampled_from(["random", "same"]),
    seed=st.integers(0, 2**16),
)
@example(t=9, e=6, k_frac=0.5, h=40, f=24, dtype=torch.bfloat16, mode="same", seed=7)
def test_fp8_experts_equal_the_loop_over_their_dequantized_weights(
    t: int, e: int, k_frac: float, h: int, f: int, dtype: torch.dtype, mode: str, seed: int
) -> None:
    """fp8 experts (e4m3, a scale per output row): the fused weight-only GEMMs equal the
    float64 loop over ``q * scale``, and the reference loop (which widens each expert to
    ``x``'s dtype first) agrees within the dtype's bound."""
    top_k = 1 + round(k_frac * (e - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    logits = make_logits(gen, t, e, mode).to(dtype)
    gate_up, gu_scale = quantize_experts(torch.randn(e, 2 * f, h, generator=gen) / h**0.5)
    down, d_scale = quantize_experts(torch.randn(e, h, f, generator=gen) / f**0.5)
    scales = (gu_scale.to(DEVICE), d_scale.to(DEVICE))
    args = [a.to(DEVICE) for a in (x, logits, gate_up, down)]
    with poisoned_outputs():
        out = moe.fused_moe(*args, top_k, renormalize=True, weights_dtype=dtype, scales=scales)
        weights, ids = moe_routing.route(args[1], top_k, True, dtype)
    wide_gate_up = gate_up.double() * gu_scale.double()[..., None]
    wide_down = down.double() * d_scale.double()[..., None]
    truth = ref.experts(x.double(), weights.cpu().double(), ids.cpu(), wide_gate_up, wide_down)
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = relative_error(out, truth)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"
    cpu_scales = (gu_scale, d_scale)
    want = ref.experts(x, weights.cpu(), ids.cpu(), gate_up, down, cpu_scales)
    ref_err = relative_error(want, truth)
    assert ref_err <= 2 * TOL[dtype]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    t=st.integers(1, 40),
    e=st.sampled_from([1, 3, 8, 60, 128, 256]),
    top_k=st.integers(1, 8),
    renormalize=st.booleans(),
    mode=st.sampled_from(["random", "same", "flat"]),
    seed=st.integers(0, 2**16),
)
def test_routing_kernel(
    t: int, e: int, top_k: int, renormalize: bool, mode: str, seed: int
) -> None:
    """Softmax + top-k + renormalisation in one kernel, for E up to 256 and k up to 8, with
    the per-expert row counts it adds up."""
    top_k = min(top_k, e)
    logits = make_logits(torch.Generator().manual_seed(seed), t, e, mode).to(torch.bfloat16)
    counts = torch.zeros(e, dtype=torch.int32, device=DEVICE)
    with poisoned_outputs():
        weights, ids = moe_routing.route(
            logits.to(DEVICE), top_k, renormalize, torch.bfloat16, counts
        )
    check_routing(logits, top_k, renormalize, torch.bfloat16, weights, ids)
    assert torch.equal(counts.cpu(), torch.bincount(ids.cpu().flatten().long(), minlength=e).int())


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    t=st.integers(1, 30),
    e=st.integers(1, 20),
    k_frac=st.floats(0, 1),
    block_m=st.sampled_from([1, 4, 16]),
    same=st.booleans(),
    seed=st.integers(0, 2**16),
    one_program=st.booleans(),
)
def test_align_groups_rows_by_expert(
    t: int, e: int, k_frac: float, block_m: int, same: bool, seed: int, one_program: bool
) -> None:
    """Every flat row once, in a block of its expert; padding is the sentinel; the buffers
    have the worst-case size; blocks past the used ones are -1. Both paths: one program
    that counts and ranks the rows itself (few rows: in row order within each expert), and
    the counted, atomic scatter over several programs."""
    top_k = 1 + round(k_frac * (e - 1))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    if same:
        ids = ids[:1].expand(t, top_k).contiguous()
    limit = moe_routing.ONE_PROGRAM_ROWS
    moe_routing.ONE_PROGRAM_ROWS = 10**6 if one_program else 0
    try:
        with poisoned_outputs():
            g = moe_routing.align(ids.to(DEVICE), e, block_m)
    finally:
        moe_routing.ONE_PROGRAM_ROWS = limit
    n = t * top_k
    counts = torch.bincount(ids.flatten(), minlength=e)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    assert g.sorted_rows.numel() == moe_routing.max_padded_rows(n, e, block_m)
    assert (
        g.sorted_rows.numel() >= total and g.sorted_rows.numel() <= n + e * (block_m - 1) + block_m
    )
    assert int(g.num_padded) == total
    rows = g.sorted_rows[:total].cpu().long()
    real = rows[rows < n]
    assert sorted(real.tolist()) == list(range(n))
    assert (rows[rows >= n] == n).all()
    blocks = g.expert_ids.cpu().long()
    used = total // block_m
    assert (blocks[used:] == -1).all()
    flat = ids.flatten()
    for b in range(used):
        mine = rows[b * block_m : (b + 1) * block_m]
        mine = mine[mine < n]
        assert mine.numel() > 0, "a block with no row"
        assert (flat[mine] == blocks[b]).all()
        if one_program:
            assert mine.tolist() == sorted(mine.tolist()), "ranked: rows in row order"
    assert sorted(set(blocks[:used].tolist())) == sorted(set(flat.tolist()))


def test_interpreter_uses_the_heuristic_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    """No autotune in the interpreter: the documented heuristic, logged once."""
    if DEVICE.type == "cuda":
        pytest.skip("the GPU autotunes")
    moe_tiles._logged.discard("interpreter")
    x = torch.randn(3, 16)
    logits = torch.randn(3, 4)
    gate_up, down = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    with caplog.at_level(logging.WARNING, logger=moe_tiles.__name__):
        for _ in range(2):
            moe.fused_moe(x, logits, gate_up, down, 2, renormalize=True)
    lines = [r.getMessage() for r in caplog.records if "heuristic" in r.getMessage()]
    assert len(lines) == 1 and "interpreter" in lines[0]
    assert moe_tiles.heuristic_config(3, 4, 2, torch.float32, False) == moe_tiles.INTERPRETER_CONFIG


def test_autotune_cache_reads_writes_and_keys(tmp_path: Path) -> None:
    """The fastest config by the (fake) timer is cached on disk under its key; a second
    process reads it without timing; another bucket, dtype, device or Triton times again."""
    timed: list[moe_tiles.MoEConfig] = []
    fake_us = {cfg: 10.0 + i for i, cfg in enumerate(moe_tiles.FEW_ROWS)}
    fake_us[moe_tiles.FEW_ROWS[2]] = 1.0  # the winner

    def measure(cfg: moe_tiles.MoEConfig) -> float:
        timed.append(cfg)
        if cfg == moe_tiles.FEW_ROWS[3]:
            raise RuntimeError("out of shared memory")  # skipped, not fatal
        return fake_us[cfg]

    def key(t=1, dtype=torch.bfloat16, device="NVIDIA H200", version="3.6.0") -> str:
        return moe_tiles.ConfigCache.key(t, 128, 8, 2048, 768, dtype, device, version)

    cache = moe_tiles.ConfigCache(tmp_path)
    assert (
        moe_tiles.autotune(key(), list(moe_tiles.FEW_ROWS), measure, cache) == moe_tiles.FEW_ROWS[2]
    )
    assert timed == list(moe_tiles.FEW_ROWS)
    data = json.loads((tmp_path / moe_tiles.ConfigCache.FILE).read_text())
    assert data == {key(): list(moe_tiles.FEW_ROWS[2])}
    revision = moe_tiles.KERNEL_REVISION
    assert f"T1-E128-k8-H2048-F768|bfloat16|NVIDIA H200|triton 3.6.0|kernels {revision}" in data

    timed.clear()
    fresh = moe_tiles.ConfigCache(tmp_path)  # another process: reads the file
    assert (
        moe_tiles.autotune(key(), list(moe_tiles.FEW_ROWS), measure, fresh) == moe_tiles.FEW_ROWS[2]
    )
    assert timed == []
    assert key(t=3) == key(t=4) != key(t=5)  # buckets: powers of two
    for other in (
        key(t=16),
        key(dtype=torch.float16),
        key(device="NVIDIA A100"),
        key(version="3.9.0"),
    ):
        assert fresh.get(other) is None
        timed.clear()
        moe_tiles.autotune(other, list(moe_tiles.FEW_ROWS), measure, fresh)
        assert len(timed) == len(moe_tiles.FEW_ROWS)
    assert len(json.loads((tmp_path / moe_tiles.ConfigCache.FILE).read_text())) == 5

    (tmp_path / moe_tiles.ConfigCache.FILE).write_text("{not json")  # unreadable: empty, rewritten
    assert moe_tiles.ConfigCache(tmp_path).get(key()) is None
    moe_tiles.autotune(key(), list(moe_tiles.FEW_ROWS), measure, moe_tiles.ConfigCache(tmp_path))
    assert json.loads((tmp_path / moe_tiles.ConfigCache.FILE).read_text()) == {
        key(): list(moe_tiles.FEW_ROWS[2])
    }


def test_cache_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``$PITSTOP_CACHE_DIR`` when set, else ``~/.cache/pitstop/moe``."""
    monkeypatch.setenv("PITSTOP_CACHE_DIR", str(tmp_path))
    assert moe_tiles.cache_dir() == tmp_path
    monkeypatch.delenv("PITSTOP_CACHE_DIR")
    assert moe_tiles.cache_dir() == Path.home() / ".cache" / "pitstop" / "moe"


# ---------------------------------------------------------------- through the kernel sets


def _kernel_set(name: str, dtype: torch.dtype, **options: object):
    """A kernel set as the engine builds it (``options``: its settings, ``fused.moe``)."""
    from pitstop.entrypoints.engine_args import engine_config
    from pitstop.plugin_system.plugin_manager import get_plugin_manager

    config = engine_config(max_model_len=64, options=dict(options))
    return get_plugin_manager().create("kernels", name, config, DEVICE, dtype)


@pytest.mark.parametrize(
    ("dtype", "renormalize", "weights_dtype"),
    [
        (torch.float32, True, torch.float32),  # Qwen3-MoE: the weights cast to x's dtype
        (torch.bfloat16, False, torch.bfloat16),
        (torch.bfloat16, True, None),  # Mixtral: float32 routing weights
    ],
)
def test_the_kernel_sets_moe_ops_agree(
    dtype: torch.dtype, renormalize: bool, weights_dtype: torch.dtype | None
) -> None:
    """The fused set's ``moe`` (Triton) and the reference set's (the loop) on the same inputs:
    8 tokens over 6 experts, top-2, some experts chosen by none."""
    from pitstop.plugin_system.protocols import KernelSetBase, MoEOps

    fused, reference = _kernel_set("fused", dtype), _kernel_set("reference", dtype)
    assert fused.describe()["moe"] == "triton" and isinstance(fused, MoEOps)
    assert reference.describe()["moe"] == "reference (PyTorch)"
    gen = torch.Generator().manual_seed(5)
    t, e, h, f = 8, 6, 32, 16
    x = torch.randn(t, h, generator=gen).to(dtype)
    logits = make_logits(gen, t, e, "random").to(dtype)
    gate_up = (torch.randn(e, 2 * f, h, generator=gen) / h**0.5).to(dtype)
    down = (torch.randn(e, h, f, generator=gen) / f**0.5).to(dtype)
    args = [a.to(DEVICE) for a in (x, logits, gate_up, down)]
    kw = dict(renormalize=renormalize, weights_dtype=weights_dtype)
    with poisoned_outputs():
        got = KernelSetBase.of(fused, "moe")(*args, 2, **kw)
    want = reference.moe(*args, 2, **kw)
    assert got.dtype == want.dtype == dtype and torch.isfinite(got).all()
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err <= 2 * TOL[dtype], f"relative error {err:.3g}"


def test_fused_moe_off_runs_the_loop_and_no_cuda_graphs() -> None:
    """``fused.moe=false``: the reference loop (it reads the experts hit on the host), so
    the set no longer declares decode graph-safe."""
    ks = _kernel_set("fused", torch.float32, **{"fused.moe": False})
    assert ks.describe()["moe"] == "reference (config flag fused.moe is off)"
    assert ks.cuda_graph_safe(64) is False
    assert _kernel_set("fused", torch.float32).cuda_graph_safe(64) is True


# ---------------------------------------------------------------- split-K (issue 48)

SPLITS = (1, 2, 3, 4)
# blocks of 16 rows (the decode tiles') and of 64 (the prefill tiles')
BLOCKS = (moe_tiles.INTERPRETER_CONFIG, moe_tiles.INTERPRETER_CONFIG._replace(block_m=64))


# split-K is out of the autotune (kept for moe_bench --split): fewer examples than the rest
@settings(max_examples=5, deadline=None, derandomize=True)
@given(
    t=st.integers(1, 20),
    e=st.integers(1, 8),
    k_frac=st.floats(0, 1),
    h=st.sampled_from([16, 40, 80]),
    f=st.sampled_from([8, 24, 40]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    mode=st.sampled_from(["random", "same", "flat"]),
    seed=st.integers(0, 2**16),
)
@example(t=1, e=8, k_frac=0.0, h=80, f=40, dtype=torch.bfloat16, fp8=False, mode="random", seed=1)
@example(t=17, e=4, k_frac=0.4, h=40, f=24, dtype=torch.float32, fp8=False, mode="same", seed=2)
@example(t=18, e=6, k_frac=0.5, h=80, f=40, dtype=torch.bfloat16, fp8=True, mode="random", seed=3)
@example(t=3, e=8, k_frac=1.0, h=16, f=8, dtype=torch.float16, fp8=False, mode="flat", seed=4)
def test_every_split_k_equals_the_loop_over_experts(
    t: int,
    e: int,
    k_frac: float,
    h: int,
    f: int,
    dtype: torch.dtype,
    fp8: bool,
    mode: str,
    seed: int,
) -> None:
    """fused_moe with split_k 1, 2, 3 (uneven: H 80 is 5 chunks of 16 in 3 splits of 2, 2, 1;
    H 40 ends in a half chunk) and 4 == the float64 loop over experts, bf16/fp16/fp32 and
    fp8 experts, T from 1 to past BLOCK_M, experts choosing none, every token choosing the
    same experts; and the splits agree with split 1 within the same bound."""
    if fp8 and dtype == torch.float16:
        dtype = torch.bfloat16
    top_k = 1 + round(k_frac * (e - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    logits = make_logits(gen, t, e, mode).to(dtype)
    gate_up = torch.randn(e, 2 * f, h, generator=gen) / h**0.5
    down = torch.randn(e, h, f, generator=gen) / f**0.5
    if fp8:
        gate_up, gu_scale = quantize_experts(gate_up)
        down, d_scale = quantize_experts(down)
        scales = (gu_scale.to(DEVICE), d_scale.to(DEVICE))
        wide = (
            gate_up.double() * gu_scale.double()[..., None],
            down.double() * d_scale.double()[..., None],
        )
    else:
        gate_up, down, scales = gate_up.to(dtype), down.to(dtype), None
        wide = gate_up.double(), down.double()
    args = [a.to(DEVICE) for a in (x, logits, gate_up, down)]
    weights, ids = moe_routing.route(args[1], top_k, True, dtype)
    truth = ref.experts(x.double(), weights.cpu().double(), ids.cpu(), *wide)
    outs = {}
    for base, split in itertools.product(BLOCKS, SPLITS):
        config = base._replace(split_k=split)
        with poisoned_outputs():
            out = moe.fused_moe(
                *args, top_k, renormalize=True, weights_dtype=dtype, config=config, scales=scales
            )
        assert out.dtype == dtype and out.shape == (t, h)
        assert torch.isfinite(out).all(), f"{config}: an unwritten or NaN output element"
        err = relative_error(out, truth)
        assert err <= TOL[dtype], f"{config}: relative error {err:.3g} > {TOL[dtype]}"
        outs[config] = out.cpu().double()
        scale = truth.abs().max().clamp_min(1e-6)
        diff = ((outs[config] - outs[BLOCKS[0]]).abs().max() / scale).item()
        assert diff <= TOL[dtype], f"{config} vs unsplit: {diff:.3g}"


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    t=st.integers(1, 18),
    e=st.integers(1, 6),
    k_frac=st.floats(0, 1),
    h=st.sampled_from([16, 40]),
    f=st.sampled_from([8, 24, 40]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fp8=st.booleans(),
    same=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(t=17, e=3, k_frac=1.0, h=40, f=40, dtype=torch.bfloat16, fp8=True, same=False, seed=5)
def test_split_k_is_bit_identical_where_the_float32_sums_are_exact(
    t: int,
    e: int,
    k_frac: float,
    h: int,
    f: int,
    dtype: torch.dtype,
    fp8: bool,
    same: bool,
    seed: int,
) -> None:
    """Small integers (and power-of-two scales and routing weights), gates of at least 32
    (``silu(g) == g`` in float32): every float32 sum is exact in any order, so every split
    gives the unsplit bits, with blocks of 16 and of 64 rows: the last split's epilogue
    (scales, SiLU·mul, rounding) is the unsplit one, and splits and slots are all summed."""
    top_k = 1 + round(k_frac * (e - 1))
    gen = torch.Generator().manual_seed(seed)

    def ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi + 1, shape, generator=gen).float()

    x = ints(1, 2, t, h).to(dtype)
    gate_up = torch.cat([ints(2, 3, e, f, h), ints(-1, 1, e, f, h)], dim=1)
    down = ints(-1, 1, e, h, f)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    if same:
        ids = ids[:1].expand(t, top_k).contiguous()
    weights = (ints(1, 2, t, top_k) / 2).to(dtype)
    if fp8:
        gate_up, down = gate_up.to(torch.float8_e4m3fn), down.to(torch.float8_e4m3fn)
        scales = (2.0 ** ints(0, 1, e, 2 * f), 2.0 ** ints(-1, 0, e, h))
        scales = tuple(s.to(DEVICE) for s in scales)
    else:
        gate_up, down, scales = gate_up.to(dtype), down.to(dtype), None
    args = [a.to(DEVICE) for a in (x, weights, ids, gate_up, down)]
    outs = {}
    for base, split in itertools.product(BLOCKS, SPLITS):
        config = base._replace(split_k=split)
        with poisoned_outputs():
            outs[config] = moe.experts(*args, config=config, scales=scales).cpu()
    first = outs[BLOCKS[0]]
    assert torch.isfinite(first).all()
    for config, out in outs.items():
        assert torch.equal(out, first), f"{config}: not the unsplit bits"


def test_effective_split_and_the_heuristic_splits() -> None:
    """Splits run whole BLOCK_K chunks, none empty; the GPU heuristic splits decode of
    Qwen3-30B-A3B 8 ways at batch 1, 2 at 8 and 16, not from 32 (docstring)."""
    assert moe_tiles.effective_split(2048, 128, 1) == (1, 2048)
    assert moe_tiles.effective_split(2048, 128, 4) == (4, 512)
    assert moe_tiles.effective_split(768, 128, 4) == (3, 256)  # 6 chunks: 2 a split
    assert moe_tiles.effective_split(80, 16, 3) == (3, 32)  # 5 chunks: 2, 2, 1
    assert moe_tiles.effective_split(40, 16, 8) == (3, 16)  # no more splits than chunks
    for k in range(1, 100):
        for bk in (16, 32):
            for split in range(1, 9):
                n, per = moe_tiles.effective_split(k, bk, split)
                assert 1 <= n <= split and per % bk == 0 and (n - 1) * per < k <= n * per
    splits = {
        t: moe_tiles.heuristic_config(t, 128, 8, torch.bfloat16, True).split_k
        for t in (1, 8, 16, 32, 256)
    }
    assert splits == {1: 1, 8: 1, 16: 1, 32: 1, 256: 1}  # no split is measured to win yet
    assert moe_tiles.heuristic_config(1, 128, 8, torch.float32, True).split_k == 1
    assert moe_tiles.INTERPRETER_CONFIG.split_k == 1
    # no split is timed: splits lost at every measured batch (moe_tiles' comment)
    for t in (1, 64, 256, 4096):
        assert {c.split_k for c in moe_tiles.candidates(t, 128, 8, torch.bfloat16)} == {1}


def test_the_autotune_picks_the_down_gemms_tiles_second(tmp_path: Path) -> None:
    """Round one times each config with the same tiles in both GEMMs; round two keeps the
    winner's gate-up tiles and tries the down GEMM with every other tile of its block_m (the
    grouping both read), keeping the winner's own down unless another is faster."""
    few = list(moe_tiles.FEW_ROWS)
    winner, narrow = moe_tiles.FEW_ROWS[0], moe_tiles.NARROW_DEEP  # both 16 rows
    timed: list[moe_tiles.MoEConfig] = []

    def measure(cfg: moe_tiles.MoEConfig) -> float:
        timed.append(cfg)
        gate_up = 1.0 if cfg.block_n == winner.block_n and cfg.block_k == winner.block_k else 5.0
        return gate_up + (0.5 if cfg.down == narrow.down else 1.0)

    second = moe_tiles.down_candidates(winner, few)
    assert all(c.block_m == winner.block_m and c.down != winner.down for c in second)
    assert {c.down for c in second} == {c.down for c in few if c.block_m == 16} - {winner.down}
    cache = moe_tiles.ConfigCache(tmp_path)
    best = moe_tiles.autotune("bucket", few, measure, cache)
    assert best == winner.with_down(narrow) and best.down == narrow.down
    assert best[:6] == winner[:6], "the gate-up keeps the winner's tiles"
    assert timed == few + second, "the winner is not timed twice"
    assert moe_tiles.ConfigCache(tmp_path).get("bucket") == best
    # the down tiles of any height: tried with the winner's rows after its own height's,
    # none twice (the winner's 128 x 128 and ROWS_16's 64 x 128 are among DOWN_TILES)
    timed.clear()
    wide = moe_tiles.autotune("wide", few, measure, cache, moe_tiles.DOWN_TILES)
    extra = timed[len(few) + len(second) :]
    seen = {c.down[1:5] for c in [winner, *second]}
    assert [c.down[1:5] for c in extra] == [t for t in moe_tiles.DOWN_TILES if t not in seen]
    assert len(extra) == 2
    assert all(c.block_m == winner.block_m and c[:6] == winner[:6] for c in extra)
    assert wide == best, "no faster down among the extra tiles (the fake timer's)"
    assert moe_tiles.down_candidates(winner, few, moe_tiles.DOWN_TILES)[: len(second)] == second
    slow_down = moe_tiles.autotune("other", few, lambda c: 1.0 if c in few else 2.0, cache)
    assert slow_down == moe_tiles.FEW_ROWS[0], "a faster down is needed to move it"
    assert slow_down.down == slow_down._replace(down_block_n=0).down


def test_config_cache_reads_an_entry_from_before_split_k(tmp_path: Path) -> None:
    """A cached entry of 5 fields (no split_k) reads as split_k 1, one of 6 (no down tiles)
    as the gate-up's tiles in both GEMMs; new entries keep theirs; other lengths are
    ignored."""
    key = moe_tiles.ConfigCache.key(1, 128, 8, 2048, 768, torch.bfloat16, "NVIDIA H200", "3.6.0")
    old, split = list(moe_tiles.FEW_ROWS[0])[:5], moe_tiles.FEW_ROWS[0]._replace(split_k=4)
    (tmp_path / moe_tiles.ConfigCache.FILE).write_text(
        json.dumps({key: old, "bad": [16, 64], "long": [*split, 1]})
    )
    cache = moe_tiles.ConfigCache(tmp_path)
    assert cache.get(key) == moe_tiles.MoEConfig(*old) == moe_tiles.MoEConfig(*old, split_k=1)
    assert cache.get("bad") is None and cache.get("long") is None
    cache.put("new", split)
    assert moe_tiles.ConfigCache(tmp_path).get("new") == split
    assert json.loads((tmp_path / moe_tiles.ConfigCache.FILE).read_text())["new"] == list(split)


# ---------------------------------------------------------------- fewer launches (issue 48)

TOKEN_MAJOR = moe_tiles.LaunchPlan(route_with_align=True, down_with_slot_sum=True)
EARLY = moe_tiles.GROUPED._replace(early_down=True)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    t=st.integers(1, 64),
    e=st.sampled_from([1, 2, 3, 8, 60, 128, 256]),
    top_k=st.integers(1, 16),
    block_m=st.sampled_from([1, 4, 16]),
    renormalize=st.booleans(),
    weights_dtype=st.sampled_from([None, torch.bfloat16, torch.float16]),
    mode=st.sampled_from(["random", "random", "same", "flat"]),
    seed=st.integers(0, 2**16),
)
@example(t=16, e=128, top_k=8, block_m=16, renormalize=True, weights_dtype=torch.bfloat16,
         mode="random", seed=1)  # fmt: skip
@example(t=128, e=1, top_k=1, block_m=16, renormalize=False, weights_dtype=None,
         mode="random", seed=2)  # fmt: skip
@example(t=9, e=60, top_k=4, block_m=4, renormalize=True, weights_dtype=torch.bfloat16,
         mode="same", seed=3)  # fmt: skip
def test_route_and_align_equals_route_then_align(
    t: int,
    e: int,
    top_k: int,
    block_m: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None,
    mode: str,
    seed: int,
) -> None:
    """One launch for the routing half (at most ONE_PROGRAM_ROWS flat rows) writes what
    route then align write, bit for bit, every buffer whole (poisoned: an element one
    writes and the other does not differs): T up to the threshold (16 x top-8, 128 x
    top-1), E up to 256, every token choosing the same experts, experts choosing none, ties."""
    top_k = min(top_k, e)
    t = max(1, min(t, moe_routing.ONE_PROGRAM_ROWS // top_k))
    logits = make_logits(torch.Generator().manual_seed(seed), t, e, mode).to(torch.bfloat16)
    logits = logits.to(DEVICE)
    with poisoned_outputs():
        weights, ids, grouping = moe_routing.route_and_align(
            logits, top_k, renormalize, weights_dtype, block_m
        )
        want_weights, want_ids = moe_routing.route(logits, top_k, renormalize, weights_dtype)
        want = moe_routing.align(want_ids, e, block_m)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int32
    assert weights.dtype == want_weights.dtype
    assert torch.equal(weights.view(torch.uint8), want_weights.view(torch.uint8))  # bits
    assert grouping.block_m == want.block_m == block_m
    for name in ("sorted_rows", "expert_ids", "num_padded"):
        assert torch.equal(getattr(grouping, name), getattr(want, name)), name
    check_routing(logits.cpu(), top_k, renormalize, weights_dtype, weights, ids)


def test_route_and_align_refuses_more_than_one_program_of_rows() -> None:
    """Past ONE_PROGRAM_ROWS flat rows the align needs counts (two launches): refused."""
    logits = torch.zeros(17, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="more than one align program"):
        moe_routing.route_and_align(logits, 8, True, None, 16)


def random_experts(
    gen: torch.Generator, e: int, h: int, f: int, dtype: torch.dtype, fp8: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple | None, tuple[torch.Tensor, torch.Tensor]]:
    """``gate_up``, ``down``, their fp8 row scales (or None) and their float64 values."""
    gate_up = torch.randn(e, 2 * f, h, generator=gen) / h**0.5
    down = torch.randn(e, h, f, generator=gen) / f**0.5
    if not fp8:
        gate_up, down = gate_up.to(dtype), down.to(dtype)
        return gate_up, down, None, (gate_up.double(), down.double())
    (gate_up, gu_scale), (down, d_scale) = quantize_experts(gate_up), quantize_experts(down)
    wide = (
        gate_up.double() * gu_scale.double()[..., None],
        down.double() * d_scale.double()[..., None],
    )
    return gate_up, down, (gu_scale.to(DEVICE), d_scale.to(DEVICE)), wide


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    t=st.integers(1, moe_tiles.TOKEN_MAJOR_TOKENS),
    e=st.integers(1, 8),
    k_frac=st.floats(0, 1),
    h=st.sampled_from([16, 40, 80]),
    f=st.sampled_from([8, 24, 40]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    same=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(t=1, e=8, k_frac=1.0, h=80, f=40, dtype=torch.bfloat16, fp8=False, same=False, seed=1)
@example(t=4, e=6, k_frac=0.5, h=40, f=24, dtype=torch.bfloat16, fp8=True, same=True, seed=2)
@example(t=3, e=5, k_frac=0.7, h=16, f=8, dtype=torch.float32, fp8=False, same=False, seed=3)
def test_token_major_down_equals_the_loop_over_experts(
    t: int,
    e: int,
    k_frac: float,
    h: int,
    f: int,
    dtype: torch.dtype,
    fp8: bool,
    same: bool,
    seed: int,
) -> None:
    """The down GEMM token-major with the slot sum inside (T <= 4) == the float64 loop over
    experts, bf16/fp16/fp32 activations and fp8 experts (H 80: five column tiles, F 24 and
    40: a part K step, k 1 to 8 including non-powers of two), also after a gate-up split in
    two, and the grouped down + slot sum agree with it within the same bound."""
    if fp8 and dtype == torch.float16:
        dtype = torch.bfloat16
    top_k = 1 + round(k_frac * (e - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    if same:
        ids = ids[:1].expand(t, top_k).contiguous()
    weights = torch.softmax(torch.randn(t, top_k, generator=gen), dim=-1).to(dtype)
    gate_up, down, scales, wide = random_experts(gen, e, h, f, dtype, fp8)
    args = [a.to(DEVICE) for a in (x, weights, ids.int(), gate_up, down)]
    truth = ref.experts(x.double(), weights.double(), ids, *wide)
    split = moe_tiles.INTERPRETER_CONFIG._replace(split_k=2)
    with poisoned_outputs():
        out = moe.experts(*args, scales=scales, plan=TOKEN_MAJOR)
        grouped = moe.experts(*args, scales=scales, plan=moe_tiles.GROUPED)
        after_split = moe.experts(*args, config=split, scales=scales, plan=TOKEN_MAJOR)
    err = relative_error(after_split, truth)
    assert err <= TOL[dtype], f"after a split gate-up: relative error {err:.3g} > {TOL[dtype]}"
    assert out.dtype == dtype and out.shape == (t, h)
    assert torch.isfinite(out).all(), "an unwritten or NaN output element"
    err = relative_error(out, truth)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"
    diff = relative_error(out, grouped.cpu().double())
    assert diff <= TOL[dtype], f"token-major vs grouped: {diff:.3g}"


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    t=st.integers(1, moe_tiles.TOKEN_MAJOR_TOKENS),
    e=st.integers(1, 6),
    k_frac=st.floats(0, 1),
    h=st.sampled_from([16, 40]),
    f=st.sampled_from([8, 24, 40]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    same=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(t=4, e=3, k_frac=1.0, h=40, f=40, dtype=torch.bfloat16, fp8=True, same=False, seed=5)
@example(t=2, e=6, k_frac=1.0, h=16, f=24, dtype=torch.float32, fp8=False, same=True, seed=6)
def test_token_major_down_is_bit_identical_where_the_float32_sums_are_exact(
    t: int,
    e: int,
    k_frac: float,
    h: int,
    f: int,
    dtype: torch.dtype,
    fp8: bool,
    same: bool,
    seed: int,
) -> None:
    """Small integers, power-of-two scales and routing weights (some negative, and slot
    sums that cancel to zero), gates of at least 32 (``silu(g) == g``): every float32 dot
    is exact in any order, so the token-major down + slot sum gives the grouped down's and
    slot sum's bits (the same scale, weight and slot-order sum; only a dot's order
    differs, and here that is exact), and so does one token's early down."""
    if fp8 and dtype == torch.float16:
        dtype = torch.bfloat16
    top_k = 1 + round(k_frac * (e - 1))
    gen = torch.Generator().manual_seed(seed)

    def ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi + 1, shape, generator=gen).float()

    x = ints(1, 2, t, h).to(dtype)
    gate_up = torch.cat([ints(2, 3, e, f, h), ints(-1, 1, e, f, h)], dim=1)
    down = ints(-1, 1, e, h, f)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    if same:
        ids = ids[:1].expand(t, top_k).contiguous()
    weights = (ints(-2, 2, t, top_k) / 2).to(dtype)
    if fp8:
        gate_up, down = gate_up.to(torch.float8_e4m3fn), down.to(torch.float8_e4m3fn)
        scales = (2.0 ** ints(0, 1, e, 2 * f), 2.0 ** ints(-1, 0, e, h))
        scales = tuple(s.to(DEVICE) for s in scales)
    else:
        gate_up, down, scales = gate_up.to(dtype), down.to(dtype), None
    args = [a.to(DEVICE) for a in (x, weights, ids, gate_up, down)]
    with poisoned_outputs():
        out = moe.experts(*args, scales=scales, plan=TOKEN_MAJOR)
        grouped = moe.experts(*args, scales=scales, plan=moe_tiles.GROUPED)
        early = moe.experts(*args, scales=scales, plan=EARLY) if t == 1 else grouped
    assert torch.isfinite(out).all()
    assert torch.equal(out.view(torch.uint8), grouped.view(torch.uint8)), "not the grouped bits"
    assert torch.equal(early.view(torch.uint8), grouped.view(torch.uint8)), "early: not them"


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    e=st.integers(1, 8),
    k_frac=st.floats(0, 1),
    h=st.sampled_from([16, 40, 136]),
    f=st.sampled_from([8, 24, 40]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fp8=st.booleans(),
    residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(e=8, k_frac=1.0, h=136, f=40, dtype=torch.bfloat16, fp8=False, residual=True, seed=1)
@example(e=6, k_frac=0.5, h=40, f=24, dtype=torch.bfloat16, fp8=True, residual=False, seed=2)
@example(e=1, k_frac=0.0, h=16, f=8, dtype=torch.float32, fp8=False, residual=True, seed=3)
def test_one_tokens_early_down_equals_the_loop_over_experts(
    e: int,
    k_frac: float,
    h: int,
    f: int,
    dtype: torch.dtype,
    fp8: bool,
    residual: bool,
    seed: int,
) -> None:
    """``LaunchPlan.early_down`` at one token (the down's whole weight tile read before its
    wait, its last program per column tile summing the slots) == the float64 loop over
    experts, bf16/fp16/fp32 activations and fp8 experts, with and without the residual (H
    136: three column tiles of 64, the last part; F 24 and 40: a padded tile), and within
    the bound of the grouped down; routing of every kind through fused_moe's logits."""
    if fp8 and dtype == torch.float16:
        dtype = torch.bfloat16
    top_k = 1 + round(k_frac * (e - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, h, generator=gen).to(dtype)
    logits = make_logits(gen, 1, e, "random").to(dtype)
    gate_up, down, scales, wide = random_experts(gen, e, h, f, dtype, fp8)
    res = torch.randn(1, h, generator=gen).to(dtype) if residual else None
    kw = dict(renormalize=True, weights_dtype=dtype, scales=scales)
    if res is not None:
        kw["residual"] = res.to(DEVICE)
    args = (x.to(DEVICE), logits.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), top_k)
    with poisoned_outputs():
        early = moe.fused_moe(*args, **kw, early_down=True)
        grouped = moe.fused_moe(*args, **kw, plan=moe_tiles.GROUPED)
    weights, ids = moe_routing.route(logits.to(DEVICE), top_k, True, dtype)
    truth = ref.experts(x.double(), weights.cpu().double(), ids.cpu(), *wide)
    if res is not None:
        truth = truth + res.double()
    assert early.dtype == dtype and early.shape == (1, h)
    assert torch.isfinite(early).all(), "an unwritten or NaN output element"
    err = relative_error(early, truth)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"
    diff = relative_error(early, grouped.cpu().double())
    assert diff <= TOL[dtype], f"early vs grouped: {diff:.3g}"


def test_the_early_downs_columns_and_where_it_runs(launches: list[str]) -> None:
    """A program's ``[next_power_of_2(F), columns]`` tile holds at most 16K elements and 64
    columns, and no fewer than 4 (F over 4,096: the grouped down runs). The plan runs for one
    token only: more tokens take the grouped down and the slot sum."""
    assert moe_tiles.early_down_columns(8) == 64
    assert moe_tiles.early_down_columns(768) == 16  # Qwen3-30B-A3B: 1,024 padded rows
    assert moe_tiles.early_down_columns(1536) == 8
    assert moe_tiles.early_down_columns(4096) == 4
    assert moe_tiles.early_down_columns(4097) == 0
    gen = torch.Generator().manual_seed(0)
    e, h, f, top_k = 4, 16, 8, 2
    gate_up, down, _, _ = random_experts(gen, e, h, f, torch.float32, False)
    for t, last in ((1, "_down_early_kernel"), (2, "_slot_sum_kernel")):
        launches.clear()
        x = torch.randn(t, h, generator=gen)
        logits = make_logits(gen, t, e, "random")
        moe.fused_moe(
            x.to(DEVICE), logits.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), top_k,
            renormalize=True, early_down=True,
        )  # fmt: skip
        assert launches[-1] == last, launches


class LaunchCounter:
    """Stands in for a Triton kernel: counts ``kernel[grid](...)`` launches, then runs it."""

    def __init__(self, kernel, launches: list[str], name: str) -> None:
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(self.name)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the MoE kernels launched, in order, while the test runs."""
    seen: list[str] = []
    for module, name in (
        (moe_routing, "_route_kernel"),
        (moe_routing, "_align_kernel"),
        (moe_routing, "_route_align_kernel"),
        (moe, "_grouped_gemm_kernel"),
        (moe, "_slot_sum_kernel"),
        (moe, "_down_slot_sum_kernel"),
        (moe, "_down_early_kernel"),
    ):
        monkeypatch.setattr(module, name, LaunchCounter(getattr(module, name), seen, name))
    return seen


ROUTE_ALIGN = ["_route_align_kernel", "_grouped_gemm_kernel"]
THREE = [*ROUTE_ALIGN, "_down_slot_sum_kernel"]
FOUR = [*ROUTE_ALIGN, "_grouped_gemm_kernel", "_slot_sum_kernel"]
FIVE = ["_route_kernel", "_align_kernel", *FOUR[1:]]


@pytest.mark.parametrize(
    ("t", "kernels", "fp8"),
    [
        (1, THREE, False),
        (1, THREE, True),
        (4, THREE, False),
        (5, FOUR, True),
        (16, FOUR, False),
        (17, FIVE, False),
        (17, FIVE, True),
    ],
)
def test_fused_moe_launches_per_batch_and_equals_the_loop(
    launches: list[str], t: int, kernels: list[str], fp8: bool
) -> None:
    """Top-8 of 12 experts, the fewest launches: three at T 1..4, four up to 16 (128 flat
    rows), five past it; each path == the float64 loop over experts (bf16, and fp8
    experts)."""
    e, top_k, h, f, dtype = 12, 8, 24, 16, torch.bfloat16
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=gen).to(dtype)
    logits = make_logits(gen, t, e, "random").to(dtype)
    gate_up, down, scales, wide = random_experts(gen, e, h, f, dtype, fp8)
    args = [a.to(DEVICE) for a in (x, logits, gate_up, down)]
    plan = moe_tiles.fewest_launches(t, top_k)
    assert plan.launches == len(kernels)
    with poisoned_outputs():
        out = moe.fused_moe(*args, top_k, renormalize=True, weights_dtype=dtype, scales=scales,
                            plan=plan)  # fmt: skip
    assert launches == kernels
    weights, ids = moe_routing.route(args[1], top_k, True, dtype)
    truth = ref.experts(x.double(), weights.cpu().double(), ids.cpu(), *wide)
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = relative_error(out, truth)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


def test_default_plan_is_the_grouped_five_launches(launches: list[str]) -> None:
    """Measured faster on an H100 at batch 1 and 8 (``launch_plan``'s doc): no plan named,
    every batch runs route, align, gate-up, grouped down, slot sum -- but one token's down
    sums its slots in its own last program (four launches)."""
    e, top_k, h, f, dtype = 12, 8, 24, 16, torch.bfloat16
    for t in (1, 5, 17):
        assert moe_tiles.launch_plan(t, top_k) == moe_tiles.GROUPED
        gen = torch.Generator().manual_seed(t)
        x = torch.randn(t, h, generator=gen).to(dtype)
        logits = make_logits(gen, t, e, "random").to(dtype)
        gate_up, down, _, wide = random_experts(gen, e, h, f, dtype, False)
        args = [a.to(DEVICE) for a in (x, logits, gate_up, down)]
        launches.clear()
        out = moe.fused_moe(*args, top_k, renormalize=True, weights_dtype=dtype)
        assert launches == (FIVE[:-1] if t == 1 else FIVE)
        assert moe_tiles.GROUPED.launches_for(t) == len(launches)
        weights, ids = moe_routing.route(args[1], top_k, True, dtype)
        truth = ref.experts(x.double(), weights.cpu().double(), ids.cpu(), *wide)
        assert relative_error(out, truth) <= TOL[dtype]


def test_fewest_launches_thresholds() -> None:
    """Token-major down at T <= 4 (after any gate-up: a split one writes h too, which
    test_token_major_down_equals_the_loop_over_experts runs), routing with the align up to
    ONE_PROGRAM_ROWS flat rows; 3, 4 and 5 launches."""
    assert moe_tiles.TOKEN_MAJOR_TOKENS == 4 and moe_routing.ONE_PROGRAM_ROWS == 128
    plans = {t: moe_tiles.fewest_launches(t, 8) for t in (1, 4, 5, 16, 17, 256)}
    assert {t: p.launches for t, p in plans.items()} == {1: 3, 4: 3, 5: 4, 16: 4, 17: 5, 256: 5}
    assert plans[1] == TOKEN_MAJOR and plans[17] == moe_tiles.GROUPED
    assert moe_tiles.fewest_launches(4, 16) == TOKEN_MAJOR  # 64 rows
    assert moe_tiles.fewest_launches(128, 1) == moe_tiles.LaunchPlan(True, False)
    assert moe_tiles.fewest_launches(129, 1) == moe_tiles.GROUPED
    assert moe_tiles.token_major_tiles(8, True) == moe_tiles.TokenMajorTiles(16, 64, 8)
    assert moe_tiles.token_major_tiles(2, True) == moe_tiles.TokenMajorTiles(16, 128, 8)
    assert moe_tiles.token_major_tiles(16, True).block_k == 32


def test_the_block_owner_tile_is_no_larger_than_the_grouping() -> None:
    """Program 0 finds the blocks' experts over a ``[blocks, E_PAD]`` tile of at most 8,192
    elements and of no more blocks than the grouping has (at least 16)."""
    assert moe_routing._blocks_chunk(128, 8) == 16  # Qwen3-30B-A3B at batch 1
    assert moe_routing._blocks_chunk(128, 100) == 64  # the element bound
    assert moe_routing._blocks_chunk(8, 1000) == 128 and moe_routing._blocks_chunk(8, 40) == 64


@pytest.mark.parametrize(
    ("dtype", "fp8"), [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)]
)
def test_one_tokens_slot_sum_in_the_down_gemm_is_the_slot_sum_kernels(
    dtype: torch.dtype, fp8: bool
) -> None:
    """One token: the grouped down's last program sums the k slots (and adds the residual)
    with the bits of ``_slot_sum_kernel``, which a batch of that token twice runs (each row
    of the GEMMs has the same bits whatever else is in its tile); fp8 experts too."""
    e, top_k, h, f = 12, 8, 24, 16
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, h, generator=gen).to(dtype)
    logits = make_logits(gen, 1, e, "random").to(dtype)
    gate_up, down, scales, _ = random_experts(gen, e, h, f, dtype, fp8)
    residual = torch.randn(1, h, generator=gen).to(dtype)
    args = [a.to(DEVICE) for a in (gate_up, down)]
    config = moe_tiles.INTERPRETER_CONFIG  # one tile for both calls (the CPU's; on a GPU:)
    if DEVICE.type == "cuda":
        config = moe_tiles.ROWS_16 if dtype != torch.float32 else moe_tiles.FP32_CONFIGS[0]
    kw = dict(renormalize=True, weights_dtype=dtype, config=config, plan=moe_tiles.GROUPED)
    kw["scales"] = scales
    for res in (None, residual):
        extra = {} if res is None else {"residual": res.to(DEVICE)}
        extra2 = {} if res is None else {"residual": res.repeat(2, 1).to(DEVICE)}
        one = moe.fused_moe(x.to(DEVICE), logits.to(DEVICE), *args, top_k, **kw, **extra)
        two = moe.fused_moe(
            x.repeat(2, 1).to(DEVICE), logits.repeat(2, 1).to(DEVICE), *args, top_k, **kw, **extra2
        )
        assert torch.equal(one[0], two[0]) and torch.equal(two[0], two[1])


def test_the_autotune_times_spread_routing_not_the_calls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The runner's warm-up rows are all one token, so they all pick the same experts:
    ``choose_config`` times its candidates on ``spread_routing`` of the call's shape instead
    (each token's experts distinct, every expert used, the same draw in every process)."""
    t, e, k, h, f = 64, 16, 4, 8, 4
    cpu = torch.device("cpu")
    weights, ids = moe_tiles.spread_routing(t, e, k, torch.bfloat16, cpu)
    assert ids.shape == weights.shape == (t, k) and ids.dtype == torch.int32
    assert weights.dtype == torch.bfloat16 and (weights.float() == 1 / k).all()
    assert all(len(set(row)) == k for row in ids.tolist())
    counts = torch.bincount(ids.flatten().long(), minlength=e)
    assert counts.min() > 0 and counts.max() <= 2 * t * k / e
    assert torch.equal(ids, moe_tiles.spread_routing(t, e, k, torch.bfloat16, cpu)[1])

    timed_ids: list[torch.Tensor] = []
    monkeypatch.setattr(moe, "known_config", lambda *args, **kw: None)
    monkeypatch.setattr(moe, "config_key", lambda *args, **kw: "a bucket")
    monkeypatch.setattr(moe.tuning, "time_replays", lambda fn: fn() or 1.0)
    monkeypatch.setattr(moe, "experts", lambda x, w, i, *args, **kw: timed_ids.append(i))
    same = torch.arange(k, dtype=torch.int32).repeat(t, 1)  # every row on experts 0..k-1
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    gate_up, down = torch.zeros(e, 2 * f, h), torch.zeros(e, h, f)
    cache = moe_tiles.ConfigCache(tmp_path)
    moe.choose_config(x, torch.full((t, k), 1 / k), same, gate_up, down, cache)
    assert timed_ids and all(torch.equal(i, ids) for i in timed_ids)
