"""The producer's claim loops against a real database, with workers whose slots can free
up without a change notification: what a slot reserved by the other claim loop and left
unfilled looks like to a loop waiting for slots."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta

import anyio
import asyncpg
import pytest

from pgjobd import metrics
from pgjobd.completer import Completer, OwnEnds
from pgjobd.config import QueueConfig
from pgjobd.member.generations import write_queue_limits
from pgjobd.model import ClaimedJob, Outcome
from pgjobd.notifier import Wakeup
from pgjobd.producer import CLAIMERS, MIN_POLL_S, Producer, Workers
from pgjobd.queries import Queries, for_schema
from pgjobd.statements.job import Allocation, FlowClaimRow

pytestmark = pytest.mark.anyio


class SilentSlots:
    """Two slots, none free until `free` is set, and no change is ever announced."""

    own_ends: OwnEnds | None = None

    def __init__(self) -> None:
        self.free = 0
        self.waiting = 0  # claim loops waiting for a change
        self.submitted: list[ClaimedJob] = []

    def slots(self) -> int:
        return 2

    def free_slots(self) -> int:
        return self.free - len(self.submitted)

    def running(self) -> int:
        return len(self.submitted)

    async def wait_changed(self) -> None:
        self.waiting += 1
        try:
            await anyio.sleep_forever()
        finally:
            self.waiting -= 1

    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None:
        self.submitted += jobs


@contextlib.asynccontextmanager
async def producer_running(dsn: str, q: Queries, workers: Workers) -> AsyncIterator[Producer]:
    """A producer of queue "default" for member "m" (default_queue_producer), running
    until the block ends, on a pool of its own."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3)
    try:
        producer = default_queue_producer(pool, q, workers)
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer.run)
            yield producer
            tg.cancel_scope.cancel()
    finally:
        await pool.close()


def default_queue_producer(pool: asyncpg.Pool, q: Queries, workers: Workers) -> Producer:
    """A producer of queue "default" for member "m", its completer fed by nothing."""
    _, receive = anyio.create_memory_object_stream[Outcome](0)
    completer = Completer(pool, q, "m", {"default": QueueConfig()}, receive)
    return Producer(
        "default", pool=pool, queries=q, workers=workers, wakeup=Wakeup(),
        completer=completer, member_id="m", lease=timedelta(minutes=1),
    )  # fmt: skip


