"""The weight-format check: a format's ``linear`` against the dense product, on drawn shapes.

A weight format (``weights=NAME``, :class:`pitstop.plugin_system.protocols.WeightFormat`)
is correct when, for the weights a model hands it, ``linear(x, prepare(name, W), b)``
is ``x @ W.T + b`` within the error its encoding allows. :func:`check_weight_format`
draws linear layers with Hypothesis (out and in features from 1 to 160, aligned to
16 or not; 1 to 40 tokens; with and without a bias; the names a model uses, the
output head among them) and checks, for each:

- ``linear`` returns ``x``'s dtype and shape ``[tokens, out_features]``, finite;
- it lies within ``tolerance`` of the float32 product: the largest absolute
  difference over the largest magnitude of the product's terms,
  ``sum_k |x[m, k] W[n, k]| + |b[n]|`` (a format rounds each weight and input,
  so its error is a fraction of the terms, however far their sum cancels);
- a zero weight row gives the bias in its column and a zero input row the bias
  in its row (no division by a zero scale), and a second call gives the same
  values (no state);
- with ``reference=``, the format's own reference of the same arithmetic agrees
  within ``reference_tolerance``, measured the same way (a fast GEMM against its
  PyTorch twin);
- ``resident_bytes`` is positive and at most the dense tensor's bytes plus 8 per row.

On CUDA it also captures ``linear`` in a CUDA graph and replays it on new inputs
(a host synchronisation in ``linear`` fails the capture). How a third party runs it::

    from pitstop.testing.weights import check_weight_format

    def test_my_format():
        check_weight_format(lambda device, dtype: MyFormat(...), tolerance=0.05)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from pitstop.plugin_system.protocols import WeightFormat
from pitstop.testing._hypothesis import suite_settings

__all__ = ["LINEAR_NAMES", "check_weight_format", "relative_error"]

FormatFactory = Callable[[torch.device, torch.dtype], WeightFormat]
Reference = Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]

# The names the Llama family hands a format (merged and not), and the untied output head.
LINEAR_NAMES = (
    "layers.0.self_attn.qkv_proj",
    "layers.1.self_attn.o_proj",
    "layers.0.mlp.gate_up_proj",
    "layers.2.mlp.down_proj",
    "layers.0.self_attn.q_proj",
    "lm_head",
)


def relative_error(
    actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor | None = None
) -> float:
    """Largest ``|actual - expected|`` over the largest ``|expected|``, or over the largest
    ``|magnitude|`` when given (the size the error scales with, e.g. a product's terms)."""
    scale = (expected if magnitude is None else magnitude).float().abs().max().clamp_min(1e-6)
    return ((actual.float() - expected.float()).abs().max() / scale).item()


def _bound(tolerance: float | Mapping[torch.dtype, float], dtype: torch.dtype) -> float:
    return tolerance[dtype] if isinstance(tolerance, Mapping) else tolerance


def _check_one(
    fmt: WeightFormat,
    w: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    name: str,
    bound: float,
    reference: Reference | None,
    reference_bound: float,
) -> None:
    what = f"{name} {tuple(w.shape)} x {tuple(x.shape)} {x.dtype}"
    resident = fmt.prepare(name, w.clone())
    out = fmt.linear(x, resident, bias)
    assert out.dtype == x.dtype, f"{what}: linear returned {out.dtype}, not {x.dtype}"
    assert out.shape == (x.shape[0], w.shape[0]), f"{what}: shape {tuple(out.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    b = None if bias is None else bias.float()
    expected = F.linear(x.float(), w.float(), b)
    # Each term x[m, k] * W[n, k] carries the rounding of its two operands, so the error is a
    # fraction of sum_k |x[m, k] W[n, k]| (+ |b[n]|), not of the product: its terms may cancel
    # (a [2, 10] fp8 weight's one nonzero output was 1/57 of its terms, its error 1.13 of it)
    terms = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.abs())
    err = relative_error(out, expected, terms)
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound} against x @ W.T + b"
    want = torch.zeros(out.shape[1], dtype=out.dtype, device=out.device)
    if bias is not None:
        want = bias.to(out.dtype)
    assert torch.equal(out[0], want), f"{what}: a zero input row does not give the bias"
    assert torch.equal(out[:, 0], want[0].expand(out.shape[0])), (
        f"{what}: a zero weight row does not give its bias"
    )
    assert torch.equal(fmt.linear(x, resident, bias), out), f"{what}: a second call differs"
    if reference is not None:
        ref_err = relative_error(out, reference(x, resident, bias), terms)
        assert ref_err <= reference_bound, (
            f"{what}: relative error {ref_err:.3g} > {reference_bound} against the reference"
        )
    dense = w.numel() * w.element_size()
    held = fmt.resident_bytes(resident)
    assert 0 < held <= dense + 8 * w.shape[0], f"{what}: resident_bytes {held} (dense {dense})"


