"""The producer's claim loops against a real database, with workers whose slots can free
up without a change notification: what a slot reserved by the other claim loop and left
unfilled looks like to a loop waiting for slots."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import anyio
import asyncpg
import pytest

from pgjobd.completer import Completer, OwnEnds
from pgjobd.config import QueueConfig
from pgjobd.model import ClaimedJob, Outcome
from pgjobd.notifier import Wakeup
from pgjobd.producer import Producer, Workers
from pgjobd.queries import Queries, for_schema

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

    async def wait_changed(self) -> None:
        self.waiting += 1
        try:
            await anyio.sleep_forever()
        finally:
            self.waiting -= 1

    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None:
        self.submitted += jobs


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
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        producer = default_queue_producer(pool, q, workers)
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer.run)
            with anyio.fail_after(5):
                while not workers.waiting:  # noqa: ASYNC110 (a claim loop waits for a slot)
                    await anyio.sleep(0.01)
            workers.free = 2  # as an unfilled reservation gives slots back: silently
            with anyio.fail_after(5):
                while not workers.submitted:  # noqa: ASYNC110 (the fake announces nothing)
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        await pool.close()
    assert [job.kind for job in workers.submitted] == ["k"]
