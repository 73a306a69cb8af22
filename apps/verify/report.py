"""What `pitstop verify` found: each engine's run, every prompt's result, as text or JSON."""

from __future__ import annotations

import math
from typing import Any

import attrs

from pitstop.config import EngineConfig
from pitstop.verify.compare import NEAR_TIE, PASS, PromptResult, Tolerance

# The strategies that set the reference apart, shown first for both configurations.
STRATEGIES = ("kernels", "allocator", "scheduler", "speculative")


def describe_config(config: EngineConfig) -> str:
    """The strategies of a configuration, then every other setting it changes from the defaults."""
    defaults = EngineConfig()
    skip = {"model", "tokenizer", "dtype", "device", "max_model_len", *STRATEGIES}
    parts = [f"{name}={getattr(config, name) or 'none'}" for name in STRATEGIES]
    for name in EngineConfig.field_names():
        value = getattr(config, name)
        if name not in skip and value != getattr(defaults, name):
            parts.append(f"{name}={value}")
    return " ".join(parts)


@attrs.frozen
class RunSummary:
    """What one engine did while generating the prompt set."""

    config: EngineConfig  # as the engine resolved it (kernels 'auto' replaced)
    dtype: str  # as resolved ('auto' -> float32 on CPU, bfloat16 on CUDA)
    device: str
    kernels: dict[str, str]  # op -> implementation, from the kernel set's describe()
    steps: int
    seconds: float
    preemptions: int
    prefix_hit_tokens: int
    spec_proposed_tokens: int
    spec_accepted_tokens: int

    def describe(self) -> str:
        """One line: steps, time, and the features that were exercised."""
        parts = [f"{self.steps} steps in {self.seconds:.1f} s"]
        if self.prefix_hit_tokens:
            parts.append(f"{self.prefix_hit_tokens} prompt tokens from the prefix cache")
        if self.spec_proposed_tokens:
            parts.append(
                f"{self.spec_accepted_tokens}/{self.spec_proposed_tokens} draft tokens accepted"
            )
        if self.preemptions:
            parts.append(f"{self.preemptions} preemptions")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        data = attrs.asdict(self, recurse=False)
        data["config"] = attrs.asdict(self.config)
        return data


@attrs.frozen
class VerifyReport:
    """Everything one ``verify`` run found."""

    model: str
    dtype: str
    device: str
    tolerance: Tolerance
    reference: RunSummary
    candidate: RunSummary
    results: list[PromptResult]

    @property
    def passed(self) -> bool:
        """True when every prompt passed."""
        return all(r.passed for r in self.results)

    @property
    def num_failed(self) -> int:
        """Prompts that failed."""
        return sum(not r.passed for r in self.results)

    @property
    def fallback_ops(self) -> list[str]:
        """The ops whose candidate kernels fell back to the reference ones (e.g. fused on CPU).

        Empty when the candidate asked for the reference kernels itself.
        """
        if self.candidate.config.kernels == "reference":
            return []
        return [
            op
            for op, impl in self.candidate.kernels.items()
            if impl.startswith("reference") and self.reference.kernels.get(op, "") != ""
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the configurations, the tolerance and every prompt's result."""
        return {
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "tolerance": attrs.asdict(self.tolerance) | {"describe": self.tolerance.describe()},
            "passed": self.passed,
            "num_prompts": len(self.results),
            "num_failed": self.num_failed,
            "num_near_ties": sum(r.verdict == NEAR_TIE for r in self.results),
            "kernel_fallback_ops": self.fallback_ops,
            "reference": self.reference.to_dict(),
            "candidate": self.candidate.to_dict(),
            "prompts": [r.to_dict() for r in self.results],
        }


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2e}" if math.isfinite(value) else str(value)


def format_report(report: VerifyReport, *, width: int = 28) -> str:
    """The report as text: a header, one row per prompt, details of non-passing ones, a summary."""
    n = len(report.results)
    lines = [
        f"pitstop verify: {report.model}, {report.dtype} on {report.device}, {n} prompts",
        f"  reference: {describe_config(report.reference.config)}",
        f"             {report.reference.describe()}",
        f"  candidate: {describe_config(report.candidate.config)}",
        f"             {report.candidate.describe()}",
        *_kv_cache_note(report),
        "",
    ]
    header = ("#", "prompt", "tokens", "diverges", "max|dlogit|", "tolerance", "margin", "verdict")
    rows = [header]
    for i, r in enumerate(report.results, start=1):
        rows.append(
            (
                str(i),
                _short(r.prompt.label, width),
                f"{r.num_matching}/{len(r.reference_token_ids)}",
                "-" if r.first_divergence is None else str(r.first_divergence),
                _num(r.max_logit_diff),
                _num(r.tolerance),
                _num(r.reference_margin),
                r.verdict,
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    right = {0, 2, 3, 4, 5, 6}
    for row in rows:
        cells = [
            cell.rjust(w) if c in right else cell.ljust(w)
            for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    details = [(i, r) for i, r in enumerate(report.results, start=1) if r.verdict != PASS]
    if details:
        lines.append("")
    for i, r in details:
        lines.append(f"  {i} {r.prompt.label}: {r.verdict}: {r.reason}")
        if r.divergence_context is not None:
            before, ref_after, cand_after = r.divergence_context
            lines.append(f"      after      {_tail(before, 40)!r}")
            lines.append(f"      reference  {ref_after!r}")
            lines.append(f"      candidate  {cand_after!r}")
    passed = n - report.num_failed
    ties = sum(r.verdict == NEAR_TIE for r in report.results)
    worst = max(report.results, key=lambda r: r.excess)
    lines += [
        "",
        f"{'PASS' if report.passed else 'FAIL'}: {passed}/{n} prompts passed"
        + (f" ({ties} near-tie{'s' if ties != 1 else ''})" if ties else "")
        + f"; largest |dlogit| {_num(worst.max_logit_diff)} ({worst.prompt.label}); "
        f"tolerance for {report.dtype}: {report.tolerance.describe()}",
    ]
    fallback = report.fallback_ops
    if fallback:
        lines.append(
            f"NOTE: the candidate's {report.candidate.config.kernels!r} kernels fell back to the "
            f"reference ones for {', '.join(fallback)} on {report.device}, so those ops compared "
            "the reference with itself; run on a device where they are available to test them"
        )
    return "\n".join(lines)


def _kv_cache_note(report: VerifyReport) -> list[str]:
    """A line saying what a lossy KV cache under test means for the verdicts, if there is one."""
    ref, cand = report.reference.config.kv_cache_dtype, report.candidate.config.kv_cache_dtype
    if not cand.startswith("fp8") or ref == cand:
        return []
    ref = report.dtype if ref == "auto" else ref
    return [
        f"  note: the candidate's KV cache is {cand} (lossy), the reference's {ref}: logits move by",
        "        the format's rounding, beyond the dtype's tolerance. Read tokens and max|dlogit| as",
        "        its accuracy, or set --atol/--rtol to the error you accept; to check kernels on one",
        "        format, add --reference-kv-cache-dtype same.",
    ]


def _tail(text: str, width: int) -> str:
    return text if len(text) <= width else "\u2026" + text[-(width - 1) :]
