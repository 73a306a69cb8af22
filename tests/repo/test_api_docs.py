"""The vLLM-style code of docs/api.md runs unchanged (each ``python`` block, as it stands).

Blocks that use the official ``openai`` client run against the ``pitstop
serve`` command the page shows before them (the ``bash`` block), started on
a free port with CPU flags; the block's ``http://localhost:8000`` is that
server's address.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.models import smollm2_gguf
from helpers.server_process import serve_subprocess

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"
TEXT = API_MD.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
OFFLINE = [b for b in BLOCKS if "from openai import" not in b]
ONLINE = [b for b in BLOCKS if "from openai import" in b]
SERVE = re.findall(r"```bash\n(pitstop serve [^\n]*)\n```", TEXT)
CPU_FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gib", "0.25"]


def test_the_page_has_examples() -> None:
    assert len(OFFLINE) >= 3
    assert len(ONLINE) >= 2 and len(SERVE) == 1
    assert any("tool_calls" in b for b in ONLINE) and any("::=" in b for b in ONLINE)


def _run(block: str, name: str, capsys: pytest.CaptureFixture[str]) -> str:
    exec(compile(block, name, "exec"), {"__name__": "__docs__"})
    printed = capsys.readouterr().out
    assert printed.strip(), "the example printed nothing"
    return printed


@pytest.mark.parametrize("index", range(len(OFFLINE)))
def test_docs_api_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    smollm2_gguf()
    pytest.importorskip("llguidance")
    printed = _run(OFFLINE[index], f"docs/api.md block {index}", capsys)
    if "StructuredOutputsParams(json=" in OFFLINE[index]:
        answer = json.loads(printed.strip().splitlines()[1])
        assert answer["colour"] in ("red", "green", "blue")
        assert printed.strip().splitlines()[2] in ("yes", "no")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    smollm2_gguf()
    pytest.importorskip("llguidance")
    args = shlex.split(SERVE[0])[2:]  # after "pitstop serve"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with serve_subprocess([*args, *CPU_FLAGS], env, start_timeout=180) as (_proc, url):
        yield url


@pytest.mark.parametrize("index", range(len(ONLINE)))
def test_docs_api_openai_example_runs(
    index: int, server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("openai")
    block = ONLINE[index]
    assert 'base_url="http://localhost:8000/v1"' in block
    block = block.replace("http://localhost:8000", server_url)
    lines = _run(block, f"docs/api.md openai block {index}", capsys).strip().splitlines()
    if "tool_calls" in block:
        name, _, rest = lines[0].partition(" ")
        assert name == "get_weather" and rest.endswith(" tool_calls")
        assert "'city'" in rest and "'unit'" in rest
        assert lines[1].strip()  # the answer after the tool's result
    if "::=" in block:
        assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12]", lines[0])
