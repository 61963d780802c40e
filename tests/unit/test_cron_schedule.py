"""Cron slot arithmetic: DST in America/New_York, Europe/London and Australia/Lord_Howe
(a 30-minute shift), catch-up policies, and properties over times and zones."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgjobd.cron_schedule import (
    ScheduleError,
    check,
    due_slots,
    next_slot,
    next_slot_remembered,
    plan,
    repeats_in_overlap,
    slot_key,
)

NY = ZoneInfo("America/New_York")
LONDON = ZoneInfo("Europe/London")
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")
ZONES = [NY, LONDON, LORD_HOWE, ZoneInfo("UTC"), ZoneInfo("Asia/Kolkata")]
SCHEDULES = [
    "* * * * *", "*/15 * * * *", "30 * * * *", "0 */2 * * *", "30 2 * * *", "30 1 * * *",
    "45 1 * * *", "15 2 * * *", "0 0 * * *", "*/20 1 * * *", "0 9 * * 1-5", "@hourly",
    "@daily", "0 0 1 * *",
]  # fmt: skip
FIXED_HOUR = [s for s in SCHEDULES if not repeats_in_overlap(s)]


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def local(zone: ZoneInfo, slots: list[datetime]) -> list[str]:
    return [s.astimezone(zone).isoformat() for s in slots]


def all_slots(schedule: str, zone: ZoneInfo, after: datetime, now: datetime) -> list[datetime]:
    return due_slots(schedule, zone, after, now, "all", limit=100_000)


@pytest.mark.parametrize(
    ("zone", "schedule", "after", "now", "expected"),
    [
        # Spring forward: 02:30 does not exist; it fires once, when the gap ends.
        (NY, "30 2 * * *", utc(2026, 3, 7, 12), utc(2026, 3, 9, 12),
         ["2026-03-08T03:00:00-04:00", "2026-03-09T02:30:00-04:00"]),
        (LONDON, "30 1 * * *", utc(2026, 3, 28, 12), utc(2026, 3, 30, 12),
         ["2026-03-29T02:00:00+01:00", "2026-03-30T01:30:00+01:00"]),
        (LORD_HOWE, "15 2 * * *", utc(2026, 10, 3), utc(2026, 10, 5),
         ["2026-10-04T02:30:00+11:00", "2026-10-05T02:15:00+11:00"]),
        # Fall back: 01:30 happens twice; a daily job fires at the first only.
        (NY, "30 1 * * *", utc(2026, 10, 31, 12), utc(2026, 11, 2, 12),
         ["2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"]),
        (LONDON, "30 1 * * *", utc(2026, 10, 24, 12), utc(2026, 10, 26, 12),
         ["2026-10-25T01:30:00+01:00", "2026-10-26T01:30:00+00:00"]),
        (LORD_HOWE, "45 1 * * *", utc(2026, 4, 4), utc(2026, 4, 6),
         ["2026-04-05T01:45:00+11:00", "2026-04-06T01:45:00+10:30"]),
        # Wildcard hours fire in both copies of the repeated hour (Vixie cron's rule)...
        (NY, "30 * * * *", utc(2026, 11, 1, 4, 45), utc(2026, 11, 1, 7, 45),
         ["2026-11-01T01:30:00-04:00", "2026-11-01T01:30:00-05:00",
          "2026-11-01T02:30:00-05:00"]),
        (LORD_HOWE, "*/15 * * * *", utc(2026, 4, 4, 14, 20), utc(2026, 4, 4, 15, 50),
         ["2026-04-05T01:30:00+11:00", "2026-04-05T01:45:00+11:00",
          "2026-04-05T01:30:00+10:30", "2026-04-05T01:45:00+10:30",
          "2026-04-05T02:00:00+10:30", "2026-04-05T02:15:00+10:30"]),
        # ...and every slot in a gap is the one slot at its end.
        (NY, "*/20 * * * *", utc(2026, 3, 8, 6, 30), utc(2026, 3, 8, 7, 30),
         ["2026-03-08T01:40:00-05:00", "2026-03-08T03:00:00-04:00",
          "2026-03-08T03:20:00-04:00"]),
        (LORD_HOWE, "*/10 * * * *", utc(2026, 10, 3, 15, 15), utc(2026, 10, 3, 15, 45),
         ["2026-10-04T01:50:00+10:30", "2026-10-04T02:30:00+11:00",
          "2026-10-04T02:40:00+11:00"]),
    ],
)  # fmt: skip
def test_dst_transitions(
    zone: ZoneInfo, schedule: str, after: datetime, now: datetime, expected: list[str]
) -> None:
    assert local(zone, all_slots(schedule, zone, after, now)) == expected


@pytest.mark.parametrize(
    ("zone", "schedule"),
    [(NY, "30 2 * * *"), (NY, "30 1 * * *"), (LONDON, "30 1 * * *"),
     (LONDON, "30 2 * * *"), (LORD_HOWE, "45 1 * * *"), (LORD_HOWE, "15 2 * * *")],
)  # fmt: skip
def test_a_daily_job_runs_once_every_local_day_of_the_year(zone: ZoneInfo, schedule: str) -> None:
    start, end = datetime(2026, 1, 1, tzinfo=zone), datetime(2027, 1, 1, tzinfo=zone)
    slots = all_slots(schedule, zone, start, end)
    days = [s.astimezone(zone).date() for s in slots]
    assert days == [date(2026, 1, 1) + timedelta(days=n) for n in range(365)]


def test_catch_up_policies_after_downtime() -> None:
    after, now = utc(2026, 5, 1, 10, 0), utc(2026, 5, 1, 10, 5, 30)  # down for 5 minutes
    every_minute = ["10:01", "10:02", "10:03", "10:04", "10:05"]

    def hm(slots: list[datetime]) -> list[str]:
        return [f"{s:%H:%M}" for s in slots]

    assert hm(due_slots("* * * * *", NY, after, now, "all")) == every_minute
    assert hm(due_slots("* * * * *", NY, after, now, "all", limit=2)) == every_minute[-2:]
    assert hm(due_slots("* * * * *", NY, after, now, "latest")) == ["10:05"]
    # none: the newest slot is 30 s late, within the grace: still on time.
    assert hm(due_slots("* * * * *", NY, after, now, "none")) == ["10:05"]
    # none: an hourly slot missed 5 minutes ago is skipped, but last_slot moves past it.
    skipped = plan("5 * * * *", NY, utc(2026, 5, 1, 9), utc(2026, 5, 1, 10, 10), "none")
    assert skipped.slots == []
    assert skipped.last_slot == utc(2026, 5, 1, 10, 5)
    assert plan("0 0 1 1 *", NY, after, now, "all").last_slot is None


def test_a_slot_at_now_is_due() -> None:
    assert due_slots("0 * * * *", LONDON, utc(2026, 6, 1, 9), utc(2026, 6, 1, 10), "all") == [
        utc(2026, 6, 1, 10)
    ]


def test_next_slot_across_a_gap() -> None:
    assert next_slot("30 2 * * *", NY, utc(2026, 3, 7, 12)) == utc(2026, 3, 8, 7)
    assert next_slot("30 2 * * *", NY, utc(2026, 3, 8, 7)) == utc(2026, 3, 9, 6, 30)


def test_bad_schedules_and_zones_are_schedule_errors() -> None:
    with pytest.raises(ScheduleError, match="time zone"):
        check("* * * * *", "Mars/Olympus_Mons")
    with pytest.raises(ScheduleError, match="schedule"):
        check("61 * * * *", "UTC")
    assert check("@daily", "Europe/London") == LONDON


def test_slot_keys_name_the_slot_in_utc() -> None:
    slot = datetime(2026, 3, 8, 3, 0, tzinfo=NY)
    assert slot_key("nightly", slot) == "cron:nightly:2026-03-08T07:00:00Z"


instants = st.datetimes(
    min_value=datetime(2024, 1, 1), max_value=datetime(2027, 12, 31), timezones=st.just(UTC)
)
spans = st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=3))


@settings(max_examples=150, deadline=None)
@given(
    zone=st.sampled_from(ZONES), schedule=st.sampled_from(SCHEDULES), after=instants,
    span=spans, catch_up=st.sampled_from(["none", "latest", "all"]),
    limit=st.integers(min_value=1, max_value=50),
)  # fmt: skip
def test_due_slots_are_increasing_within_the_window_and_capped(
    *,
    zone: ZoneInfo, schedule: str, after: datetime, span: timedelta, catch_up: str,
    limit: int,
) -> None:  # fmt: skip
    now = after + span
    due = plan(schedule, zone, after, now, catch_up, limit=limit)  # type: ignore[arg-type]
    assert all(a < b for a, b in zip(due.slots, due.slots[1:], strict=False))
    assert all(after < s <= now for s in due.slots)
    assert len(due.slots) <= (limit if catch_up == "all" else 1)
    if due.slots:
        assert due.last_slot == due.slots[-1]
    if due.last_slot is not None:
        assert after < due.last_slot <= now
    everything = all_slots(schedule, zone, after, now)
    assert due.last_slot == (everything[-1] if everything else None)
    if catch_up == "all":
        assert due.slots == everything[-limit:]


@settings(max_examples=100, deadline=None)
@given(
    zone=st.sampled_from(ZONES), schedule=st.sampled_from(SCHEDULES), after=instants,
    first=spans, second=spans,
)  # fmt: skip
def test_ticking_in_steps_fires_the_same_slots_as_one_long_tick(
    zone: ZoneInfo, schedule: str, after: datetime, first: timedelta, second: timedelta
) -> None:
    mid, now = after + first, after + first + second
    stepped = all_slots(schedule, zone, after, mid) + all_slots(schedule, zone, mid, now)
    assert stepped == all_slots(schedule, zone, after, now)
    following = next_slot(schedule, zone, after)
    assert following is not None
    window = all_slots(schedule, zone, after, following)
    assert window == [following]


@settings(max_examples=100, deadline=None)
@given(
    zone=st.sampled_from([NY, LONDON, LORD_HOWE]), schedule=st.sampled_from(FIXED_HOUR),
    year=st.integers(min_value=2024, max_value=2027),
    which=st.sampled_from(["spring", "autumn"]),
)  # fmt: skip
def test_no_wall_time_fires_twice_across_a_transition(
    zone: ZoneInfo, schedule: str, year: int, which: str
) -> None:
    # A window of a week around each of the zone's transitions of that year.
    transitions = _transitions(zone, year)
    start = transitions[0 if which == "spring" else 1] - timedelta(days=3)
    slots = all_slots(schedule, zone, start, start + timedelta(days=7))
    walls = [s.astimezone(zone).replace(tzinfo=None) for s in slots]
    assert len(walls) == len(set(walls))


def _transitions(zone: ZoneInfo, year: int) -> list[datetime]:
    found: list[datetime] = []
    t = utc(year, 1, 1)
    offset = t.astimezone(zone).utcoffset()
    while t.year == year:
        t += timedelta(minutes=30)
        if t.astimezone(zone).utcoffset() != offset:
            offset = t.astimezone(zone).utcoffset()
            found.append(t)
    assert len(found) == 2
    return found


@given(
    zone=st.sampled_from(ZONES), schedule=st.sampled_from(SCHEDULES), after=instants,
    steps=st.lists(st.integers(min_value=-3 * 86400, max_value=2 * 86400), max_size=8),
)  # fmt: skip
def test_a_remembered_next_slot_is_always_the_next_slot(
    zone: ZoneInfo, schedule: str, after: datetime, steps: list[int]
) -> None:
    """Reads at times moving forward past slots, and back before the remembered one."""
    at = after
    for step in [0, *steps]:
        at += timedelta(seconds=step)
        assert next_slot_remembered(schedule, zone, at) == next_slot(schedule, zone, at)
