"""The Hypothesis settings the conformance suites run under."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings


def suite_settings(max_examples: int, **extra: Any) -> settings:
    """``max_examples`` drawn cases, no deadline, no example database, and no health check
    for slow or large draws; ``extra`` are further ``hypothesis.settings`` keywords."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        **extra,
    )
