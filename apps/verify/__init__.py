"""`pitstop verify`: does a configuration still compute what the reference computes?

Every engine setting that is not the model (kernels, allocator, scheduler,
speculation, precision flags) should leave greedy output unchanged up to
rounding. :func:`verify` checks it on a fixed prompt set:

1. The reference configuration (:func:`reference_config`: the same model,
   dtype, device, seed and memory settings, with ``reference`` kernels, the
   ``paged`` allocator, the ``continuous`` scheduler and no speculation)
   generates greedily; its logits at every generated position are kept.
2. The configuration under test generates greedily the same way. Both engines
   get the prompts one per step, as a server would, so prefills share steps
   with decodes and prompts that share a prefix can hit the prefix cache.
3. Every logit row the tested engine computes, wherever it computes it (a
   prefill, a chunk, a decode, a CUDA graph, a speculative verification), is
   compared with the reference's row for the same position while the tokens
   before that position agree (rows that verified rejected drafts do not count).

Per prompt the report gives the first generated token where the two differ,
the largest ``|logit difference|`` up to and including it, and the reference's
margin there; a prompt passes when that difference is within the dtype's
tolerance (a divergence is then a near-tie that rounding can flip).

The pieces, one concept per module:

- :mod:`pitstop.verify.prompts`: the shipped prompt set and JSON-lines files;
- :mod:`pitstop.verify.compare`: tolerances by dtype and one prompt's verdict;
- :mod:`pitstop.verify.report`: each run's summary, the report as text and JSON;
- :mod:`pitstop.verify.run`: the reference configuration, the logit tap, :func:`verify`;
- :mod:`pitstop.verify.cli`: the ``pitstop verify`` subcommand.

Importing this package does not import torch; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pitstop.verify.compare import PromptResult, Tolerance, default_tolerance
    from pitstop.verify.prompts import VerifyPrompt, load_prompts, shipped_prompts
    from pitstop.verify.report import VerifyReport, format_report
    from pitstop.verify.run import reference_config, verify

_EXPORTS = {
    "verify": "run",
    "reference_config": "run",
    "VerifyReport": "report",
    "format_report": "report",
    "PromptResult": "compare",
    "Tolerance": "compare",
    "default_tolerance": "compare",
    "VerifyPrompt": "prompts",
    "load_prompts": "prompts",
    "shipped_prompts": "prompts",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"pitstop.verify.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'pitstop.verify' has no attribute {name!r}")


__all__ = [
    "PromptResult",
    "Tolerance",
    "VerifyPrompt",
    "VerifyReport",
    "default_tolerance",
    "format_report",
    "load_prompts",
    "reference_config",
    "shipped_prompts",
    "verify",
]
