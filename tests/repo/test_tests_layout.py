"""The tests mirror the package (issue 45): a test of ``core/<x>`` lives in ``tests/core/<x>/``,
of ``plugins/<kind>`` in ``tests/plugins/<kind>/``, of ``apps/<app>`` in ``tests/apps/<app>/``;
checks of the whole tree live in ``tests/repo/``. Nothing but conftest.py sits in ``tests/``."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# tests/ folders that are not a mirror: whole-tree checks, the shared helper package, and
# the example third-party distribution (its own layout, built and installed by the tests)
OWN_FOLDERS = {"repo", "helpers", "example_plugin"}


def _home(test: Path) -> str | None:
    """The source folder or module a test file's folder mirrors, or None when it mirrors none."""
    parts = test.relative_to(TESTS).parts[:-1]
    if len(parts) == 1 and parts[0] == "repo":
        return "repo"
    if len(parts) != 2 or parts[0] not in ("core", "plugins", "apps"):
        return None
    top, sub = parts
    if (ROOT / top / sub).is_dir() or (top == "core" and (ROOT / top / f"{sub}.py").is_file()):
        return f"{top}/{sub}"
    return None


def _test_files() -> list[Path]:
    return sorted(
        p
        for p in TESTS.rglob("test_*.py")
        if p.relative_to(TESTS).parts[0] not in ("example_plugin",)
        and "fake_vllm" not in p.relative_to(TESTS).parts
    )


def test_no_module_directly_under_tests() -> None:
    stray = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert stray == [], f"move these into a mirrored folder or tests/helpers/: {stray}"


def test_every_test_file_lives_in_a_folder_mirroring_the_package() -> None:
    files = _test_files()
    assert len(files) > 80  # the glob found the suite
    misplaced = [str(p.relative_to(ROOT)) for p in files if _home(p) is None]
    assert misplaced == [], (
        "a test lives in tests/core/<sub>/, tests/plugins/<kind>/, tests/apps/<app>/ "
        f"(each naming a folder of the source tree) or tests/repo/: {misplaced}"
    )


def test_every_top_level_folder_of_tests_is_known() -> None:
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= {"core", "plugins", "apps"} | OWN_FOLDERS, sorted(folders)


def test_helpers_hold_no_tests() -> None:
    assert not list((TESTS / "helpers").rglob("test_*.py"))
