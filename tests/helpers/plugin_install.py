"""Install a plugin distribution with pip into a folder of its own (for tests that load it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "example_plugin"


def pip_install(source: Path, target: Path) -> None:
    """``pip install --target target source`` without dependencies or build isolation.

    It builds from a copy of ``source``: a build in place leaves ``build/`` and an
    ``.egg-info`` beside the sources, and pytest, which puts a test folder on ``sys.path``,
    would then find the plugin's entry points in every later run of the suite."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / source.name
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        _pip_install(copy, target)


def _pip_install(source: Path, target: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
    )
