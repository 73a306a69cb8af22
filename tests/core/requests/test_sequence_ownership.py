"""One owner per piece of state: a Sequence changes only through its own methods, and the core
asks a strategy's capabilities through its kind's protocol, never by the strategy's name.

Read from the source (AST), over every module of the engine, its plugins and its apps, the
property suites (``apps/testing``) included. The tests themselves are left out: they drive
sequences through made-up states to test one strategy alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest

from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.plugin_system.protocols import (
    AllocatorBase,
    KernelSetBase,
    ModelBase,
    ProposerBase,
    SamplerBase,
)
from pitstop.requests.sequence import PENDING_TOKEN, Sequence, Timestamps

ROOT = Path(__file__).resolve().parents[3]
OWNER = ROOT / "core" / "requests" / "sequence.py"
STATE = frozenset(f.name for f in attrs.fields(Sequence))
TIMES = frozenset(f.name for f in attrs.fields(Timestamps))
MUTATORS = frozenset({"append", "extend", "clear", "insert", "pop", "remove", "sort", "reverse"})
PLUGIN_NAMES = frozenset({"fused", "reference", "prefix", "paged", "preallocated"})


def _modules() -> list[Path]:
    paths = []
    for folder in ("core", "plugins", "apps"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == OWNER or "build" in path.parts:
                continue
            paths.append(path)
    return paths


def _state_of_other(node: ast.expr) -> str | None:
    """``x.<field>`` (x not ``self``) of a Sequence field, or ``x.timestamps.<time>``: the name."""
    if not isinstance(node, ast.Attribute):
        return None
    inner = node.value
    if isinstance(inner, ast.Attribute) and inner.attr == "timestamps" and node.attr in TIMES:
        return f"timestamps.{node.attr}"
    if node.attr in STATE and not (isinstance(inner, ast.Name) and inner.id in ("self", "cls")):
        return node.attr
    return None


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """Each assignment to, or in-place change of, a Sequence's state outside its own class."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS and (name := _state_of_other(node.func.value)):
                found.append((node.lineno, f"{name}.{node.func.attr}()"))
            continue
        for target in targets:
            for part in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, ast.Subscript):
                    part = part.value
                if isinstance(part, ast.expr) and (name := _state_of_other(part)):
                    found.append((node.lineno, name))
    return sorted(found)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_sequence_changes_its_state(path: Path) -> None:
    writes = _writes(ast.parse(path.read_text(), str(path)))
    assert not writes, (
        f"{path.relative_to(ROOT)} changes a Sequence's state directly: "
        + ", ".join(f"line {line}: {what}" for line, what in writes)
        + "; call a method of pitstop.requests.sequence.Sequence instead"
    )


def test_the_name_check_sees_names_and_probes(tmp_path: Path) -> None:
    path = tmp_path / "engine.py"
    path.write_text(
        'if config.allocator == "prefix":\n    pass\n'
        'x = getattr(self.allocator, "share_prompt", None)\n'
        'raise ValueError("use allocator paged")\n'  # advice in a message is no test
    )
    assert _name_tests(path) == [(1, "compares with 'prefix'"), (3, "getattr probe")]


def test_the_check_sees_direct_writes() -> None:
    source = (
        "seq.status = 1\n"
        "seq.num_computed_tokens += 2\n"
        "seq.timestamps.first_scheduled = 3\n"
        "seq.draft_token_ids.clear()\n"
        "seq.token_ids[0] = 4\n"
        "self.status = 5\n"  # another class's own field
        "out.text = 6\n"  # not a Sequence field
    )
    assert [what for _, what in _writes(ast.parse(source))] == [
        "status",
        "num_computed_tokens",
        "timestamps.first_scheduled",
        "draft_token_ids.clear()",
        "token_ids",
    ]


def test_truncate_drops_a_tail_and_caps_the_computed_count() -> None:
    """``Sequence.truncate`` (a rollback): pending tokens go first, the prompt is kept as it came."""
    seq = Sequence("t", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    seq.launch(4, samples=True)  # prefilled: a pending token follows the prompt
    seq.truncate(0)
    assert seq.token_ids == [1, 2, 3, 4, PENDING_TOKEN] and seq.num_pending_tokens == 1
    seq.truncate(2)  # the pending token and the prompt's last token
    assert seq.token_ids == [1, 2, 3] and seq.prompt_token_ids == [1, 2, 3, 4]
    assert seq.num_pending_tokens == 0 and seq.num_computed_tokens == 3
    seq.append_token(9)
    seq.launch(1, samples=True)
    seq.launch(0, samples=True)
    seq.truncate(1)  # one of the two pending tokens
    assert seq.token_ids == [1, 2, 3, 9, PENDING_TOKEN] and seq.num_pending_tokens == 1
    seq.drop_pending()
    assert seq.token_ids == [1, 2, 3, 9] and seq.num_computed_tokens == 4
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="cannot drop"):
            seq.truncate(bad)
    assert seq.token_ids == [1, 2, 3, 9]


KERNELS_AUTO: frozenset[str] = frozenset()  # kernels="auto" asks the registry (auto_devices)
STRATEGIES = ("allocator", "scheduler", "proposer", "sampler", "kernels", "model")


def _name_tests(path: Path) -> list[tuple[int, str]]:
    """Comparisons with a built-in plugin's name, and ``getattr`` probes on a strategy."""
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare):
            names = [
                c.value
                for c in (node.left, *node.comparators)
                if isinstance(c, ast.Constant) and c.value in PLUGIN_NAMES
            ]
            if names and lines[node.lineno - 1].strip() not in KERNELS_AUTO:
                found.append((node.lineno, f"compares with {names[0]!r}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and any(
                isinstance(n, ast.Attribute) and n.attr in STRATEGIES
                for n in ast.walk(node.args[0])
            )
        ):
            found.append((node.lineno, f"{node.func.id} probe"))
    return sorted(found)


def test_the_engine_names_no_plugin() -> None:
    """The step loop asks capabilities (``AllocatorBase.of`` and the like), not names or probes."""
    found = _name_tests(ROOT / "core" / "loop" / "engine.py")
    assert not found, f"core/loop/engine.py tests plugins by name or probe: {found}"


@pytest.mark.parametrize(
    ("base", "member", "default"),
    [
        (AllocatorBase, "shares_prefix_pages", False),
        (AllocatorBase, "caches_prefixes", False),
        (SamplerBase, "supports_logits_processors", False),
        (KernelSetBase, "merge_projections", False),
        (ModelBase, "supports_tensor_parallel", False),
        (ModelBase, "loads_quantized_weights", False),
    ],
)
def test_a_capability_left_out_reads_as_its_default(
    base: type, member: str, default: object
) -> None:
    assert base.of(object(), member) == default


def test_capabilities_read_from_the_strategy_and_default_methods_bind() -> None:
    from pitstop.plugins.allocators.paged import PagedAllocator
    from pitstop.plugins.allocators.prefix import PrefixCachingAllocator

    assert AllocatorBase.of(PrefixCachingAllocator(4, 8), "caches_prefixes") is True
    paged = PagedAllocator(4, 8)
    assert AllocatorBase.of(paged, "caches_prefixes") is False
    assert AllocatorBase.of(paged, "share_prompt") == paged.share_prompt
    a = Sequence("a", [1, 2, 3], __import__("pitstop").SamplingParams(max_tokens=1))
    assert AllocatorBase.of(object(), "share_prompt")(a, a) is None  # the default shares nothing
    assert ProposerBase.of(object(), "release")(a) is None
    with pytest.raises(AttributeError):
        AllocatorBase.of(paged, "caches_prefixs")  # a typo is not a missing capability
