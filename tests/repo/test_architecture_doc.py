"""docs/architecture.md describes the code as it is: every module path and every class
name it mentions exists in the source tree (issue 30)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SOURCE_DIRS = ("core", "plugins", "apps", "tests/example_plugin")  # the example plugin too
# names of other projects and formats the page cites, not pitstop's classes
NOT_OURS = {
    "FlashAttention",
    "PyTorch",
    "SafeTensors",
    "HuggingFace",
    "GitHub",
    "TensorRT",
    "PagedAttention",
    "RadixAttention",
    "FastAPI",
    "SGLang",
    "OpenAI",
    "AutoConfig",
    "AutoModelForCausalLM",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "ContinuousBatchingManager",
    "PreTrainedTokenizerFast",
    "LlguidanceMatcher",
    "MemAvailable",
    "NaN",
    "SiLU",  # a /proc/meminfo field, a float, an activation
}
# paths the page names to say they are not used (a module that would shadow a package)
NOT_MODULES = {"plugins.py", "pitstop/plugins.py"}
MODULE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[a-z_][\w]*\.py)\b")
CLASS = re.compile(r"\b([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+)\b")


def _sources() -> list[Path]:
    return [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")]


def test_every_module_the_architecture_page_names_exists() -> None:
    text = DOC.read_text()
    names = {p.name for p in _sources()}
    missing = []
    for path in sorted(set(MODULE.findall(text)) - NOT_MODULES):
        if "/" in path:
            ok = (ROOT / path).is_file() or any((ROOT / d / path).is_file() for d in SOURCE_DIRS)
        else:
            ok = path in names
        if not ok:
            missing.append(path)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_class_the_architecture_page_names_exists() -> None:
    text = DOC.read_text()
    code = "\n".join(p.read_text() for p in _sources())
    defined = set(re.findall(r"^\s*class (\w+)", code, re.M)) | set(
        re.findall(r"^(\w+)\s*(?::[^=\n]+)?=", code, re.M)
    )
    missing = sorted(n for n in set(CLASS.findall(text)) - NOT_OURS if n not in defined)
    assert not missing, f"docs/architecture.md names classes that do not exist: {missing}"
