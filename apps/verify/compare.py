"""Judging one prompt: where the two outputs part, how far the logits moved, and the verdict.

A prompt passes when every compared logit row of the configuration under test
is within the tolerance of the reference's row (:class:`Tolerance`, by dtype).
A divergence is then a near-tie: the reference's two best tokens were closer
than rounding noise, which may flip the argmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from pitstop.verify.prompts import VerifyPrompt

PASS, NEAR_TIE, FAIL = "PASS", "PASS (near-tie)", "FAIL"
_CONTEXT_TOKENS = 8  # tokens shown after a divergence


@attrs.frozen
class Tolerance:
    """How far a logit may move: ``atol + rtol * scale``, where ``scale`` is the largest
    ``|logit|`` of the reference over the positions compared for one prompt."""

    atol: float = 0.0
    rtol: float = 0.0

    def bound(self, scale: float) -> float:
        """The absolute tolerance, in logits, for a prompt whose logits reach ``scale``."""
        return self.atol + self.rtol * scale

    def describe(self) -> str:
        """E.g. ``'1e-04 x max|logit|'`` or ``'0.5'``."""
        parts = [f"{self.atol:g}"] if self.atol or not self.rtol else []
        if self.rtol:
            parts.append(f"{self.rtol:g} x max|logit|")
        return " + ".join(parts)


# Relative to the logit scale, so that one number serves models whose logits reach 10 or
# 50. Rounding noise alone (SmolLM2 on CPU, chunked scheduler + prefix allocator against
# the reference, 12 prompts x 64 tokens) moves logits by up to 2e-6 x max|logit| in float32,
# 4e-3 in float16 and 2.5e-2 in bfloat16 (whose logits come out of a bfloat16 GEMM, one
# ulp = 1/128 of their size). The bounds leave 2-50x room; a real kernel bug moves logits
# by a good fraction of their size.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=1e-4),
    torch.float16: Tolerance(rtol=1e-2),
    torch.bfloat16: Tolerance(rtol=5e-2),
}


def default_tolerance(dtype: torch.dtype | str) -> Tolerance:
    """The tolerance of a dtype: ``torch.float32`` or ``"float32"``, float16, bfloat16."""
    return DEFAULT_TOLERANCES[getattr(torch, dtype) if isinstance(dtype, str) else dtype]


@attrs.frozen
class PromptResult:
    """The comparison of one prompt's greedy output under both configurations."""

    prompt: VerifyPrompt
    num_prompt_tokens: int
    max_tokens: int  # the generation limit used (the prompt's own, or the override)
    reference_token_ids: list[int]
    candidate_token_ids: list[int]
    reference_text: str
    candidate_text: str
    first_divergence: int | None  # output index of the first differing token; None: identical
    # at the divergence: (the output before it, the reference's next tokens, the candidate's)
    divergence_context: tuple[str, str, str] | None
    max_logit_diff: float  # max |candidate - reference| over the compared rows (nan: non-finite)
    max_logit_diff_at: int | None  # output index where it occurs
    num_compared: int  # positions whose logits were compared (up to and including the divergence)
    logit_scale: float  # max |reference logit| over the compared positions
    tolerance: float  # absolute, in logits
    reference_margin: float | None  # at the divergence: reference top-1 minus top-2 logit
    reference_gap: float | None  # at the divergence: reference logit of its token minus the other's
    verdict: str  # PASS, PASS (near-tie) or FAIL
    reason: str  # why, in words

    @property
    def passed(self) -> bool:
        """Whether the verdict is a pass (near-ties included)."""
        return self.verdict != FAIL

    @property
    def excess(self) -> float:
        """The largest logit difference over the tolerance (inf when non-finite)."""
        return _order(self.max_logit_diff) / (self.tolerance or 1.0)

    @property
    def num_matching(self) -> int:
        """Leading output tokens the two configurations agree on."""
        if self.first_divergence is None:
            return len(self.reference_token_ids)
        return self.first_divergence

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite numbers become strings)."""
        data = attrs.asdict(self, recurse=False)
        data["prompt"] = self.prompt.to_dict()
        data["source"] = self.prompt.source
        data["num_matching"] = self.num_matching
        data["passed"] = self.passed
        for key in ("max_logit_diff", "logit_scale", "reference_margin", "reference_gap"):
            value = data[key]
            if isinstance(value, float) and not math.isfinite(value):
                data[key] = str(value)
        return data


def _order(diff: float) -> float:
    """A sort key that puts NaN above every number."""
    return math.inf if math.isnan(diff) else diff


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def judge(
    prompt: VerifyPrompt,
    num_prompt_tokens: int,
    max_tokens: int,
    tokens: tuple[list[int], list[int]],
    texts: tuple[str, str],
    ref_logits: list[torch.Tensor],
    diffs: dict[int, float],
    tolerance: Tolerance,
    decode: Callable[[list[int]], str],
) -> PromptResult:
    """One prompt's verdict from the two outputs and the per-position logit differences."""
    ref_tokens, cand_tokens = tokens
    div = first_divergence(ref_tokens, cand_tokens)
    # every position whose preceding tokens agree: up to and including the divergence
    last = len(ref_tokens) - 1 if div is None else min(div, len(ref_tokens) - 1)
    positions = range(min(last + 1, len(ref_logits)))
    scale = max((ref_logits[o].abs().max().item() for o in positions), default=0.0)
    bound = tolerance.bound(scale)
    compared = {o: diffs[o] for o in positions if o in diffs}
    missing = [o for o in range(last + 1) if o not in compared]
    worst_at = max(compared, key=lambda o: _order(compared[o]), default=None)
    worst = compared[worst_at] if worst_at is not None else 0.0

    margin = gap = None
    context = None
    if div is not None:
        context = (
            decode(ref_tokens[:div]),
            decode(ref_tokens[div : div + _CONTEXT_TOKENS]),
            decode(cand_tokens[div : div + _CONTEXT_TOKENS]),
        )
        if div < len(ref_logits):
            row = ref_logits[div]
            top2 = row.topk(2).values
            margin = (top2[0] - top2[1]).item()
            if div < len(cand_tokens):
                gap = (row[ref_tokens[div]] - row[cand_tokens[div]]).item()

    if math.isnan(worst):
        verdict, reason = FAIL, f"non-finite logits at output token {worst_at}"
    elif worst > bound:
        verdict = FAIL
        reason = f"logits differ by {worst:.3g} > tolerance {bound:.3g} at output token {worst_at}"
    elif missing:
        verdict, reason = FAIL, f"no comparable logits for output token(s) {missing[:5]}"
    elif div is None:
        verdict, reason = PASS, "same tokens, logits within tolerance"
    elif gap is None:
        which = "reference" if len(ref_tokens) < len(cand_tokens) else "candidate"
        verdict, reason = FAIL, f"same tokens, but the {which} stopped after {div} tokens"
    elif gap > 2 * bound:
        verdict = FAIL
        reason = (
            f"diverges at output token {div}, where the reference prefers its token by {gap:.3g}"
        )
    else:
        verdict = NEAR_TIE
        reason = (
            f"diverges at output token {div}, where the reference's two choices are {gap:.3g} "
            f"apart: a near-tie that rounding within tolerance can flip"
        )
    return PromptResult(
        prompt=prompt,
        num_prompt_tokens=num_prompt_tokens,
        max_tokens=max_tokens,
        reference_token_ids=list(ref_tokens),
        candidate_token_ids=list(cand_tokens),
        reference_text=texts[0],
        candidate_text=texts[1],
        first_divergence=div,
        divergence_context=context,
        max_logit_diff=worst,
        max_logit_diff_at=worst_at,
        num_compared=len(compared),
        logit_scale=scale,
        tolerance=bound,
        reference_margin=margin,
        reference_gap=gap,
        verdict=verdict,
        reason=reason,
    )
