"""Fleet-wide flow control on a real PostgreSQL, raced: several sessions claim through
the limited claim (job_claim_flow) at once, as many members would, and finish what they
claimed through the real completion and failure statements. A ledger of every run proves
the limits: global concurrency never exceeded at any instant, no more than N starts in
any window, group members never overlapping and never out of order.

Ledger times are the database's: a run starts at its attempted_at (the claim's clock,
read under the limit's lock, after it counted the running jobs) and ends at a
clock_timestamp() read in the finishing transaction before it commits, so every run a
claim counted as ended had ended before that claim's start. A separate sampler reads the
committed count of running jobs over and over while the claimers race.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial

import anyio
import asyncpg
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd import Client, JobSpec, QueueFull, admin
from pgjobd.config import QueueConfig
from pgjobd.errors import EnqueueError
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.member.generations import write_queue_limits
from pgjobd.queries import Queries, for_schema
from pgjobd.statements.member import KindDeclared
from tests.captured_events import records_of

pytestmark = pytest.mark.anyio
LEASE = timedelta(seconds=30)


@dataclass
class Run:
    id: int
    kind: str
    queue: str
    group: str | None
    priority: int
    attempt: int
    start: datetime
    end: datetime


@dataclass
class Fleet:
    """Racing claimers, each on its own session, as members would be."""

    dsn: str
    schema: str
    q: Queries
    runs: list[Run] = field(default_factory=list)
    running_seen: list[int] = field(default_factory=list)
    throttled: int = 0

    async def claim_and_finish(
        self,
        queue: str,
        member: str,
        done: Callable[[], Awaitable[bool]],
        fail_first: set[int] | None = None,
        batch: int = 4,
        hold_s: float = 0.003,
    ) -> None:
        conn = await asyncpg.connect(self.dsn)
        rng = random.Random(member)
        try:
            while not await done():
                rows = await conn.fetch(
                    self.q.sql("job_claim_flow"), queue, rng.randint(1, batch), member, LEASE, []
                )
                self.throttled += sum(1 for row in rows if row["id"] is None)
                jobs = [row for row in rows if row["id"] is not None]
                if not jobs:
                    await anyio.sleep(0.002)
                    continue
                await anyio.sleep(rng.random() * hold_s)
                for job in jobs:
                    await self._finish(conn, job, member, fail_first)
        finally:
            await conn.close()

    async def _finish(
        self, conn: asyncpg.Connection, job: asyncpg.Record, member: str, fail: set[int] | None
    ) -> None:
        async with conn.transaction():
            row = await conn.fetchrow(
                f"SELECT attempted_at, group_key, clock_timestamp() AS ended "
                f"FROM {self.schema}.job WHERE id = $1",
                job["id"],
            )
            if fail is not None and job["id"] in fail:
                fail.discard(job["id"])
                recorded = await conn.fetch(
                    self.q.sql("job_fail_many"), [job["id"]], [job["fence"]], ["failed"], [100],
                    [timedelta(0)], ["E"], ["boom"], [None], [0.0], [True], [None], member,
                )  # fmt: skip
            else:
                recorded = await conn.fetch(
                    self.q.sql("job_complete_many"), [job["id"]], [job["fence"]], [None], [True]
                )
            assert recorded, f"job {job['id']} lost its lease"
        self.runs.append(
            Run(job["id"], job["kind"], job["queue"], row["group_key"], job["priority"],
                job["attempt"], row["attempted_at"], row["ended"])
        )  # fmt: skip

    async def claim_ending_first(
        self,
        queue: str,
        member: str,
        done: Callable[[], Awaitable[bool]],
        batch: int = 4,
        loop: int | None = None,
        allocating: bool = False,
    ) -> None:
        """As a member claims: a handler's end is noted at once (on the database's clock)
        and its fence passed to the next claims as ended; its record is written later,
        several ends at a time. With a `loop` (the member's claim loop): through
        flow_reserve and job_claim_reserved every other claim (so that both paths race),
        else job_claim_flow. Allocating: within the member's allocation (flow_allocate
        every few claims, job_claim_allocated), as members claim such a queue."""
        conn = await asyncpg.connect(self.dsn)
        rng = random.Random(member)
        ended: dict[int, tuple[asyncpg.Record, datetime, datetime]] = {}  # by fence
        turn = 0
        try:
            while ended or not await done():
                wanted = rng.randint(1, batch)
                turn += 1
                if allocating:
                    if turn % 3 == 1:
                        allocation = await conn.fetchrow(
                            self.q.sql("flow_allocate"), queue, member, list(ended), wanted
                        )
                        assert allocation["ceiling"] is not None, "the queue is reservable"
                    rows = await conn.fetch(
                        self.q.sql("job_claim_allocated"), queue, wanted, member, LEASE,
                        list(ended), None, None, None,
                    )  # fmt: skip
                    self.throttled += sum(1 for row in rows if row["id"] is None)
                    jobs = [row for row in rows if row["id"] is not None]
                    assert len(jobs) <= wanted
                elif loop is not None and turn % 2:
                    places = await conn.fetchval(
                        self.q.sql("flow_reserve"), queue, wanted, member, list(ended), loop
                    )
                    assert places is not None, "the queue is reservable"
                    self.throttled += places < wanted
                    jobs = await conn.fetch(
                        self.q.sql("job_claim_reserved"), queue, member, LEASE, loop, places
                    )
                    assert len(jobs) <= places
                else:
                    rows = await conn.fetch(
                        self.q.sql("job_claim_flow"), queue, wanted, member, LEASE, list(ended)
                    )
                    self.throttled += sum(1 for row in rows if row["id"] is None)
                    jobs = [row for row in rows if row["id"] is not None]
                await anyio.sleep(rng.random() * 0.003)
                for job in jobs:
                    times = await conn.fetchrow(
                        f"SELECT attempted_at, clock_timestamp() AS ended "
                        f"FROM {self.schema}.job WHERE id = $1",
                        job["id"],
                    )
                    ended[job["fence"]] = (job, times["attempted_at"], times["ended"])
                if ended and (not jobs or rng.random() < 0.3):
                    recorded = await conn.fetch(
                        self.q.sql("job_complete_many"),
                        [job["id"] for job, _, _ in ended.values()], list(ended),
                        [None] * len(ended), [True] * len(ended),
                    )  # fmt: skip
                    assert len(recorded) == len(ended), "a job lost its lease"
                    self.runs += [
                        Run(job["id"], job["kind"], job["queue"], None, job["priority"],
                            job["attempt"], start, end)
                        for job, start, end in ended.values()
                    ]  # fmt: skip
                    ended.clear()
                elif not jobs:
                    await anyio.sleep(0.002)
        finally:
            await conn.close()

    async def sample_running(self, queue: str, done: Callable[[], Awaitable[bool]]) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            while not await done():
                self.running_seen.append(
                    await conn.fetchval(
                        f"SELECT count(*) FROM {self.schema}.job "
                        "WHERE state = 'running' AND queue = $1",
                        queue,
                    )
                )
        finally:
            await conn.close()


def most_at_once(runs: list[Run]) -> int:
    """The most runs that overlap at any instant (an end at t frees before a start at t)."""
    events = sorted([(r.start, 1) for r in runs] + [(r.end, -1) for r in runs],
                    key=lambda e: (e[0], e[1]))  # fmt: skip
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


@pytest.fixture
def fleet(dsn: str, schema: str) -> Fleet:
    return Fleet(dsn, schema, for_schema(schema))


def _none_left(conn: asyncpg.Connection, schema: str) -> Callable[[], Awaitable[bool]]:
    lock = anyio.Lock()

    async def done() -> bool:
        async with lock:  # one shared connection
            return not await conn.fetchval(f"SELECT count(*) FROM {schema}.job")

    return done


async def _set_limits(conn: asyncpg.Connection, schema: str, **queues: QueueConfig) -> None:
    await write_queue_limits(conn, for_schema(schema), queues, "test-member")


async def _enqueue(conn: asyncpg.Connection, q: Queries, kind: str, queue: str,
                   group: str | None = None, priority: int | None = None) -> int:  # fmt: skip
    return await q.job_enqueue(
        conn, kind, "{}", queue, priority, None, None, None, None, None, "return", group
    )


RACES = [
    ("queue", "at_once"),
    ("queue", "ends_first"),
    ("kind", "ends_first"),
    ("queue", "reserving"),
    ("queue", "allocating"),
]


@pytest.mark.parametrize(("limit", "how"), RACES)
async def test_global_concurrency_is_never_exceeded_by_racing_claimers(
    conn: asyncpg.Connection, schema: str, fleet: Fleet, limit: str, how: str
) -> None:
    """ends_first: the claimers pass the fences of their jobs whose handlers ended and
    whose ends are not recorded yet (migration 0021), as members do: claims take those
    places at once. reserving: as well, every other claim reserves its places under the
    lock and claims them without it (flow_reserve, job_claim_reserved), racing the
    claims that hold the lock throughout. The jobs running at any instant, by the ledger
    of handler starts and ends, never pass N."""
    ends_first = how != "at_once"
    if limit == "queue":
        await _set_limits(conn, schema, limited=QueueConfig(global_concurrency=3))
    else:
        await conn.execute(f"INSERT INTO {schema}.kind (name, queue, global_concurrency) "
                           "VALUES ('work', 'limited', 3)")  # fmt: skip
    for _ in range(80):
        await _enqueue(conn, fleet.q, "work", "limited")
    done = _none_left(conn, schema)
    async with anyio.create_task_group() as tg:
        for n in range(5):
            member = f"member-{n // 2}" if how in ("reserving", "allocating") else f"member-{n}"
            if how == "reserving":  # two claim loops per member
                tg.start_soon(fleet.claim_ending_first, "limited", member, done, 4, n % 2)
            elif how == "allocating":  # two claim loops per member, and one that reserves
                if n == 4:
                    tg.start_soon(fleet.claim_ending_first, "limited", "old", done, 4, 0)
                else:
                    tg.start_soon(
                        partial(fleet.claim_ending_first, allocating=True),
                        "limited",
                        member,
                        done,
                        4,
                    )
            elif ends_first:
                tg.start_soon(fleet.claim_ending_first, "limited", member, done)
            else:
                tg.start_soon(fleet.claim_and_finish, "limited", member, done)
        tg.start_soon(fleet.sample_running, "limited", done)
    assert len(fleet.runs) == 80
    assert most_at_once(fleet.runs) == 3  # reached, never passed
    if ends_first:  # running rows include ended ones not yet recorded
        assert max(fleet.running_seen) > 3
    else:
        assert max(fleet.running_seen) <= 3
    assert fleet.throttled > 0


async def test_an_allocated_claim_that_waited_for_its_allocation_starts_its_jobs_after_the_wait(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    """A claim within an allocation first takes the lock of the member's allocation row,
    which the member's other loop or its renewal may hold; it decides after that wait,
    so its jobs start then. Their attempted_at was the claim transaction's start, before
    the wait (migration 0029): a place another member's job left during the wait was
    told as taken before that job ended (CI's race test once saw the width passed)."""
    await _set_limits(conn, schema, limited=QueueConfig(global_concurrency=3))
    for _ in range(2):
        await _enqueue(conn, fleet.q, "work", "limited")
    allocation = await conn.fetchrow(fleet.q.sql("flow_allocate"), "limited", "m", [], 2)
    assert allocation["ceiling"] == 2
    holder = await asyncpg.connect(fleet.dsn)
    claimer = await asyncpg.connect(fleet.dsn)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute(
            f"SELECT FROM {schema}.flow_reservation "
            "WHERE queue = 'limited' AND claimer = 'm' AND loop = -1 FOR NO KEY UPDATE"
        )
        claimed: list[asyncpg.Record] = []

        async def claim() -> None:
            claimed.extend(await claimer.fetch(
                fleet.q.sql("job_claim_allocated"), "limited", 2, "m", LEASE, [],
                None, None, None,
            ))  # fmt: skip

        async with anyio.create_task_group() as tg:
            tg.start_soon(claim)
            with anyio.fail_after(10):
                while not await conn.fetchval(  # noqa: ASYNC110 (polling the database)
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
                    claimer.get_server_pid(),
                ):
                    await anyio.sleep(0.01)
            released_at = await holder.fetchval("SELECT clock_timestamp()")
            await held.commit()
    finally:
        await holder.close()
        await claimer.close()

    ids = [row["id"] for row in claimed if row["id"] is not None]
    assert len(ids) == 2
    started = await conn.fetch(
        f"SELECT attempted_at, lease_expires_at - attempted_at AS lease FROM {schema}.job "
        "WHERE id = ANY($1)",
        ids,
    )
    assert all(row["attempted_at"] > released_at for row in started)
    assert all(row["lease"] == LEASE for row in started)


async def test_a_reservation_never_claimed_holds_its_places_until_it_expires(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    """A member that reserved and died before claiming: its places count for 5 s; the
    next count deletes the expired reservation, and a late claim on it takes nothing."""
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=3))
    for _ in range(6):
        await _enqueue(conn, fleet.q, "work", "q")
    reserve, claim = fleet.q.sql("flow_reserve"), fleet.q.sql("job_claim_reserved")
    assert await conn.fetchval(reserve, "q", 2, "dying", [], 0) == 2
    assert await conn.fetchval(reserve, "q", 5, "live", [], 0) == 1
    assert len(await conn.fetch(claim, "q", "live", LEASE, 0, 1)) == 1
    assert await conn.fetchval(reserve, "q", 5, "live", [], 0) == 0  # dying's 2 still count
    # The full claim counts the reservation too.
    rows = await conn.fetch(fleet.q.sql("job_claim_flow"), "q", 5, "other", LEASE, [])
    assert [row["held_by"] for row in rows] == ["global_concurrency"]
    await conn.execute(
        f"UPDATE {schema}.flow_reservation SET expires_at = clock_timestamp() - interval '1 s'"
    )
    assert await conn.fetchval(reserve, "q", 5, "live", [], 0) == 2
    assert await conn.fetch(claim, "q", "dying", LEASE, 0, 2) == []  # deleted as expired
    assert len(await conn.fetch(claim, "q", "live", LEASE, 0, 2)) == 2
    assert await conn.fetchval(
        f"SELECT count(*) FROM {schema}.job WHERE state = 'running'"
    ) == 3  # fmt: skip
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.flow_reservation") == 0


