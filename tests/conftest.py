"""Shared test set-up: GPU tests skip cleanly where there is no CUDA device."""

from __future__ import annotations

import os

import pytest

# Keep CPU tests predictable on a 2-core machine.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
