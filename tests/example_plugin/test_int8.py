"""The ``int8`` weight format's own tests: pitstop.testing.weights, and its rounding bound."""

from __future__ import annotations

import torch
from pitstop_example.int8 import Int8Settings, Int8Weight, Int8Weights

from pitstop import EngineConfig
from pitstop.plugin_system.plugin_manager import get_plugin_manager
from pitstop.testing.weights import check_weight_format


def _int8(device: torch.device, dtype: torch.dtype, **settings: int) -> Int8Weights:
    kernels = get_plugin_manager().create("kernels", "reference", EngineConfig(), device, dtype)
    return Int8Weights(kernels, Int8Settings(**settings))


def test_int8_is_the_dense_product_within_its_rounding() -> None:
    # half an int8 step (amax / 254) per weight; activations exact
    check_weight_format(_int8, tolerance={torch.float32: 0.02, torch.bfloat16: 0.03})


def test_each_weight_is_within_half_a_step() -> None:
    fmt = _int8(torch.device("cpu"), torch.float32)
    w = torch.randn(16, 32) * torch.logspace(-2, 1, 16).unsqueeze(1)
    resident = fmt.prepare("layers.0.mlp.down_proj", w)
    assert isinstance(resident, Int8Weight) and resident.qweight.dtype == torch.int8
    back = resident.qweight.float() * resident.scale
    assert ((back - w).abs() <= resident.scale / 2 + 1e-7).all()
    assert fmt.resident_bytes(resident) == 16 * 32 + 4 * 16  # a quarter of float32's, + scales


def test_narrow_weights_and_the_head_stay_dense() -> None:
    fmt = _int8(torch.device("cpu"), torch.float32, min_features=64)
    narrow, wide = torch.randn(8, 32), torch.randn(8, 64)
    assert fmt.prepare("layers.0.self_attn.o_proj", narrow) is narrow
    assert isinstance(fmt.prepare("layers.0.self_attn.o_proj", wide), Int8Weight)
    assert fmt.prepare("lm_head", wide) is wide