@pytest.mark.parametrize("other_limit", ["rate_limit", "group", "kind_limit", "paused"])
async def test_only_a_queue_limited_by_its_global_concurrency_alone_reserves(
    conn: asyncpg.Connection, schema: str, fleet: Fleet, other_limit: str
) -> None:
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=3))
    await _enqueue(conn, fleet.q, "work", "q")
    assert await conn.fetchval(fleet.q.sql("queue_claim_path_get"), "q") == "allocated"
    reserve, claim = fleet.q.sql("flow_reserve"), fleet.q.sql("job_claim_reserved")
    assert await conn.fetchval(reserve, "q", 1, "m", [], 0) == 1
    if other_limit == "rate_limit":
        await _set_limits(conn, schema, q=QueueConfig(global_concurrency=3, rate_limit="5/1s"))
    elif other_limit == "group":
        await _enqueue(conn, fleet.q, "work", "q", group="g")
    elif other_limit == "kind_limit":
        await conn.execute(f"INSERT INTO {schema}.kind (name, queue, global_concurrency) "
                           "VALUES ('other', 'x', 1)")  # fmt: skip
    else:
        await conn.execute(f"UPDATE {schema}.queue SET paused = true WHERE name = 'q'")
    assert await conn.fetchval(fleet.q.sql("queue_claim_path_get"), "q") != "allocated"
    # A reservation made before takes nothing once the queue needs the whole claim.
    assert await conn.fetch(claim, "q", "m", LEASE, 0, 1) == []
    assert await conn.fetchval(reserve, "q", 1, "m", [], 0) is None


