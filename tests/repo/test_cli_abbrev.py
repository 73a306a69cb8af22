"""argparse abbreviations are off everywhere: a prefix of a flag is an error, never that flag."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from pitstop.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _walk(parser: argparse.ArgumentParser, name: str = "pitstop"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk(sub, f"{name} {sub_name}")


def test_every_parser_and_subparser_refuses_abbreviations() -> None:
    parsers = dict(_walk(build_parser()))
    assert {"pitstop serve", "pitstop bench online", "pitstop cache clear"} <= set(parsers)
    on = [name for name, p in parsers.items() if p.allow_abbrev]
    assert not on, f"parsers that still accept abbreviations: {on}"


# (a command line with an abbreviated flag, the flag it abbreviates)
ABBREVIATED = [
    (["chat", "-m", "hi", "--max-token", "4"], "--max-token"),
    (["generate", "hello", "--max-token", "4"], "--max-token"),
    (["serve", "dummy:qwen3-0.6b", "--max-body", "5"], "--max-body"),
    (["bench", "offline", "--num-req", "4"], "--num-req"),
    (["bench", "online", "--concurr", "4"], "--concurr"),
    (["verify", "--max-token", "4"], "--max-token"),
]


@pytest.mark.parametrize(
    ("argv", "flag"), ABBREVIATED, ids=[" ".join(a[0][:2]) for a in ABBREVIATED]
)
def test_an_abbreviated_flag_is_an_error(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag"), ABBREVIATED, ids=[" ".join(a[0][:2]) for a in ABBREVIATED]
)
def test_the_whole_flag_still_works(argv: list[str], flag: str) -> None:
    full = {
        "--max-token": "--max-tokens",
        "--max-body": "--max-body-bytes",
        "--num-req": "--num-requests",
        "--concurr": "--concurrency",
    }[flag]
    build_parser().parse_args([full if a == flag else a for a in argv])


def _parsers_built_in(path: Path) -> list[int]:
    """Lines of ``path`` that call ``argparse.ArgumentParser(...)`` without allow_abbrev=False."""
    tree = ast.parse(path.read_text())
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "ArgumentParser"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "argparse"
        ):
            keep = [k for k in node.keywords if k.arg == "allow_abbrev"]
            if not (
                keep and isinstance(keep[0].value, ast.Constant) and keep[0].value.value is False
            ):
                lines.append(node.lineno)
    return lines


def test_scripts_build_their_parsers_without_abbreviations() -> None:
    files = [
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("apps/**/*.py"),
        ROOT / "apps" / "entrypoints" / "cli.py",
    ]
    files.append(ROOT / "tests" / "helpers" / "gpu_matrix.py")
    bad = {str(f.relative_to(ROOT)): ls for f in files if (ls := _parsers_built_in(f))}
    assert not bad, f"argparse.ArgumentParser(...) without allow_abbrev=False: {bad}"
