"""Time, for the parts whose behaviour depends on it: the real clock, and a fake one.

Statements that read the time take it as ``coalesce($n::timestamptz, now())``: the real
clock passes NULL, so the database's own now() is used; a FakeClock passes its own
time, so a test moves time forward instead of sleeping. Durations a part measures on
this host (how long an alarm has been on) read `monotonic()`.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta


class Clock:
    """The real clock."""

    def now(self) -> datetime | None:
        """The time for a statement's ``coalesce($n, now())``; None: the database's."""
        return None

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM = Clock()


class FakeClock(Clock):
    """A clock that moves only when told to (tests)."""

    def __init__(self, now: datetime) -> None:
        if now.tzinfo is None:
            raise ValueError(f"FakeClock needs an aware datetime, got {now!r}")
        self._now = now
        self._monotonic = 0.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, **delta: float) -> None:
        """Move forward by ``timedelta(**delta)``."""
        step = timedelta(**delta)
        if step < timedelta(0):
            raise ValueError(f"a clock does not go back: advance({delta})")
        self._now += step
        self._monotonic += step.total_seconds()

    def set(self, now: datetime) -> None:
        """Jump to `now` (back as well as forward: a wall clock may be set back);
        monotonic time moves forward by the jump, or not at all."""
        self._monotonic += max(0.0, (now - self._now).total_seconds())
        self._now = now