def _check_graph(fmt: WeightFormat, device: torch.device, dtype: torch.dtype) -> None:
    """``linear`` captured in a CUDA graph, replayed on new inputs, equals eager ``linear``."""
    gen = torch.Generator(device=device).manual_seed(7)
    w = torch.randn(64, 96, generator=gen, device=device).to(dtype) * 0.05
    resident = fmt.prepare("layers.0.mlp.down_proj", w)
    static_x = torch.randn(8, 96, generator=gen, device=device).to(dtype)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fmt.linear(static_x, resident)  # warm-up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fmt.linear(static_x, resident)
    static_x.copy_(torch.randn(8, 96, generator=gen, device=device).to(dtype))
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(static_out, fmt.linear(static_x, resident)), "replayed graph differs"


def check_weight_format(
    make: FormatFactory,
    *,
    tolerance: float | Mapping[torch.dtype, float],
    device: torch.device | str = "cpu",
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    reference: Callable[[WeightFormat], Reference] | None = None,
    reference_tolerance: float | Mapping[torch.dtype, float] = 0.0,
    max_examples: int = 20,
) -> None:
    """Check ``make(device, dtype)``'s ``linear`` on drawn layers; raise ``AssertionError``
    naming the layer, the shapes and the error on a mismatch.

    ``tolerance``: the largest relative error against the float32 product (a float, or
    one per dtype); ``reference(fmt)``: the format's own reference ``linear``, held to
    ``reference_tolerance``.
    """
    device = torch.device(device)
    formats: dict[torch.dtype, WeightFormat] = {}

    def fmt_of(dtype: torch.dtype) -> WeightFormat:
        if dtype not in formats:
            formats[dtype] = make(device, dtype)
        return formats[dtype]

    features = st.one_of(st.integers(1, 160), st.sampled_from([16, 32, 64, 128, 144]))

    @suite_settings(max_examples)
    @given(
        out_features=features,
        in_features=features,
        tokens=st.integers(1, 40),
        with_bias=st.booleans(),
        name=st.sampled_from(LINEAR_NAMES),
        dtype=st.sampled_from(list(dtypes)),
        magnitude=st.sampled_from([0.02, 1.0, 30.0]),
        seed=st.integers(0, 2**16),
    )
    def run(
        out_features: int,
        in_features: int,
        tokens: int,
        with_bias: bool,
        name: str,
        dtype: torch.dtype,
        magnitude: float,
        seed: int,
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)

        def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        w = draw(out_features, in_features, scale=magnitude)
        w[0] = 0
        x = draw(tokens, in_features)
        x[0] = 0
        bias = draw(out_features) if with_bias else None
        fmt = fmt_of(dtype)
        ref = reference(fmt) if reference is not None else None
        _check_one(
            fmt,
            w,
            x,
            bias,
            name,
            _bound(tolerance, dtype),
            ref,
            _bound(reference_tolerance, dtype),
        )

    run()
    if device.type == "cuda":
        for dtype in dtypes:
            _check_graph(fmt_of(dtype), device, dtype)
