"""Flow-control values shared by the config, the handler API and the member: rate
limits written "N/DURATION" ("100/1s": at most 100 job starts in any 1-second window,
fleet-wide)."""

from __future__ import annotations

from datetime import timedelta
from typing import NamedTuple

from pgjobd.duration import EXAMPLES, format_duration, parse_duration

MAX_RATE = 100_000  # starts per window: one row each in the database (flow_start)


class RateLimit(NamedTuple):
    starts: int
    window: timedelta

    def __str__(self) -> str:
        return f"{self.starts}/{format_duration(self.window)}"


def parse_rate_limit(text: object) -> RateLimit:
    """A rate limit from "N/DURATION"; ValueError (saying what is expected) otherwise."""
    expected = f'expected "N/DURATION" like "100/1s" (N from 1 to {MAX_RATE}; DURATION {EXAMPLES})'
    if not isinstance(text, str):
        raise ValueError(f"{expected}, got {text!r}")
    count, slash, duration = text.partition("/")
    if not slash or not count.strip().isdigit():
        raise ValueError(f"{expected}, got {text!r}")
    starts = int(count)
    if not 1 <= starts <= MAX_RATE:
        raise ValueError(f"{expected}, got {starts} starts")
    try:
        window = parse_duration(duration.strip())
    except ValueError as e:
        raise ValueError(f"{expected}: {e}") from None
    if window <= timedelta(0):
        raise ValueError(f'{expected}: the window must be more than "0s", got {text!r}')
    return RateLimit(starts, window)


# A kind's circuit breaker (@job(circuit_breaker="N/DURATION", breaker_cooldown=)):
# the window and the cool-down each from 1 s (the breaker role's tick) to a day.
BREAKER_COOLDOWN_S = 30.0  # when circuit_breaker is given without breaker_cooldown
BREAKER_COOLDOWN_MIN_S = 1.0
BREAKER_SPAN_MAX_S = 86_400.0


def parse_circuit_breaker(text: object) -> RateLimit:
    """A breaker's "N/DURATION" (N failed attempts within DURATION open it); ValueError
    (saying what is expected) otherwise."""
    expected = (f'expected "N/DURATION" like "5/1m" (N failed attempts from 1 to {MAX_RATE} '
                f'within DURATION, from "1s" to "1d")')  # fmt: skip
    try:
        rate = parse_rate_limit(text)
    except ValueError as e:
        raise ValueError(f"{expected}; {e}") from None
    if not BREAKER_COOLDOWN_MIN_S <= rate.window.total_seconds() <= BREAKER_SPAN_MAX_S:
        raise ValueError(f"{expected}, got {text!r}")
    return rate
