"""Progress of a benchmark run: tqdm's bar on a terminal, a log line every few seconds elsewhere.

tqdm draws its bar with carriage returns, which a log file or a CI console
shows as one endless line (or, with the bar turned off, as nothing for the
minutes a run lasts). When stderr is not a terminal, :class:`LogProgress`
logs ``name: done/total requests, rate, elapsed`` instead, at most every
``interval_s`` seconds and once at the end.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

log = logging.getLogger("pitstop.bench")

LOG_INTERVAL_S = 10.0  # the longest a logged run stays silent


class Progress(Protocol):
    """What the drivers call: ``update(n)`` after every poll (``n`` may be 0), in a ``with``."""

    def update(self, n: int = 1) -> Any: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> Any: ...


class LogProgress:
    """Requests done out of ``total``, logged every ``interval_s`` seconds of ``clock``
    (default :data:`LOG_INTERVAL_S`)."""

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.total = total
        self.desc = desc
        self.done = 0
        self.interval_s = LOG_INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.logger = logger
        self.start = clock()
        self.last_log = self.start

    def update(self, n: int = 1) -> None:
        """Count ``n`` more finished requests; log a line if ``interval_s`` has passed."""
        self.done += n
        now = self.clock()
        if now - self.last_log >= self.interval_s:
            self._log(now)

    def _log(self, now: float) -> None:
        self.last_log = now
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        self.logger.info(
            "%s: %d/%d requests, %.2f req/s, %.0f s elapsed",
            self.desc,
            self.done,
            self.total,
            rate,
            elapsed,
        )

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self._log(self.clock())


def progress(total: int, desc: str) -> Progress:
    """tqdm's bar when stderr is a terminal, else a :class:`LogProgress`."""
    if not sys.stderr.isatty():
        return LogProgress(total, desc)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)