INT64 = st.integers(-(2**63), 2**63 - 1)
EDGE_WANTED = st.sampled_from([-(2**31), -1, 0, 1, 2, 3, 2**31 - 1])
EDGE_FENCES = st.none() | st.lists(
    st.sampled_from([-(2**63), -1, 0, 1, 2**63 - 1]) | INT64, max_size=30
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(wanted=EDGE_WANTED, ended=EDGE_FENCES, use_own=st.booleans(), reserve=st.booleans())
async def test_the_claims_arguments_at_their_edges_never_pass_the_limit(
    conn: asyncpg.Connection, schema: str, fleet: Fleet, wanted: int, ended: list[int] | None,
    use_own: bool, reserve: bool,
) -> None:  # fmt: skip
    """`wanted` and `ended` (migration 0021) at their edges: negative, zero and huge
    counts, NULL, empty, negative, int64-extreme and duplicate fences, others' and the
    claimer's own. A claim never errs, never takes less than nothing, and, whatever it
    is told has ended, running jobs that are not the claimer's own ended ones stay
    within the limit."""
    await conn.execute(f"TRUNCATE {schema}.job, {schema}.flow_reservation")
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=2))
    for _ in range(5):
        await _enqueue(conn, fleet.q, "work", "q")
    first = await conn.fetch(fleet.q.sql("job_claim_flow"), "q", 1, "m", LEASE, [])
    own = [r["fence"] for r in first if r["id"] is not None]
    fences = None if ended is None else ended + (own if use_own else [])
    if reserve:
        places = await conn.fetchval(fleet.q.sql("flow_reserve"), "q", wanted, "m", fences, 0)
        assert places is not None and 0 <= places <= max(wanted, 0)
        taken = await conn.fetch(fleet.q.sql("job_claim_reserved"), "q", "m", LEASE, 0, places)
        assert len(taken) == places
    else:
        rows = await conn.fetch(fleet.q.sql("job_claim_flow"), "q", wanted, "m", LEASE, fences)
        taken = [r for r in rows if r["id"] is not None]
        assert len(taken) <= max(wanted, 0)
    # The only running job the claim may leave out is the claimer's own first one,
    # and only when it was told that one had ended.
    running = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE state = 'running'")
    assert running <= 2 + (1 if use_own and fences is not None else 0)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(places=st.none() | st.sampled_from([-(2**63), -(2**31), -1, 0, 1, 2, 3, 2**31 - 1,
                                             2**63 - 1]) | INT64)  # fmt: skip
