"""Cron slot arithmetic: which instants a schedule fires at in its time zone, and which
of them are due after a given point. Pure: no clock, no database.

A schedule is matched against local wall-clock time (croniter on naive datetimes, so pure
calendar arithmetic), and each matching wall time is then placed on the UTC time line:

- a wall time that exists once fires at that instant;
- a wall time skipped by a spring-forward gap fires once, at the first valid instant after
  the gap (the transition itself: a daily 02:30 in New York fires at 03:00 EDT that day);
- a wall time repeated by a fall-back overlap fires once, at its first occurrence, unless
  the schedule's minute or hour field is a wildcard (`*`, `*/15`): those fire at both
  occurrences, as they fire every hour anyway. This is Vixie cron's rule.

Several wall times can land on one instant (every slot in a gap lands on its end, and so
does the first slot after it); they are one slot.

croniter's own time-zone support is not used: with zoneinfo it moves a gap's slot to the
gap's end too, but it fires a daily 01:30 twice on a fall-back night.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

CatchUp = Literal["none", "latest", "all"]

# More than any change of a zone's UTC offset (1 h usually, 30 min on Lord Howe Island,
# 2 h at most in tzdata's history): walls further than this from a point map to instants
# on the same side of it.
MAX_SHIFT = timedelta(hours=3)
# With catch_up = "none" a slot still fires this long after it was due: a tick, a leader
# failover or a short database outage later. Older slots were missed by downtime.
NONE_GRACE = timedelta(seconds=60)
DEFAULT_CATCH_UP_LIMIT = 100


class ScheduleError(ValueError):
    """A schedule or time zone that cannot be used (only 'api' rows can have one: the
    config file's entries are checked when it is loaded)."""


def zone_of(timezone: str) -> ZoneInfo:
    try:
        return ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(f"unknown time zone {timezone!r}") from None


@lru_cache(maxsize=1024)
def check(schedule: str, timezone: str) -> ZoneInfo:
    """The zone, after checking that the schedule parses and fires; else ScheduleError.
    Remembered (a failure is not): `cron list` and the console's cron page check every
    schedule on every read, and parsing is most of their time."""
    zone = zone_of(timezone)
    try:
        croniter(schedule, datetime(2000, 1, 1)).get_next(datetime)
    except (CroniterError, ValueError, KeyError, TypeError) as error:
        raise ScheduleError(f"invalid cron schedule {schedule!r}: {error}") from None
    return zone


def repeats_in_overlap(schedule: str) -> bool:
    """Does a wall time repeated by a fall-back overlap fire twice? Only when the minute
    or hour field is a wildcard."""
    fields = schedule.split()
    if len(fields) == 1:
        return fields[0] == "@hourly"
    return len(fields) >= 2 and (fields[0].startswith("*") or fields[1].startswith("*"))


def wall_instants(wall: datetime, zone: ZoneInfo, *, repeat: bool) -> list[datetime]:
    """The UTC instants at which the naive local wall time `wall` fires, earliest first."""
    first = wall.replace(tzinfo=zone, fold=0)  # PEP 495: the offset before a transition
    second = wall.replace(tzinfo=zone, fold=1)  # and after it
    before, after = first.utcoffset(), second.utcoffset()
    assert before is not None and after is not None
    if before == after:
        return [first.astimezone(UTC)]
    if before > after:  # fall-back overlap: the wall time happens twice
        both = [first.astimezone(UTC), second.astimezone(UTC)]
        return both if repeat else both[:1]
    # Spring-forward gap: the wall time never happens; fire when the gap ends.
    return [_transition(second.astimezone(UTC), first.astimezone(UTC), zone)]


def _transition(lo: datetime, hi: datetime, zone: ZoneInfo) -> datetime:
    """The instant in (lo, hi] at which the zone's offset changes (to the second)."""
    old = lo.astimezone(zone).utcoffset()
    while hi - lo > timedelta(seconds=1):
        mid = lo + (hi - lo) / 2
        mid = mid.replace(microsecond=0)
        if mid <= lo:
            break
        if mid.astimezone(zone).utcoffset() == old:
            lo = mid
        else:
            hi = mid
    return hi


def _wall(instant: datetime, zone: ZoneInfo) -> datetime:
    return instant.astimezone(zone).replace(tzinfo=None)


def _margin(instant: datetime, zone: ZoneInfo) -> timedelta:
    """How far walls must be looked at beyond `instant`'s own wall time: MAX_SHIFT near
    an offset change, nothing where the offset is steady."""
    steady = (instant - MAX_SHIFT).astimezone(zone).utcoffset() == (instant + MAX_SHIFT).astimezone(
        zone
    ).utcoffset()
    return timedelta(0) if steady else MAX_SHIFT


def _walls(schedule: str, start: datetime, *, backwards: bool) -> Iterator[datetime]:
    it = croniter(schedule, start)
    while True:
        try:
            yield it.get_prev(datetime) if backwards else it.get_next(datetime)
        except CroniterError:  # no earlier / later match within croniter's range
            return


def slots_back(
    schedule: str, zone: ZoneInfo, after: datetime, now: datetime, count: int
) -> list[datetime]:
    """The newest `count` slots in (after, now], newest first (UTC)."""
    if count < 1 or now <= after:
        return []
    repeat = repeats_in_overlap(schedule)
    start = _wall(now, zone) + _margin(now, zone) + timedelta(minutes=1)
    stop = _wall(after, zone) - _margin(after, zone)
    found: set[datetime] = set()
    for wall in _walls(schedule, start, backwards=True):
        if wall < stop:
            break
        for instant in wall_instants(wall, zone, repeat=repeat):
            if after < instant <= now:
                found.add(instant)
        if len(found) >= count:
            kth = sorted(found, reverse=True)[count - 1]
            if wall < _wall(kth, zone) - _margin(kth, zone):
                break
    return sorted(found, reverse=True)[:count]


def next_slot(schedule: str, zone: ZoneInfo, after: datetime) -> datetime | None:
    """The first slot strictly after `after` (UTC), or None if it never fires again."""
    start = _wall(after, zone) - _margin(after, zone) - timedelta(minutes=1)
    best: datetime | None = None
    for wall in _walls(schedule, start, backwards=False):
        if best is not None and wall > _wall(best, zone) + _margin(best, zone):
            break
        for instant in wall_instants(wall, zone, repeat=repeats_in_overlap(schedule)):
            if instant > after and (best is None or instant < best):
                best = instant
    return best


_NEXT: dict[tuple[str, str], tuple[datetime, datetime]] = {}
_NEXT_SIZE = 4096


def next_slot_remembered(schedule: str, zone: ZoneInfo, after: datetime) -> datetime | None:
    """next_slot, remembered per schedule and zone: a slot found after t is also the
    first one after any later time before it, so `cron list` and the console's cron
    page (every refresh) parse and walk a schedule once per slot, not once per read."""
    key = (schedule, str(zone))
    known = _NEXT.get(key)
    if known is not None and known[0] <= after < known[1]:
        return known[1]
    found = next_slot(schedule, zone, after)
    if found is not None:
        if len(_NEXT) >= _NEXT_SIZE:
            _NEXT.clear()
        _NEXT[key] = (after, found)
    return found


@dataclass(frozen=True)
class Due:
    """What one schedule owes at `now`: the slots to enqueue (oldest first), and the new
    last_slot (the newest slot in (after, now], fired or skipped; None: nothing due)."""

    slots: list[datetime]
    last_slot: datetime | None


def plan(
    schedule: str,
    zone: ZoneInfo,
    after: datetime,
    now: datetime,
    catch_up: CatchUp,
    *,
    limit: int = DEFAULT_CATCH_UP_LIMIT,
    grace: timedelta = NONE_GRACE,
) -> Due:
    """The slots in (after, now] to enqueue under the catch-up policy:

    - "none": the newest slot, only if it is at most `grace` old (missed ones skipped);
    - "latest": the newest slot;
    - "all": every slot, at most `limit` of them (the newest).

    In every case last_slot moves to the newest slot, so skipped slots stay skipped.
    """
    newest_first = slots_back(schedule, zone, after, now, limit if catch_up == "all" else 1)
    if not newest_first:
        return Due([], None)
    newest = newest_first[0]
    if catch_up == "none":
        return Due([newest] if now - newest <= grace else [], newest)
    if catch_up == "latest":
        return Due([newest], newest)
    return Due(newest_first[::-1], newest)


def due_slots(
    schedule: str,
    tz: ZoneInfo,
    last_slot: datetime,
    now: datetime,
    catch_up: CatchUp,
    *,
    limit: int = DEFAULT_CATCH_UP_LIMIT,
) -> list[datetime]:
    """The slots to enqueue, oldest first: `plan(...).slots`."""
    return plan(schedule, tz, last_slot, now, catch_up, limit=limit).slots


def slot_key(name: str, slot: datetime) -> str:
    """The unique key of one (schedule, slot) job."""
    return f"cron:{name}:{slot.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"
