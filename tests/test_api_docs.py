"""The vLLM-style code of docs/api.md runs unchanged (each ``python`` block, as it stands)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest_models import smollm2_gguf

API_MD = Path(__file__).resolve().parent.parent / "docs" / "api.md"
BLOCKS = re.findall(r"```python\n(.*?)```", API_MD.read_text(), flags=re.S)


def test_the_page_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_docs_api_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    smollm2_gguf()
    pytest.importorskip("llguidance")
    exec(compile(BLOCKS[index], f"docs/api.md block {index}", "exec"), {"__name__": "__docs__"})
    printed = capsys.readouterr().out
    assert printed.strip(), "the example printed nothing"
    if "StructuredOutputsParams(json=" in BLOCKS[index]:
        import json

        answer = json.loads(printed.strip().splitlines()[1])
        assert answer["colour"] in ("red", "green", "blue")
        assert printed.strip().splitlines()[2] in ("yes", "no")