async def test_a_reserved_claim_takes_no_more_than_its_reservation_whatever_it_is_told(
    conn: asyncpg.Connection, schema: str, fleet: Fleet, places: int | None
) -> None:
    """job_claim_reserved's `places` (what flow_reserve granted, dec453d) at its edges:
    NULL, zero, negative, more than the reservation holds, out of int32 and int64. It
    takes exactly that many when the reservation holds them, nothing otherwise, and a
    value PostgreSQL or the driver refuses is an error that writes nothing (the
    reservation stays, to expire)."""
    await conn.execute(f"TRUNCATE {schema}.job, {schema}.flow_reservation")
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=2))
    for _ in range(5):
        await _enqueue(conn, fleet.q, "work", "q")
    assert await conn.fetchval(fleet.q.sql("flow_reserve"), "q", 5, "m", [], 0) == 2
    claim = fleet.q.sql("job_claim_reserved")
    try:
        taken = await conn.fetch(claim, "q", "m", LEASE, 0, places)
    except (asyncpg.DataError, OverflowError, asyncpg.InvalidRowCountInLimitClauseError):
        assert places is not None and (places < 0 or places >= 2**31)
        assert await conn.fetchval(f"SELECT sum(places) FROM {schema}.flow_reservation") == 2
        taken = []
    else:
        assert places is None or 0 <= places < 2**31
        assert len(taken) == (places if places is not None and places <= 2 else 0)
        assert await conn.fetchval(f"SELECT count(*) FROM {schema}.flow_reservation") == 0
    running = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE state = 'running'")
    assert running == len(taken) <= 2


async def test_only_the_claimers_own_ended_jobs_are_left_out(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=2))
    for _ in range(4):
        await _enqueue(conn, fleet.q, "work", "q")
    claim = fleet.q.sql("job_claim_flow")
    first = [r for r in await conn.fetch(claim, "q", 2, "a", LEASE, []) if r["id"] is not None]
    fences = [r["fence"] for r in first]
    assert len(fences) == 2
    # Another member cannot make room with a's jobs; NULL is nothing ended.
    assert [r["held_by"] for r in await conn.fetch(claim, "q", 1, "b", LEASE, fences)] == [
        "global_concurrency"
    ]
    assert [r["held_by"] for r in await conn.fetch(claim, "q", 1, "a", LEASE, None)] == [
        "global_concurrency"
    ]
    # a's own: one ended, one place.
    rows = await conn.fetch(claim, "q", 2, "a", LEASE, fences[:1])
    assert [r["held_by"] for r in rows if r["id"] is None] == ["global_concurrency"]
    assert len([r for r in rows if r["id"] is not None]) == 1


