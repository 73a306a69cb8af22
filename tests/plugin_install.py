"""Install a plugin distribution with pip into a folder of its own (for tests that load it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent / "example_plugin"


def pip_install(source: Path, target: Path) -> None:
    """``pip install --target target source`` without dependencies or build isolation."""
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
