"""Durations written as strings: "250ms", "30s", "5m", "2h", "7d", "1h30m"."""

from __future__ import annotations

import math
import re
from datetime import timedelta
from fractions import Fraction

UNITS_US: dict[str, int] = {
    "d": 86_400_000_000,
    "h": 3_600_000_000,
    "m": 60_000_000,
    "s": 1_000_000,
    "ms": 1_000,
}
# Largest first: the order components must appear in, and the order format() writes them.
UNIT_ORDER = tuple(UNITS_US)
EXAMPLES = '"30s", "250ms" or "1h30m" (units: ms, s, m, h, d)'

# "ms" before "m" so that "250ms" is not read as 250 minutes and a stray "s".
_COMPONENT = re.compile(r"(\d+(?:\.\d+)?)(ms|d|h|m|s)")


class Duration(timedelta):
    """A non-negative timedelta parsed from a duration string; str() writes it back.

    Arithmetic on it gives plain timedeltas; `total_seconds()` gives float seconds, and
    asyncpg binds it to an `interval` as it is.
    """

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> Duration:
        return parse_duration(text)

    @classmethod
    def of(cls, value: timedelta) -> Duration:
        return cls(days=value.days, seconds=value.seconds, microseconds=value.microseconds)

    def __str__(self) -> str:
        return format_duration(self)

    def __repr__(self) -> str:
        return f"Duration({format_duration(self)!r})"


def _quote(text: str) -> str:
    # Double quotes, as the text would be written in TOML.
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _microseconds(text: str) -> int:
    """The signed length of `text` in microseconds; ValueError if it is not a duration."""
    stripped = text.strip()
    body = stripped[1:] if stripped.startswith("-") else stripped
    position = 0
    last_unit_rank = -1
    total = Fraction(0)
    if re.fullmatch(r"\d+(?:\.\d+)?", body):
        raise ValueError(
            f"expected a duration like {EXAMPLES}, got {_quote(text)}: a number needs a unit"
        )
    while position < len(body):
        match = _COMPONENT.match(body, position)
        if match is None:
            raise ValueError(f"expected a duration like {EXAMPLES}, got {_quote(text)}")
        number, unit = match.groups()
        rank = UNIT_ORDER.index(unit)
        if rank <= last_unit_rank:
            raise ValueError(
                f"expected a duration with each unit at most once, largest first "
                f'(like "1h30m"), got {_quote(text)}'
            )
        last_unit_rank = rank
        total += Fraction(number) * UNITS_US[unit]
        position = match.end()
    if last_unit_rank < 0:
        raise ValueError(f"expected a duration like {EXAMPLES}, got {_quote(text)}")
    microseconds = round(total)
    if microseconds > _MAX_MICROSECONDS:
        raise ValueError(f"duration {_quote(text)} is too long (at most 999999999d)")
    return -microseconds if stripped.startswith("-") else microseconds


_MAX_MICROSECONDS = (timedelta.max.days + 1) * UNITS_US["d"] - 1


def parse_duration(text: str) -> Duration:
    """Parse a non-negative duration string; ValueError says what was expected."""
    if not isinstance(text, str):
        raise TypeError(f"expected a duration string like {EXAMPLES}, got {type(text).__name__}")
    microseconds = _microseconds(text)
    if microseconds < 0 or text.strip().startswith("-"):
        raise ValueError(f"expected a duration that is not negative, got {_quote(text)}")
    return Duration(microseconds=microseconds)


def to_timedelta(value: str | int | float | timedelta) -> timedelta:
    """A timedelta from a duration string, a number of seconds or a timedelta.

    The sign is kept ("-5s", -5 and timedelta(seconds=-5) all give minus five seconds):
    whether a negative length makes sense is the caller's decision.
    """
    if isinstance(value, timedelta):
        return value
    if isinstance(value, str):
        return timedelta(microseconds=_microseconds(value))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"expected a duration string like {EXAMPLES}, a number of seconds or a "
            f"timedelta, got {type(value).__name__}"
        )
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number of seconds, got {value!r}")
    try:
        return timedelta(seconds=value)
    except OverflowError:
        raise ValueError(f"duration of {value!r} seconds is too long") from None


def format_duration(value: timedelta) -> str:
    """Write a timedelta the way parse_duration reads it: "1d2h3m4s500ms", "1.5ms", "0s"."""
    microseconds = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    if microseconds == 0:
        return "0s"
    sign = "-" if microseconds < 0 else ""
    remaining = abs(microseconds)
    parts: list[str] = []
    for unit in UNIT_ORDER[:-1]:
        count, remaining = divmod(remaining, UNITS_US[unit])
        if count:
            parts.append(f"{count}{unit}")
    if remaining:
        milliseconds, sub_ms = divmod(remaining, 1_000)
        fraction = f".{sub_ms:03d}".rstrip("0") if sub_ms else ""
        parts.append(f"{milliseconds}{fraction}ms")
    return sign + "".join(parts)
