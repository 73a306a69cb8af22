"""The ``pitstop verify`` subcommand: flags, then :func:`pitstop.verify.run.verify`, then the report.

Exit status: 0 when every prompt passes, 1 when one fails, 2 on bad input
(the ``pitstop`` entry point turns a :class:`~pitstop.errors.PitstopError` into 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pitstop.config import KV_CACHE_DTYPES
from pitstop.entrypoints.engine_args import add_cli_flags, config_from_cli
from pitstop.errors import ConfigError
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.verify.prompts import load_prompts, prompt_from_dict, shipped_prompts


@hookimpl
def register_commands(register: Any) -> None:
    """Register ``pitstop verify``."""
    register(
        "verify",
        add_arguments,
        run,
        help="check a configuration's greedy output and logits against the reference kernels",
        description="Run a prompt set through the given configuration and through the reference "
        "one (reference kernels, paged allocator, continuous scheduler, no speculation) on the "
        "same weights; report per prompt the first token where they diverge and the largest "
        "logit difference before it. Exit 0: all pass; 1: some prompt fails; 2: bad input.",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``pitstop verify``'s flags: prompt, tolerance and output flags, then every engine flag."""
    p.add_argument(
        "--prompts",
        dest="prompts_files",
        action="append",
        metavar="FILE.jsonl",
        help='JSON lines: {"prompt": ...} or {"messages": [...]}, optional "max_tokens", "id" '
        "(repeatable; default: the prompt set shipped with pitstop)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt (repeatable; default: the shipped prompt set)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        metavar="N",
        help="tokens to generate per prompt (default: each prompt's own, 32 if it sets none)",
    )
    p.add_argument(
        "--atol",
        type=_non_negative_float,
        metavar="X",
        help="absolute logit tolerance (replaces the dtype's default; adds to --rtol)",
    )
    p.add_argument(
        "--rtol",
        type=_non_negative_float,
        metavar="X",
        help="tolerance relative to the largest |logit| (replaces the dtype's default)",
    )
    p.add_argument(
        "--reference-kv-cache-dtype",
        choices=("same", *KV_CACHE_DTYPES),
        default="auto",
        help="the reference's KV cache: auto (the model's dtype; default), or same (the one "
        "under test, e.g. to check fused fp8 kernels against reference fp8 ones)",
    )
    p.add_argument(
        "--json", metavar="FILE", help="also write every result to FILE as JSON (default: none)"
    )
    add_cli_flags(p)


def run(args: argparse.Namespace) -> int:
    """Verify the configuration the flags describe; print the report; 0 pass, 1 fail."""
    from pitstop.verify.compare import Tolerance
    from pitstop.verify.report import format_report
    from pitstop.verify.run import verify

    config = config_from_cli(args)  # bad settings fail before the prompts are read
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise ConfigError(f"--json {args.json}: folder {Path(args.json).parent} does not exist")
    prompts = [p for path in args.prompts_files or [] for p in load_prompts(path)]
    prompts += [
        prompt_from_dict({"prompt": text}, f"--prompt {i}")
        for i, text in enumerate(args.prompt or [], start=1)
    ]
    tolerance = None
    if args.atol is not None or args.rtol is not None:
        tolerance = Tolerance(atol=args.atol or 0.0, rtol=args.rtol or 0.0)
    report = verify(
        config,
        prompts or shipped_prompts(),
        tolerance=tolerance,
        max_tokens=args.max_tokens,
        reference_kv_cache_dtype=args.reference_kv_cache_dtype,
    )
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if report.passed else 1


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value
