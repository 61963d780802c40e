from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.duration import Duration, format_duration, parse_duration, to_timedelta


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("250ms", timedelta(milliseconds=250)),
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("2h", timedelta(hours=2)),
        ("7d", timedelta(days=7)),
        ("0s", timedelta(0)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1d2h3m4s5ms", timedelta(days=1, hours=2, minutes=3, seconds=4, milliseconds=5)),
        ("1.5s", timedelta(seconds=1.5)),
        ("0.5ms", timedelta(microseconds=500)),
        (" 30s ", timedelta(seconds=30)),
        ("90s", timedelta(seconds=90)),
    ],
)
def test_parse(text: str, expected: timedelta) -> None:
    parsed = parse_duration(text)
    assert parsed == expected
    assert isinstance(parsed, Duration)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", 'expected a duration like "30s"'),
        ("30", "a number needs a unit"),
        ("5 m", 'got "5 m"'),
        ("5min", 'got "5min"'),
        ("30S", 'got "30S"'),
        ("1.2.3s", 'got "1.2.3s"'),
        (".5s", 'got ".5s"'),
        ("ms", 'got "ms"'),
        ("30m1h", "largest first"),
        ("5m5m", "each unit at most once"),
        ("-5s", "not negative"),
        ("-0s", "not negative"),
        ("1000000000d", "too long"),
    ],
)
def test_parse_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="duration") as caught:
        parse_duration(text)
    assert fragment in str(caught.value)


def test_parse_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match='duration string like "30s"'):
        parse_duration(30)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(seconds=90), "1m30s"),
        (timedelta(days=1, hours=2, minutes=3, seconds=4, milliseconds=5), "1d2h3m4s5ms"),
        (timedelta(microseconds=1500), "1.5ms"),
        (timedelta(microseconds=1), "0.001ms"),
        (timedelta(seconds=-90), "-1m30s"),
    ],
)
def test_format(value: timedelta, text: str) -> None:
    assert format_duration(value) == text


def test_duration_str_and_repr() -> None:
    lease = parse_duration("1h30m")
    assert str(lease) == "1h30m"
    assert repr(lease) == "Duration('1h30m')"
    assert lease.total_seconds() == 5400.0
    assert Duration.parse("2h") == Duration.of(timedelta(hours=2)) == timedelta(hours=2)


any_timedelta = st.timedeltas(min_value=timedelta(0), max_value=timedelta.max)


@given(any_timedelta)
def test_format_then_parse_round_trips(value: timedelta) -> None:
    assert parse_duration(format_duration(value)) == value


@given(st.timedeltas())
def test_format_then_to_timedelta_round_trips_signed(value: timedelta) -> None:
    assert to_timedelta(format_duration(value)) == value


@given(
    st.lists(st.integers(min_value=0, max_value=10_000), min_size=5, max_size=5),
)
def test_compound_adds_up(counts: list[int]) -> None:
    days, hours, minutes, seconds, millis = counts
    text = f"{days}d{hours}h{minutes}m{seconds}s{millis}ms"
    expected = timedelta(
        days=days, hours=hours, minutes=minutes, seconds=seconds, milliseconds=millis
    )
    assert parse_duration(text) == expected
    # Written back canonically: parsing that again gives the same value.
    assert parse_duration(str(parse_duration(text))) == expected


@given(st.text(max_size=12))
def test_garbage_is_a_value_error_or_a_duration(text: str) -> None:
    try:
        parsed = parse_duration(text)
    except ValueError as error:
        assert "duration" in str(error)
    else:
        assert parsed >= timedelta(0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10s", timedelta(seconds=10)),
        ("-10s", timedelta(seconds=-10)),
        (10, timedelta(seconds=10)),
        (2.5, timedelta(seconds=2.5)),
        (-1, timedelta(seconds=-1)),
        (timedelta(minutes=1), timedelta(minutes=1)),
        (timedelta(minutes=-1), timedelta(minutes=-1)),
    ],
)
def test_to_timedelta(value: str | float | timedelta, expected: timedelta) -> None:
    assert to_timedelta(value) == expected


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30, "10", "soon"])
def test_to_timedelta_rejects_bad_values(value: str | float) -> None:
    with pytest.raises(ValueError, match=r"duration|seconds"):
        to_timedelta(value)


@pytest.mark.parametrize("value", [True, None, [1], b"10s"])
def test_to_timedelta_rejects_other_types(value: object) -> None:
    with pytest.raises(TypeError, match='duration string like "30s"'):
        to_timedelta(value)  # type: ignore[arg-type]
