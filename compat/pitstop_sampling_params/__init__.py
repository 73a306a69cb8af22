"""vLLM's module path ``vllm.sampling_params``: ``from pitstop.sampling_params import SamplingParams``.

The classes live in :mod:`pitstop.entrypoints.sampling_params` and
:mod:`pitstop.entrypoints.beam_search`; this module names them where vLLM code imports them.
"""

from __future__ import annotations

from pitstop.entrypoints.beam_search import BeamSearchParams
from pitstop.entrypoints.sampling_params import (
    SAMPLING_EPS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "SAMPLING_EPS",
    "BeamSearchParams",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