async def test_the_unlimited_claim_takes_nothing_from_a_limited_queue(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    """A member that has not yet noticed a limit claims nothing rather than too much."""
    await _enqueue(conn, fleet.q, "work", "q")
    assert not await conn.fetchval(fleet.q.sql("queue_flow_get"), "q")
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=5))
    assert await conn.fetchval(fleet.q.sql("queue_flow_get"), "q")
    assert await fleet.q.job_claim(conn, "q", 10, "m", LEASE) == []
    claimed = await conn.fetch(fleet.q.sql("job_claim_flow"), "q", 10, "m", LEASE, [])
    assert len(claimed) == 1
    # A kind with a limit puts every queue on the limited path.
    await _enqueue(conn, fleet.q, "work", "free")
    await conn.execute(
        f"INSERT INTO {schema}.kind (name, queue, global_concurrency) VALUES ('capped', 'x', 1)"
    )
    assert await fleet.q.job_claim(conn, "free", 10, "m", LEASE) == []
    assert await conn.fetchval(fleet.q.sql("queue_flow_get"), "free")


async def test_a_crashed_members_jobs_count_until_the_reaper_ends_their_lease(
    dsn: str, conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=2))
    for _ in range(4):
        await _enqueue(conn, fleet.q, "work", "q")
    rows = await conn.fetch(fleet.q.sql("job_claim_flow"), "q", 4, "dead-member", LEASE, [])
    assert [row["held_by"] for row in rows] == [None, None, "global_concurrency"]
    # The member is gone (no completion will come) and its leases have expired, but
    # until the reaper ends them its jobs still count.
    await conn.execute(
        f"UPDATE {schema}.job SET lease_expires_at = now() - interval '1s' WHERE state = 'running'"
    )
    rows = await conn.fetch(fleet.q.sql("job_claim_flow"), "q", 4, "live-member", LEASE, [])
    assert [row["held_by"] for row in rows] == ["global_concurrency"]
    leader = await asyncpg.connect(dsn)
    try:
        assert await leader.fetchval(
            "SELECT pg_try_advisory_lock($1, $2)", *lock_key(LEADER, schema)
        )
        term = await leader.fetchval(fleet.q.sql("leader_term_begin"), "test")
        reaped = await conn.fetchrow(
            fleet.q.sql("job_reap_expired"), term, timedelta(0), 10, [], [], 100, None
        )
    finally:
        await leader.close()
    assert reaped["rescued"] == 2
    rows = await conn.fetch(fleet.q.sql("job_claim_flow"), "q", 4, "live-member", LEASE, [])
    assert len([row for row in rows if row["id"] is not None]) == 2


