"""Named engine configurations for ``--matrix``: the article's ablation steps, or a TOML file.

The built-in steps are cumulative: each adds one strategy to the one before
(``baseline,+paged,+continuous`` runs baseline, then baseline with the paged
allocator, then that with continuous batching). A TOML file holds one table
per configuration, each a set of engine settings applied on top of the flags::

    [baseline]
    allocator = "preallocated"
    scheduler = "fcfs"

    [tuned]
    scheduler = "chunked"
    chunk_size = 256
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pitstop.errors import PitstopError

# What each built-in step sets (on top of everything before it).
STEPS: dict[str, dict[str, Any]] = {
    "baseline": {
        "allocator": "preallocated",
        "scheduler": "fcfs",
        "kernels": "reference",
        "overlap": "off",
        # the defaults the article's ablation was measured with (until 2026-12-01)
        "max_num_batched_tokens": 16384,
    },
    "+paged": {"allocator": "paged"},
    "+continuous": {"scheduler": "continuous"},
    "+fused": {"kernels": "fused"},
    "+chunked": {"scheduler": "chunked", "chunk_size": 512},
    "+overlap": {"overlap": "on"},
    "+prefix": {"allocator": "prefix"},
    "+tiered": {"allocator": "tiered"},  # prefix + a host tier (--kv-offloading-size GiB)
    "+ngram": {"speculative": "ngram"},
}
ARTICLE = "baseline,+paged,+continuous,+fused"


class MatrixError(PitstopError, ValueError):
    """A ``--matrix`` name or file is invalid."""


def parse_matrix(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``spec`` (comma-separated step names, or a ``.toml`` file) -> ``[(name, settings), ...]``."""
    path = Path(spec)
    if spec.endswith(".toml") or path.is_file():
        return _from_toml(path)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise MatrixError("--matrix needs at least one configuration name")
    out: list[tuple[str, dict[str, Any]]] = []
    settings: dict[str, Any] = {}
    for name in names:
        if name not in STEPS:
            raise MatrixError(
                f"unknown configuration {name!r} in --matrix; built-in steps: {', '.join(STEPS)} "
                "(or give a TOML file of named configurations)"
            )
        settings = {**settings, **STEPS[name]}
        out.append((name, dict(settings)))
    if len({n for n, _ in out}) != len(out):
        raise MatrixError(f"--matrix names a configuration twice: {spec!r}")
    return out


def select(
    configs: list[tuple[str, dict[str, Any]]], names: str
) -> list[tuple[str, dict[str, Any]]]:
    """The configurations of ``configs`` named in ``names`` (comma-separated), in matrix order."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [n for n, _ in configs]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise MatrixError(
            f"--only names {', '.join(unknown) or 'nothing'}, which the matrix does not hold; "
            f"its configurations: {', '.join(known)}"
        )
    return [(n, s) for n, s in configs if n in wanted]


def _from_toml(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise MatrixError(f"matrix file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"matrix file {path} is not valid TOML: {exc}") from None
    tables = data.get("configs", data)
    out = [(name, dict(v)) for name, v in tables.items() if isinstance(v, dict)]
    bad = [name for name, v in tables.items() if not isinstance(v, dict)]
    if bad or not out:
        raise MatrixError(
            f"matrix file {path} must hold one table per configuration ([name] then settings); "
            f"not a table: {', '.join(bad) or '(no tables at all)'}"
        )
    return out


# keys of a matrix configuration that the bench reads itself, not engine settings
# (``lora_adapters``: how many random adapters the requests run with, as --lora-adapters)
BENCH_KEYS = ("lora_adapters",)


def engine_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A configuration's settings without the bench's own keys (:data:`BENCH_KEYS`)."""
    return {k: v for k, v in settings.items() if k not in BENCH_KEYS}


def describe(settings: dict[str, Any]) -> str:
    """A short label of the strategies a configuration picks."""
    keys = ("allocator", "scheduler", "kernels", "speculative")
    return "/".join(str(settings[k]) for k in keys if settings.get(k))