async def test_a_loop_waiting_for_slots_sees_slots_that_freed_without_a_change(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """Regression: a loop waited for the workers' next change while the other loop held
    the free slots for a claim; that claim came back short, found the queue under flow
    control (a kind's breaker had opened) and its loop sat out from then on. With no
    job running in the queue no change came: nothing of the queue was claimed again
    (tests/e2e/test_circuit_breaker.py, about 1 run in 4 in CI)."""
    q = for_schema(schema)
    await conn.execute(f"SELECT {schema}.enqueue('k')")
    workers = SilentSlots()
    async with producer_running(dsn, q, workers):
        with anyio.fail_after(5):
            while not workers.waiting:  # noqa: ASYNC110 (a claim loop waits for a slot)
                await anyio.sleep(0.01)
        workers.free = 2  # as an unfilled reservation gives slots back: silently
        with anyio.fail_after(5):
            while not workers.submitted:  # noqa: ASYNC110 (the fake announces nothing)
                await anyio.sleep(0.01)
    assert [job.kind for job in workers.submitted] == ["k"]


class HeldSlots:
    """Eight slots; a job handed over runs until the test ends it (then its fence is
    among the ended ones, as the real workers record it, and it is never recorded)."""

    own_ends: OwnEnds | None = None

    def __init__(self) -> None:
        self.jobs: list[ClaimedJob] = []
        self.handed_over = 0
        self._changed = anyio.Event()

    def slots(self) -> int:
        return 8

    def free_slots(self) -> int:
        return 8 - len(self.jobs)

    def running(self) -> int:
        return len(self.jobs)

    async def wait_changed(self) -> None:
        await self._changed.wait()

    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None:
        self.jobs += jobs
        self.handed_over += len(jobs)
        self._announce()

    def end_one(self) -> None:
        job = self.jobs.pop(0)
        assert self.own_ends is not None
        self.own_ends.fences.add(job.fence)
        self._announce()

    def _announce(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class AllocationCalls(Queries):
    """Records each allocation, and each claim within one with what it asked for and
    how many jobs ran when it was made."""

    def __init__(self, schema: str, workers: HeldSlots) -> None:
        super().__init__(schema)
        self.workers = workers
        # (statement, asked, running, held back by the database)
        self.calls: list[tuple[str, int, int, bool]] = []

    async def flow_allocate(  # type: ignore[override]
        self, conn: asyncpg.Connection, queue: str, member_id: str, ended: Sequence[int],
        more: int,
    ) -> Allocation | None:  # fmt: skip
        self.calls.append(("allocate", more, self.workers.running(), False))
        return await super().flow_allocate(conn, queue, member_id, ended, more)

    async def job_claim_allocated(  # type: ignore[override]
        self, conn: asyncpg.Connection, queue: str, limit: int, *rest: object
    ) -> list[FlowClaimRow]:
        running = self.workers.running()
        rows = await super().job_claim_allocated(conn, queue, limit, *rest)  # type: ignore[arg-type]
        self.calls.append(("claim", limit, running, any(row.id is None for row in rows)))
        return rows


async def test_a_producer_claims_within_its_allocations_room_and_not_while_it_has_none(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """A queue whose only limit is global_concurrency = 3, a member with eight slots: a
    claim within the allocation asks for the allocation's room (its ceiling less the
    jobs running), not for the free slots, unless it renews the allocation (that one
    tells the demand); and while the allocation is full the member claims nothing, it
    only renews the allocation (issue 12: every end there cost a claim that found no
    room, and the fleet-wide drain ran at 0.7 of the per-member one)."""
    await write_queue_limits(
        conn, for_schema(schema), {"default": QueueConfig(global_concurrency=3)}, "test"
    )
    for _ in range(6):
        await conn.execute(f"SELECT {schema}.enqueue('k')")
    workers = HeldSlots()
    q = AllocationCalls(schema, workers)
    throttled_before = _throttled("default", "global_concurrency")
    async with producer_running(dsn, q, workers):
        with anyio.fail_after(10):
            while workers.handed_over < 3:  # noqa: ASYNC110 (the fake announces nothing)
                await anyio.sleep(0.01)
            full = len(q.calls)
            while sum(c[0] == "allocate" for c in q.calls[full:]) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            workers.end_one()
            workers.end_one()
            while workers.handed_over < 5:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert not [c for c in q.calls[full:] if c[0] == "claim" and c[2] >= 3], q.calls
    for before, call in zip(q.calls, q.calls[1:], strict=False):
        if call[0] == "claim" and before[0] != "allocate":
            assert call[1] <= 3 - call[2], q.calls
    assert workers.handed_over == 5
    # Still visible as throttling, though no claim is held back by the database: jobs
    # waited while slots were free.
    assert _throttled("default", "global_concurrency") > throttled_before


def _throttled(queue: str, limit: str) -> float:
    sample = metrics.REGISTRY.get_sample_value(
        "pgjobd_jobs_throttled_total", {"queue": queue, "limit": limit}
    )
    return sample or 0.0


async def test_a_producer_whose_jobs_run_outside_its_slots_waits_for_room_after_a_held_claim(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """Two of the member's jobs run outside its workers' slots (as a reload's retiring
    workers' do): the workers' count says the allocation has room, the database's does
    not. A claim the database held back is followed by a wait for room, as under the
    queue's lock, not by the next claim at once (a loop of round trips)."""
    q0 = for_schema(schema)
    await write_queue_limits(conn, q0, {"default": QueueConfig(global_concurrency=3)}, "test")
    for _ in range(6):
        await conn.execute(f"SELECT {schema}.enqueue('k')")
    outside = await conn.fetch(
        q0.sql("job_claim_flow"), "default", 2, "m", timedelta(minutes=1), []
    )
    assert len([row for row in outside if row["id"] is not None]) == 2
    workers = HeldSlots()
    q = AllocationCalls(schema, workers)
    async with producer_running(dsn, q, workers):
        with anyio.fail_after(10):
            while not any(call[3] for call in q.calls):  # noqa: ASYNC110
                await anyio.sleep(0.01)
            held, since = len(q.calls), time.monotonic()
            while sum(c[0] == "allocate" for c in q.calls[held:]) < 4:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            window, seconds = q.calls[held:], time.monotonic() - since
    assert workers.handed_over == 1, q.calls  # the one place the outside jobs left
    # Each of the two claim loops waits MIN_POLL_S for room after a held claim (no job
    # of its own ends here to cut that short): a loop without that wait claims every
    # millisecond or two.
    claims = sum(c[0] == "claim" for c in window)
    assert claims <= CLAIMERS * (seconds / MIN_POLL_S + 2), (claims, seconds, window)


class RecordedSlots(SilentSlots):
    """Two free slots; hand-overs are noted in `order`, beside the claim path's reads."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.free = 2
        self.order = order

    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None:
        self.order.append("hand-over")
        await super().submit_many(jobs)


async def test_a_short_claims_jobs_are_handed_over_before_the_claim_path_is_read_again(
    dsn: str, conn: asyncpg.Connection, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a claim that came back short read the queue's claim path again (once
    per FLOW_RECHECK_S) before returning, so the jobs it had claimed waited for one more
    round trip before their hand-over: at a trickle, a job in fifty or so, at the tail
    of the latency (bench/throughput.py's trickle)."""
    monkeypatch.setattr("pgjobd.producer.FLOW_RECHECK_S", 0.0)
    q = for_schema(schema)
    order: list[str] = []
    read_path = q.queue_claim_path_get

    async def noted_read(conn: asyncpg.Connection, queue: str) -> str | None:
        order.append("path read")
        return await read_path(conn, queue)

    monkeypatch.setattr(q, "queue_claim_path_get", noted_read)
    await conn.execute(f"SELECT {schema}.enqueue('k')")
    workers = RecordedSlots(order)
    async with producer_running(dsn, q, workers):
        with anyio.fail_after(5):
            while order.count("path read") < 2:  # noqa: ASYNC110 (nothing to wait on)
                await anyio.sleep(0.01)
    assert [job.kind for job in workers.submitted] == ["k"]
    # The first read tells the producer how the queue claims; the short claim's re-read
    # comes after the hand-over of its job.
    assert order[:3] == ["path read", "hand-over", "path read"], order


class FilledSlots(SilentSlots):
    """Two free slots, none left after the first hand-over (however many it brought):
    one claim, then none."""

    def __init__(self) -> None:
        super().__init__()
        self.free = 2

    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None:
        await super().submit_many(jobs)
        self.free = len(self.submitted)


async def test_a_claim_path_read_in_flight_is_not_cut_short_by_cancelling_the_producer(
    dsn: str, conn: asyncpg.Connection, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (CI, stop 29): the re-read after a short claim's hand-over ran outside
    the claim's shield, so cancelling the producer cut its statement short; asyncpg then
    sent the server a cancel request on a connection of its own, which the pool closing
    under it broke (a ConnectionError raised in the event loop, no task to catch it).
    The re-read runs to its end as a claim does, bounded only by stop()."""
    monkeypatch.setattr("pgjobd.producer.FLOW_RECHECK_S", 0.0)
    q = for_schema(schema)
    reads = 0
    read_path = q.queue_claim_path_get

    async def read_behind_a_lock(read_conn: asyncpg.Connection, queue: str) -> str | None:
        nonlocal reads
        reads += 1
        if reads == 2:  # the short claim's re-read: the kind table is locked under it
            await locker.execute("BEGIN")
            await locker.execute(f"LOCK TABLE {schema}.kind IN ACCESS EXCLUSIVE MODE")
        return await read_path(read_conn, queue)

    monkeypatch.setattr(q, "queue_claim_path_get", read_behind_a_lock)
    await conn.execute(f"SELECT {schema}.enqueue('k')")
    workers = FilledSlots()
    ended = anyio.Event()
    waiting = (  # this schema's re-read, waiting for the lock
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        f"AND query LIKE '%{schema}.queue_reservable%'"
    )
    locker = await asyncpg.connect(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3)
    try:
        async with anyio.create_task_group() as tg:
            producer_scope = anyio.CancelScope()

            async def run_producer() -> None:
                with producer_scope:
                    await default_queue_producer(pool, q, workers).run()
                ended.set()

            tg.start_soon(run_producer)
            try:
                with anyio.fail_after(5):
                    while await conn.fetchval(waiting) == 0:  # noqa: ASYNC110 (database state)
                        await anyio.sleep(0.01)
                producer_scope.cancel()
                with anyio.move_on_after(0.5):
                    await ended.wait()
                assert not ended.is_set()  # the producer waits for its read
                assert await conn.fetchval(waiting) == 1  # which was not cancelled
            finally:
                if locker.is_in_transaction():
                    await locker.execute("ROLLBACK")  # (on a failure too: the read ends)
            with anyio.fail_after(5):
                await ended.wait()
    finally:
        await pool.close()
        await locker.close()
    assert reads == 2
    assert [job.kind for job in workers.submitted] == ["k"]
