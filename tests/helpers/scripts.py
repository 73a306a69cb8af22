"""The scripts under ``benchmarks/`` loaded as modules, for the tests that run them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` imported afresh as a module named ``NAME_under_test``."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
