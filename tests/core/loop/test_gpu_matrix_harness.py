"""The GPU matrix's own logic, on the CPU: which configurations run, and how a row is judged."""

from __future__ import annotations

from helpers.gpu_matrix import (
    ALLOCATORS,
    BUDGETS,
    KERNELS,
    OVERLAP,
    SCHEDULERS,
    configurations,
    judge,
)


def test_every_combination_is_a_configuration() -> None:
    names = [c["name"] for c in configurations()]
    assert len(names) == len(set(names))
    product = len(ALLOCATORS) * len(SCHEDULERS) * len(KERNELS) * len(BUDGETS) * len(OVERLAP)
    assert sum(n.count("/") == 4 and "overlap=" in n for n in names) == product
    assert any("preempting" in n for n in names) and any(n.endswith("/n=2") for n in names)
    assert any(n.startswith("issue27/chunk_size=16") for n in names)
    chunked16 = next(
        c for c in configurations() if c["name"].startswith("paged/chunked/fused/budget=16/")
    )
    assert chunked16["settings"]["chunk_size"] == 16
    layer = [c for c in configurations() if "/fused+layer/" in c["name"]]
    assert len(layer) == len(ALLOCATORS) * len(SCHEDULERS) * 2
    assert all(c["settings"]["options"] == {"fused.layer": True} for c in layer)


def test_a_divergence_fails_unless_the_reference_had_a_near_tie() -> None:
    reference = [[1, 2, 3, 4]]
    margins = [[5.0, 5.0, 0.0004, 5.0]]
    same = {"name": "a", "passes": [[[[1, 2, 3, 4]]]]}
    assert judge(same, reference, margins) == ("pass", [])
    tie = {"name": "b", "passes": [[[[1, 2, 9, 9]]]]}
    verdict, details = judge(tie, reference, margins)
    assert verdict == "near-tie" and "token 2" in details[0]
    wrong = {"name": "c", "passes": [[[[1, 7, 3, 4]]]]}
    assert judge(wrong, reference, margins)[0] == "FAIL"
    short = {"name": "d", "passes": [[[[1, 2]]]]}
    assert judge(short, reference, margins)[0] == "FAIL"
    leaked = {"name": "e", "passes": [[[[1, 2, 3, 4]]]], "pages_leaked": 2}
    assert judge(leaked, reference, margins)[0] == "FAIL"
    assert judge({"name": "f", "error": "boom"}, reference, margins) == ("FAIL", ["boom"])
