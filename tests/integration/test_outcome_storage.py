"""Outcomes PostgreSQL would refuse, through the real Completer against PostgreSQL: each
is stored in a form every reader handles, or recorded as a failed attempt saying why;
the completer keeps running and its neighbours in the batch are recorded as they were.

Regression for bug 2 of issue 10 (at d1c1ca0 one such outcome failed the whole batch
statement and ended the completer, then the member) and bug 4 (job_fail_many wrote two
job_attempt rows for one failed attempt when the batch also held a stale outcome of the
same job)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta

import anyio
import asyncpg
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd import outcome as storage
from pgjobd.completer import MAX_BATCH, UNSTORABLE, Completer
from pgjobd.config import Config, DatabaseConfig, QueueConfig
from pgjobd.duration import Duration
from pgjobd.model import ClaimedJob, Outcome, Verdict
from pgjobd.notifier import Notifier, Wakeup
from pgjobd.queries import Queries, for_schema

pytestmark = pytest.mark.anyio
LEASE = timedelta(minutes=5)
MEMBER = "member-a"
QUEUES = {"default": QueueConfig(backoff_base=Duration(0), backoff_max=Duration(0), history="all")}


@dataclass
class World:
    conn: asyncpg.Connection
    pool: asyncpg.Pool
    q: Queries
    schema: str

    def completer(self) -> Completer:
        _, receive = anyio.create_memory_object_stream[Outcome](0)
        return Completer(self.pool, self.q, MEMBER, QUEUES, receive)

    async def claimed(self, count: int, max_attempts: int = 5) -> list[ClaimedJob]:
        await self.conn.execute(
            f"SELECT {self.schema}.enqueue('k', max_attempts => $1) FROM generate_series(1, $2)",
            max_attempts, count,
        )  # fmt: skip
        rows = await self.q.job_claim(self.conn, "default", count, MEMBER, LEASE)
        assert len(rows) == count
        return [row.claimed_job() for row in rows]

    async def state(self, job_id: int) -> str:
        live = await self.conn.fetchrow(
            f"SELECT state::text, fence FROM {self.schema}.job WHERE id = $1", job_id
        )
        if live is not None:
            assert live["state"] == "running" or live["fence"] is None
            return str(live["state"])
        final = await self.conn.fetchval(
            f"SELECT state::text FROM {self.schema}.job_history WHERE id = $1", job_id
        )
        return str(final) if final is not None else "missing"

    async def attempts(self, job_id: int) -> list[asyncpg.Record]:
        rows: list[asyncpg.Record] = await self.conn.fetch(
            f"SELECT * FROM {self.schema}.job_attempt WHERE job_id = $1", job_id
        )
        return rows


@pytest.fixture
async def world(dsn: str, conn: asyncpg.Connection, schema: str) -> AsyncIterator[World]:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        yield World(conn, pool, for_schema(schema), schema)
    finally:
        await pool.close()


async def _run_completer(world: World, outcomes: list[Outcome]) -> Completer:
    """Runs a Completer over `outcomes`, all waiting before it starts (one batch), to the
    end of its stream."""
    send, receive = anyio.create_memory_object_stream[Outcome](len(outcomes))
    completer = Completer(world.pool, world.q, MEMBER, QUEUES, receive)
    async with send:
        for o in outcomes:
            send.send_nowait(o)
    with anyio.fail_after(60):
        await completer.run()
    return completer


NUL = "a\x00b"
SURROGATE = "a\ud800b"


async def test_unstorable_outcomes_cost_their_neighbours_nothing(world: World) -> None:
    jobs = await world.claimed(16)
    bad_jobs, good = jobs[:8], jobs[8:]
    bad = [
        Outcome(bad_jobs[0], "completed", result=msgspec.json.encode({"t": NUL, NUL: [NUL]})),
        Outcome(bad_jobs[1], "failed", error_class=NUL, error_message=SURROGATE,
                traceback=NUL * 100_000),
        Outcome(bad_jobs[2], "retry", error_message="later", after_s=1e300),
        Outcome(bad_jobs[3], "snoozed", after_s=math.inf),
        Outcome(bad_jobs[4], "retry", after_s=math.nan, duration_s=math.nan),
        # Not JSON at all (no worker sends this; a broken one could): jsonb refuses it,
        # the batch is split until it is alone, and it is recorded as a failed attempt.
        Outcome(bad_jobs[5], "completed", result=b"{not json"),
        Outcome(bad_jobs[6], "completed", result=b'{"n": NaN}'),
        Outcome(bad_jobs[7], "discarded", error_message="x" * 1_000_000),
    ]  # fmt: skip
    neighbours = [
        Outcome(job, "completed", result=b'{"ok": true}') if i % 2 else
        Outcome(job, "failed", error_class="ValueError", error_message="plain")
        for i, job in enumerate(good)
    ]  # fmt: skip
    batch = [o for pair in zip(bad, neighbours, strict=True) for o in pair]
    completer = await _run_completer(world, batch)
    assert completer.stale == 0
    assert completer.unstorable == 2

    for o in neighbours:
        if o.verdict == "completed":
            assert await world.state(o.job.id) == "completed"
        else:
            assert await world.state(o.job.id) == "retryable"
            (attempt,) = await world.attempts(o.job.id)
            assert (attempt["error_class"], attempt["outcome"]) == ("ValueError", "failed")
    crashes = await world.conn.fetchval(f"SELECT coalesce(sum(crashes), 0) FROM {world.schema}.job")
    assert crashes == 0

    result = await world.conn.fetchval(
        f"SELECT result::text FROM {world.schema}.job_history WHERE id = $1", bad_jobs[0].id
    )
    assert msgspec.json.decode(result) == {"t": "a\ufffdb", "a\ufffdb": ["a\ufffdb"]}
    (attempt,) = await world.attempts(bad_jobs[1].id)
    assert attempt["error_class"] == "a\ufffdb"
    assert attempt["error_message"] == "a\ufffdb"
    assert len(attempt["traceback"]) == storage.MAX_TRACEBACK_CHARS
    assert attempt["traceback"].startswith("...(cut to")
    for job in bad_jobs[2:5]:
        row = await world.conn.fetchrow(
            f"SELECT state::text, run_at - now() AS delay, last_error FROM {world.schema}.job "
            "WHERE id = $1",
            job.id,
        )
        assert row["state"] in ("retryable", "scheduled")
        assert row["delay"] > timedelta(days=9 * 365)
    (attempt,) = await world.attempts(bad_jobs[2].id)
    assert "is beyond" in attempt["error_message"]
    for job in bad_jobs[5:7]:
        assert await world.state(job.id) == "retryable"
        (attempt,) = await world.attempts(job.id)
        assert attempt["error_class"] == UNSTORABLE
        assert "(completed)" in attempt["error_message"]
        assert "json" in attempt["error_message"].lower()
    assert await world.state(bad_jobs[7].id) == "dead"
    (attempt,) = await world.attempts(bad_jobs[7].id)
    assert len(attempt["error_message"]) == storage.MAX_MESSAGE_CHARS


async def test_the_completer_keeps_running_after_a_refused_outcome(world: World) -> None:
    first, second = await world.claimed(2)
    send, receive = anyio.create_memory_object_stream[Outcome](10)
    completer = Completer(world.pool, world.q, MEMBER, QUEUES, receive)
    async with anyio.create_task_group() as tg:
        tg.start_soon(completer.run)
        async with send:
            await send.send(Outcome(first, "completed", result=b"{not json"))
            with anyio.fail_after(30):
                while completer.unstorable == 0:  # noqa: ASYNC110 (a counter, no event)
                    await anyio.sleep(0.01)
            await send.send(Outcome(second, "completed"))
    assert await world.state(first.id) == "retryable"
    assert await world.state(second.id) == "completed"


async def test_a_split_batch_larger_than_one_statement(world: World) -> None:
    jobs = await world.claimed(MAX_BATCH)
    batch = [Outcome(job, "completed", result=b"1") for job in jobs]
    batch[MAX_BATCH // 3] = Outcome(jobs[MAX_BATCH // 3], "completed", result=b"nope")
    completer = await _run_completer(world, batch)
    assert completer.unstorable == 1
    assert completer.recorded == MAX_BATCH
    completed = await world.conn.fetchval(
        f"SELECT count(*) FROM {world.schema}.job_history WHERE state = 'completed'"
    )
    assert completed == MAX_BATCH - 1


async def test_one_attempt_row_per_failed_attempt_with_a_stale_outcome_in_the_batch(
    world: World,
) -> None:
    # Regression (bug 4): the same job, claimed twice (its first lease lost), with the
    # outcomes of both runs in one batch: only the current run's is recorded, once.
    (old,) = await world.claimed(1)
    await world.conn.execute(
        f"UPDATE {world.schema}.job SET state = 'available', fence = NULL, owner = NULL, "
        "lease_expires_at = NULL WHERE id = $1",
        old.id,
    )
    rows = await world.q.job_claim(world.conn, "default", 1, MEMBER, LEASE)
    current = rows[0].claimed_job()
    assert (current.id, current.fence) != (old.id, old.fence) and current.id == old.id
    completer = world.completer()
    await completer.flush([
        Outcome(old, "failed", error_message="stale run"),
        Outcome(current, "failed", error_message="current run"),
    ])  # fmt: skip
    attempts = await world.attempts(current.id)
    assert [a["error_message"] for a in attempts] == ["current run"]
    assert completer.stale == 1 and completer.recorded == 1


# Values at the edges: NUL, lone surrogates, non-BMP, quotes and backslashes, huge.
_specials = st.sampled_from(["\x00", "\ud800", "\udfff", "é", "\U0001d11e", '"', "\\", "\n"])
_texts = st.one_of(
    st.none(),
    st.text(alphabet=st.one_of(_specials, st.characters()), max_size=40),
    st.builds(lambda s, n: s * n, st.text(alphabet=_specials, min_size=1, max_size=3),
              st.integers(1, 60_000)),
)  # fmt: skip
_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), st.integers(-(2**80), 2**80),
              st.text(alphabet=st.one_of(_specials, st.characters()), max_size=20)),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=5), children, max_size=4)),
    max_leaves=10,
)  # fmt: skip


def _encode(value: object) -> bytes | None:
    try:
        return msgspec.json.encode(value)
    except (msgspec.EncodeError, ValueError, OverflowError):  # e.g. lone surrogates
        return None


_results = st.one_of(
    st.none(),
    _json_values.map(_encode),
    st.sampled_from([b"NaN", b'"\\ud800"', b'{"a":"\\u0000"}', b"\xff\xfe", b"", b"[1,"]),
    st.builds(lambda n: b'"' + b"x" * n + b'"', st.integers(0, 2 * storage.MAX_RESULT_BYTES)),
)
_delays = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-1e308, -1.0, 0.0, 1e-9, 1e9, 1e12, 1e300, storage.MAX_DELAY_S + 1]),
)
_verdicts: list[Verdict] = [
    "completed", "failed", "retry", "snoozed", "discarded", "invalid_args", "unknown_kind",
    "crashed", "given_back",
]  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    verdict=st.sampled_from(_verdicts),
    max_attempts=st.integers(1, 3),
    result=_results,
    error_class=_texts,
    error_message=_texts,
    traceback=_texts,
    after_s=_delays,
    duration_s=st.floats(allow_nan=True, allow_infinity=True),
)
async def test_any_outcome_ends_in_a_recorded_state(
    world: World, verdict: Verdict, max_attempts: int, result: bytes | None,
    error_class: str | None, error_message: str | None, traceback: str | None,
    after_s: float | None, duration_s: float,
) -> None:  # fmt: skip
    (job,) = await world.claimed(1, max_attempts)
    completer = world.completer()
    outcome = Outcome(
        job, verdict, duration_s=duration_s, result=result, error_class=error_class,
        error_message=error_message, traceback=traceback, after_s=after_s,
    )  # fmt: skip
    await completer.flush([outcome])
    assert completer.stale == 0
    state = await world.state(job.id)
    assert state in ("completed", "retryable", "scheduled", "available", "dead"), state
    assert state != "available" or verdict == "given_back"

    # and the next ordinary job goes through as ever
    (normal,) = await world.claimed(1)
    await completer.flush([Outcome(normal, "completed", result=b'{"ok":1}')])
    assert await world.state(normal.id) == "completed"
    await world.conn.execute(f"TRUNCATE {world.schema}.job, {world.schema}.job_attempt")


class _AnnounceRefused(Queries):
    """The room announcement fails with a real PostgreSQL error, after the batch it
    follows was recorded."""

    async def queue_room_announce(
        self, conn: asyncpg.Connection, queues: object, member_id: str
    ) -> None:
        await conn.execute("SELECT 1 / 0")


async def test_a_failed_room_announcement_leaves_the_recorded_batch_alone(world: World) -> None:
    # Review finding: the announcement ran inside the batch's write, so its failure made
    # the completer write the batch again, and every job of it counted as stale.
    jobs = await world.claimed(6)
    outcomes = [Outcome(j, "completed") for j in jobs[:4]]
    outcomes += [Outcome(j, "failed", error_message="boom") for j in jobs[4:]]
    send, receive = anyio.create_memory_object_stream[Outcome](len(outcomes))
    completer = Completer(world.pool, _AnnounceRefused(world.schema), MEMBER, QUEUES, receive)
    completer.track_ends("default", Wakeup(), announce=True)
    async with send:
        for o in outcomes:
            send.send_nowait(o)
    with anyio.fail_after(60):
        await completer.run()
    assert (completer.recorded, completer.stale) == (6, 0)
    assert [await world.state(j.id) for j in jobs] == ["completed"] * 4 + ["retryable"] * 2


@pytest.mark.parametrize("announce", [True, False], ids=["whole-claims", "allocations"])
async def test_the_end_of_a_flow_queues_jobs_is_announced_to_the_other_members(
    world: World, dsn: str, announce: bool
) -> None:
    """queue_room_announce, sent once the ends are recorded, wakes the queue's producers
    on another member's Notifier and not on the announcing member's own (its producers
    took those places as the jobs ended). Not for a queue claimed within allocations:
    an end there makes room for the member that ran it alone, and a wake-up elsewhere
    would only cost the others a claim that finds no room."""
    config = Config(database=DatabaseConfig(schema=world.schema), dsn=dsn)
    own = Notifier(config, ["default"], MEMBER)
    other = Notifier(config, ["default"], "another-member")
    async with anyio.create_task_group() as tg:
        for notifier in (own, other):
            await tg.start(notifier.run)
        for notifier in (own, other):
            notifier.wakeup("default").clear()  # set as each started listening
        jobs = await world.claimed(3)
        with anyio.fail_after(60):
            for notifier in (own, other):  # by the enqueue's notification on job_ready
                await notifier.wakeup("default").wait(60)
                notifier.wakeup("default").clear()
        send, receive = anyio.create_memory_object_stream[Outcome](3)
        completer = Completer(world.pool, world.q, MEMBER, QUEUES, receive)
        completer.track_ends("default", Wakeup(), announce=announce)
        async with send:
            for j in jobs:
                send.send_nowait(Outcome(j, "completed"))
        with anyio.fail_after(60):
            await completer.run()
            # A notification committed after the announcement reaches each listener
            # after it (notifications are delivered in commit order): once it has, so
            # has the announcement, if any.
            markers = {notifier: anyio.Event() for notifier in (own, other)}
            for notifier, marker in markers.items():
                notifier.on_cancel = lambda _job_id, marker=marker: marker.set()
            await world.conn.execute(f"NOTIFY \"{world.schema}.job_cancel\", '0'")
            for marker in markers.values():
                await marker.wait()
        assert other.wakeup("default").is_set() == announce
        assert not own.wakeup("default").is_set()
        tg.cancel_scope.cancel()
    assert [await world.state(j.id) for j in jobs] == ["completed"] * 3


async def test_a_flow_queues_ended_jobs_are_left_out_of_its_count_until_recorded(
    world: World,
) -> None:
    """OwnEnds: the fences of ended jobs stay until their outcomes are written (held
    while the write cannot happen), and are gone once it has."""
    jobs = await world.claimed(4)
    send, receive = anyio.create_memory_object_stream[Outcome](4)
    completer = Completer(world.pool, world.q, MEMBER, QUEUES, receive)
    own = completer.track_ends("default", Wakeup(), announce=True)
    own.fences.update(j.fence for j in jobs)  # as the queue's workers do, at each end
    async with send:
        for j in jobs[:3]:
            send.send_nowait(Outcome(j, "completed"))
    with anyio.fail_after(60):
        await completer.run()
    assert own.fences == {jobs[3].fence}  # not handed over yet: still ended, unrecorded
    assert [await world.state(j.id) for j in jobs[:3]] == ["completed"] * 3
    completer.untrack_ends("default")
    assert "default" not in completer.own_ends
