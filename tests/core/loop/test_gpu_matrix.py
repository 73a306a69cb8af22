"""Issue 27's GPU correctness matrix on the H200 (tests/helpers/gpu_matrix.py does the work).

Every allocator x scheduler x kernel set x step budget x overlap, a preempting
cache, ``n=2`` and the issue's own table, each configuration in a fresh process
with poisoned memory, greedy tokens against transformers' float32 greedy tokens
on the real SmolLM2 weights. ``PITSTOP_MATRIX_WORKERS`` sets how many processes
share the GPU (default 12); ``PITSTOP_MATRIX_JSON`` writes every row to a file.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.gpu_matrix import configurations, run_matrix, summary

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_every_configuration_in_a_fresh_process_matches_transformers() -> None:
    pytest.importorskip("gguf")
    rows = run_matrix(configurations(), workers=int(os.environ.get("PITSTOP_MATRIX_WORKERS", 12)))
    if os.environ.get("PITSTOP_MATRIX_JSON"):
        with open(os.environ["PITSTOP_MATRIX_JSON"], "w") as f:
            json.dump(rows, f, indent=2)
    print(summary(rows))
    failed = [r for r in rows if r["verdict"] == "FAIL"]
    assert not failed, summary(rows)