async def test_a_rate_limit_holds_in_every_sliding_window(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    window = timedelta(milliseconds=200)
    await _set_limits(conn, schema, rated=QueueConfig(rate_limit="4/200ms"))
    for _ in range(24):
        await _enqueue(conn, fleet.q, "work", "rated")
    done = _none_left(conn, schema)
    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(fleet.claim_and_finish, "rated", f"member-{n}", done)
    starts = sorted(run.start for run in fleet.runs)
    assert len(starts) == 24
    # Any window of 200 ms holds at most 4 starts: the 5th start after any start is at
    # least 200 ms later. (A bucket of 4 refilled at 4 per window would allow 8.)
    gaps = [starts[i + 4] - starts[i] for i in range(len(starts) - 4)]
    assert min(gaps) >= window, min(gaps)
    # The limit was the bottleneck: 24 starts at 4 per window take at least 5 windows.
    assert starts[-1] - starts[0] >= 5 * window
    assert fleet.throttled > 0


async def test_a_kinds_limits_hold_across_queues(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    q = fleet.q
    await q.kind_declare_many(
        conn,
        [KindDeclared("capped", "a", 0, 20, 60.0, 2, None, None, "[]"),
         KindDeclared("free", "a", 0, 20, 60.0, None, None, None, "[]")],
        "test-member",
    )  # fmt: skip
    for n in range(30):
        await _enqueue(conn, q, "capped", "a" if n % 2 else "b")
        await _enqueue(conn, q, "free", "a")
    done = _none_left(conn, schema)
    async with anyio.create_task_group() as tg:
        for n in range(3):
            tg.start_soon(fleet.claim_and_finish, "a", f"a-{n}", done)
            tg.start_soon(fleet.claim_and_finish, "b", f"b-{n}", done)
    capped = [run for run in fleet.runs if run.kind == "capped"]
    assert len(capped) == 30 and len(fleet.runs) == 60
    assert most_at_once(capped) == 2
    # The unlimited kind in the same queue was not held to the capped kind's limit.
    assert most_at_once([run for run in fleet.runs if run.kind == "free"]) > 2


async def test_group_members_run_one_at_a_time_in_order_and_a_retrying_head_keeps_its_place(
    dsn: str, conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    q = fleet.q
    rng = random.Random(7)
    expected: dict[str, list[int]] = defaultdict(list)
    order: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for _ in range(90):
        group = f"user:{rng.randint(1, 6)}"
        priority = rng.choice([0, 0, 1])
        job_id = await _enqueue(conn, q, "work", "grouped", group=group, priority=priority)
        order[group].append((priority, job_id))
    for group, jobs in order.items():
        expected[group] = [job_id for _, job_id in sorted(jobs)]
    # The head of each group fails once: it must run again before the rest of its group.
    fail_first = {jobs[0] for jobs in expected.values()}
    failed = set(fail_first)
    done = _none_left(conn, schema)

    async def promote() -> None:
        promoter = await asyncpg.connect(dsn)
        try:
            while not await done():
                await promoter.fetchrow(q.sql("job_promote_due"), 100)
                await anyio.sleep(0.005)
        finally:
            await promoter.close()

    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(fleet.claim_and_finish, "grouped", f"member-{n}", done, fail_first)
        tg.start_soon(promote)
    by_group: dict[str, list[Run]] = defaultdict(list)
    for run in sorted(fleet.runs, key=lambda r: r.start):
        assert run.group is not None
        by_group[run.group].append(run)
    for group, runs in by_group.items():
        assert most_at_once(runs) == 1, group
        ran = [run.id for run in runs]
        # The failed head ran twice in a row, then the others in (priority, id) order.
        assert ran[0] == ran[1] == expected[group][0] and ran[0] in failed
        assert ran[1:] == expected[group], group
    # Groups are independent: several ran at once.
    assert most_at_once(fleet.runs) > 1


async def test_groups_take_turns_so_a_long_group_does_not_hold_up_the_others(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    q = fleet.q
    for _ in range(50):
        await _enqueue(conn, q, "work", "g", group="big")
    late = await _enqueue(conn, q, "work", "g", group="late")
    claimed: list[int] = []
    for _ in range(3):
        rows = await conn.fetch(q.sql("job_claim_flow"), "g", 5, "m", LEASE, [])
        claimed += [row["id"] for row in rows]
        for row in rows:
            await conn.fetch(
                q.sql("job_complete_many"), [row["id"]], [row["fence"]], [None], [True]
            )
    assert late in claimed[:2]


async def test_max_depth_refuses_enqueues_and_writes_nothing(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    await _set_limits(conn, schema, small=QueueConfig(max_depth=5))
    async with await Client.connect(dsn, schema=schema) as client:
        ids = [await client.enqueue("work", queue="small") for _ in range(3)]
        with pytest.raises(QueueFull, match="queue 'small' is full: max_depth is 5"):
            await client.enqueue_many([JobSpec("work", queue="small") for _ in range(3)])
        with pytest.raises(QueueFull):  # the COPY path, too, and through unique keys
            await client.enqueue_many(
                [JobSpec("work", queue="small", unique_key=f"k{n}") for n in range(3)]
            )
        assert issubclass(QueueFull, EnqueueError)
        await client.enqueue_many([("work", {}), ("work", {})], queue="small")
        with pytest.raises(QueueFull):
            await client.enqueue("work", queue="small")
        with pytest.raises(asyncpg.PostgresError) as raised:
            await conn.fetchval(f"SELECT {schema}.enqueue('work', queue => 'small')")
        assert raised.value.sqlstate == "PJ006"
        assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 5
        # Other queues are not limited.
        await client.enqueue("work", queue="elsewhere")
        # Jobs end; the next recount sees room again.
        for job_id in ids:
            await conn.execute(f"DELETE FROM {schema}.job WHERE id = $1", job_id)
        with pytest.raises(QueueFull):
            await client.enqueue("work", queue="small")  # the estimate errs high until ...
        await conn.fetchval(q.sql("queue_depth_recount"), None)  # ... the leader recounts
        await client.enqueue_many([("work", {})] * 3, queue="small")
        assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE queue = 'small'") == 5


async def test_max_depth_under_racing_enqueuers_overshoots_by_fewer_than_the_racers(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """The documented precision: concurrent enqueues into different shards may each
    miss the others' uncommitted ones, so a queue may pass max_depth by fewer jobs than
    there are concurrent enqueuers; never by more."""
    racers, max_depth = 6, 40
    await _set_limits(conn, schema, small=QueueConfig(max_depth=max_depth))
    refused = 0

    async def enqueue_until_full() -> None:
        nonlocal refused
        session = await asyncpg.connect(dsn)
        try:
            while True:
                try:
                    await session.fetchval(f"SELECT {schema}.enqueue('work', queue => 'small')")
                except asyncpg.PostgresError as e:
                    assert e.sqlstate == "PJ006"
                    refused += 1
                    return
        finally:
            await session.close()

    async with anyio.create_task_group() as tg:
        for _ in range(racers):
            tg.start_soon(enqueue_until_full)
    live = await conn.fetchval(f"SELECT count(*) FROM {schema}.job")
    assert refused == racers
    assert max_depth <= live < max_depth + racers


async def test_group_key_is_checked_and_stored(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    async with await Client.connect(dsn, schema=schema) as client:
        with pytest.raises(EnqueueError, match="group must not be empty"):
            await client.enqueue("work", group="")
        with pytest.raises(EnqueueError, match="job 2: group is 513 bytes"):
            await client.enqueue_many([("work", {}), JobSpec("work", group="x" * 513)])
        one = await client.enqueue("work", group="user:7")
        many = await client.enqueue_many([("work", {}), ("work", {})], group="user:8")
        copied = await client.enqueue_many([JobSpec("work", group="user:9"), ("work", {})])
    with pytest.raises(asyncpg.PostgresError, match="group_key must not be empty") as raised:
        await conn.fetchval(f"SELECT {schema}.enqueue('work', group_key => '')")
    assert raised.value.sqlstate == "PJ004"
    rows = await conn.fetch(f"SELECT id, group_key FROM {schema}.job ORDER BY id")
    assert [(r["id"], r["group_key"]) for r in rows] == [
        (one, "user:7"), (many[0], "user:8"), (many[1], "user:8"), (copied[0], "user:9"),
        (copied[1], None),
    ]  # fmt: skip
    assert await conn.fetchval(f"SELECT grouped FROM {schema}.queue WHERE name = 'default'")


async def test_limits_disagreeing_members_last_writer_wins_and_it_is_logged(
    conn: asyncpg.Connection, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"api": QueueConfig(global_concurrency=5)}, "member-a")
    with caplog.at_level("WARNING"):
        await write_queue_limits(
            conn, q, {"api": QueueConfig(global_concurrency=7, rate_limit="10/1s")}, "member-b"
        )
    row = await conn.fetchrow(f"SELECT * FROM {schema}.queue WHERE name = 'api'")
    assert (row["global_concurrency"], row["rate_limit"], row["limits_by"]) == (7, 10, "member-b")
    assert row["rate_window"] == timedelta(seconds=1)
    (record,) = records_of(caplog, "flow.limits_disagree")
    assert "member-a" in record.getMessage() and "global_concurrency=5" in record.getMessage()
    # The same limits again: nothing to say.
    caplog.clear()
    await write_queue_limits(
        conn, q, {"api": QueueConfig(global_concurrency=7, rate_limit="10/1s")}, "member-c"
    )
    assert not records_of(caplog, "flow.limits_disagree")


async def test_status_shows_each_queues_limits(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    await _set_limits(
        conn, schema,
        api=QueueConfig(global_concurrency=10, rate_limit="100/1s"),
        free=QueueConfig(), deep=QueueConfig(max_depth=50),
    )  # fmt: skip
    for queue in ("api", "api", "free", "deep"):
        await _enqueue(conn, q, "work", queue)
    await conn.fetch(q.sql("job_claim_flow"), "api", 1, "m", LEASE, [])
    status = await admin.status(conn, schema)
    limited = {name: msgspec.to_builtins(s.limited) for name, s in status.queues.items()}
    assert limited["api"] == {
        "global_concurrency": 10, "running": 1, "rate_limit": "100/1s", "max_depth": None,
        "tenant_concurrency": None, "fair": False,
    }  # fmt: skip
    assert limited["free"] == {
        "global_concurrency": None, "running": 0, "rate_limit": None, "max_depth": None,
        "tenant_concurrency": None, "fair": False,
    }  # fmt: skip
    assert limited["deep"]["max_depth"] == 50


async def test_a_limited_or_grouped_claim_never_starts_an_expired_job(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    """Regression: through migration 0012 job_claim_flow and job_group_heads started jobs
    past their expires_at (the unlimited claim did not); an expired head keeps its
    group's place until the reaper ends it."""
    await _set_limits(conn, schema, limited=QueueConfig(global_concurrency=5))
    expiring = f"UPDATE {schema}.job SET expires_at = now() - interval '1s' WHERE id = $1"
    plain = await _enqueue(conn, fleet.q, "work", "limited")
    head = await _enqueue(conn, fleet.q, "work", "grouped", group="g")
    behind = await _enqueue(conn, fleet.q, "work", "grouped", group="g")
    fresh = await _enqueue(conn, fleet.q, "work", "limited")
    await conn.execute(expiring, plain)
    await conn.execute(expiring, head)
    claimed = await conn.fetch(fleet.q.sql("job_claim_flow"), "limited", 10, "m", LEASE, [])
    assert [row["id"] for row in claimed] == [fresh]
    assert await conn.fetch(fleet.q.sql("job_claim_flow"), "grouped", 10, "m", LEASE, []) == []
    states = dict(await conn.fetch(f"SELECT id, state FROM {schema}.job"))
    assert states == {plain: "available", head: "available", behind: "available",
                      fresh: "running"}  # fmt: skip


async def test_a_job_claimed_from_a_limited_queue_carries_its_trace_and_dependencies(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    """The limited claim returns what the unlimited one does (before 0012 it returned no
    trace context and no dependencies, so a worker lost both for a limited queue)."""
    await _set_limits(conn, schema, limited=QueueConfig(global_concurrency=5))
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    first = await _enqueue(conn, fleet.q, "work", "limited")
    [first_row] = await conn.fetch(fleet.q.sql("job_claim_flow"), "limited", 1, "m", LEASE, [])
    await conn.fetch(fleet.q.sql("job_complete_many"), [first], [first_row["fence"]], [None],
                     [True])  # fmt: skip
    traced = await conn.fetchval(
        f"SELECT {schema}.enqueue('work', '{{}}', queue => 'limited', "
        "trace_context => $1::jsonb, depends_on => ARRAY[$2::bigint])",
        json.dumps(carrier), first,
    )  # fmt: skip
    [row] = await conn.fetch(fleet.q.sql("job_claim_flow"), "limited", 10, "m", LEASE, [])
    assert row["id"] == traced
    assert json.loads(row["trace_context"]) == carrier
    assert list(row["depends_on"]) == [first]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    more=st.none() | EDGE_WANTED,
    wanted=st.none() | EDGE_WANTED,
    ended=EDGE_FENCES,
    expired=st.booleans(),
)
async def test_an_allocation_holds_its_members_claims_whatever_they_are_told(
    conn: asyncpg.Connection, schema: str, fleet: Fleet, more: int | None,
    wanted: int | None, ended: list[int] | None, expired: bool,
) -> None:  # fmt: skip
    """flow_allocate's `more` and job_claim_allocated's `wanted` (migration 0025) at their
    edges (NULL, negative, zero, int32-extreme), with any `ended`, while another member
    holds one place and a member without an allocation runs one job: the ceiling never
    passes the room they leave, a claim never passes the ceiling nor what it asked for,
    and the running jobs stay within the limit. An expired allocation deleted by another
    member's count takes nothing."""
    await conn.execute(f"TRUNCATE {schema}.job, {schema}.flow_reservation")
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=4))
    for _ in range(8):
        await _enqueue(conn, fleet.q, "work", "q")
    allocate, claim = fleet.q.sql("flow_allocate"), fleet.q.sql("job_claim_allocated")
    other = await conn.fetchrow(allocate, "q", "other", [], 1)
    assert tuple(other) == (1, 1)
    assert [r["id"] is not None for r in await conn.fetch(claim, "q", 1, "other", LEASE, [],
                                                          None, None, None)] == [True]  # fmt: skip
    old = await conn.fetch(fleet.q.sql("job_claim_flow"), "q", 1, "old", LEASE, [])
    assert [r["id"] is not None for r in old] == [True]
    mine = await conn.fetchrow(allocate, "q", "m", ended, more)
    assert 0 <= mine["ceiling"] <= 2 and mine["places"] == mine["ceiling"]
    assert mine["ceiling"] == min(max(more or 0, 0), 2)
    if expired:
        await conn.execute(
            f"UPDATE {schema}.flow_reservation SET expires_at = clock_timestamp() - interval '1 s'"
            " WHERE claimer = 'm'"
        )  # fmt: skip
        assert tuple(await conn.fetchrow(allocate, "q", "other", [], 0)) == (1, 1)
    rows = await conn.fetch(claim, "q", wanted, "m", LEASE, ended, None, None, None)
    taken = [r for r in rows if r["id"] is not None]
    allowed = 0 if expired else mine["ceiling"]
    assert len(taken) == min(max(wanted or 0, 0), allowed)
    assert [r["held_by"] for r in rows if r["id"] is None] == (
        ["global_concurrency"] if wanted is not None and wanted > allowed else []
    )
    running = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE state = 'running'")
    assert running == 2 + len(taken) <= 4


async def test_an_allocation_made_while_its_members_other_loop_claims_counts_that_claim(
    dsn: str, conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    """A member's allocation shrinks (another member starving) while its other claim
    loop's claim, made within the old ceiling, is in flight. The new allocation's
    `places` must still cover what that claim took once it commits, or the starving
    member is given room the first one is using. Migration 0025 counted the member's
    jobs before it waited for the claim (places 5 against 8 running, and the other
    member then claimed 5 of a width of 10); 0026 locks the allocation first."""
    await _set_limits(conn, schema, q=QueueConfig(global_concurrency=10))
    for _ in range(20):
        await _enqueue(conn, fleet.q, "work", "q")
    allocate, claim = fleet.q.sql("flow_allocate"), fleet.q.sql("job_claim_allocated")
    assert tuple(await conn.fetchrow(allocate, "q", "a", [], 10)) == (10, 10)
    assert tuple(await conn.fetchrow(allocate, "q", "b", [], 10)) == (0, 0)  # b starves

    claiming = await asyncpg.connect(dsn)
    renewing = await asyncpg.connect(dsn)
    try:
        in_flight = claiming.transaction()
        await in_flight.start()
        taken = await claiming.fetch(claim, "q", 8, "a", LEASE, [], None, None, None)
        assert len([r for r in taken if r["id"] is not None]) == 8
        renewal_pid = renewing.get_server_pid()
        async with anyio.create_task_group() as tg:
            renewed: list[asyncpg.Record] = []

            async def renew() -> None:
                renewed.append(await renewing.fetchrow(allocate, "q", "a", [], 10))

            tg.start_soon(renew)
            # The renewal waits for the claim's row lock (with either migration: 0025's
            # upsert, 0026's lock before the count).
            with anyio.fail_after(10):
                while await conn.fetchval(  # noqa: ASYNC110
                    "SELECT wait_event_type IS DISTINCT FROM 'Lock' FROM pg_stat_activity "
                    "WHERE pid = $1",
                    renewal_pid,
                ):
                    await anyio.sleep(0.01)
            await in_flight.commit()
    finally:
        await claiming.close()
        await renewing.close()
    [allocation] = renewed
    assert allocation["ceiling"] == 5  # an equal share: b wants places
    assert allocation["places"] == 8, allocation  # what a runs counts until it ends
    given_b = await conn.fetchrow(allocate, "q", "b", [], 10)
    assert given_b["ceiling"] == 2
    claimed_b = await conn.fetch(claim, "q", 10, "b", LEASE, [], None, None, None)
    assert len([r for r in claimed_b if r["id"] is not None]) == 2
    running = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE state = 'running'")
    assert running == 10
