"""One queue's claim loop: claims as many jobs as its workers have free slots, in one
statement, and hands them to the worker pool.

It claims only when a slot is free and the completer is keeping up. Between claims it
waits for a NOTIFY wake-up or, failing that, polls with an interval that doubles while
the queue stays empty (up to MAX_POLL_S) and drops back as soon as work turns up.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Protocol

import anyio
import asyncpg

from pgjobd import backoff
from pgjobd.completer import Completer
from pgjobd.errors import TRANSIENT
from pgjobd.model import ClaimedJob
from pgjobd.notifier import Wakeup
from pgjobd.queries import Queries

log = logging.getLogger(__name__)

MIN_POLL_S = 0.05
MAX_POLL_S = 1.0
# When every slot was filled last time, wait this long for more slots to free up so
# that one claim statement serves several jobs instead of one each.
BATCH_WINDOW_S = 0.002


class Workers(Protocol):
    def free_slots(self) -> int: ...
    async def wait_free(self) -> None: ...
    async def submit(self, job: ClaimedJob) -> None: ...


class Producer:
    def __init__(
        self,
        queue: str,
        *,
        pool: asyncpg.Pool,
        queries: Queries,
        workers: Workers,
        wakeup: Wakeup,
        completer: Completer,
        member_id: str,
        lease: timedelta,
    ) -> None:
        self.queue = queue
        self.pool = pool
        self.q = queries
        self.workers = workers
        self.wakeup = wakeup
        self.completer = completer
        self.member_id = member_id
        self.lease = lease
        self.claim_seconds: list[float] = []  # recent claim durations, for metrics
        self.claimed = 0

    async def run(self) -> None:
        poll_s = MIN_POLL_S
        saturated = False
        failures = 0
        while True:
            await self.workers.wait_free()
            await self.completer.wait_accepting()
            if saturated:
                await anyio.sleep(BATCH_WINDOW_S)
            limit = self.workers.free_slots()
            if limit <= 0:
                continue
            self.wakeup.clear()
            try:
                jobs = await self.claim(limit)
            except TRANSIENT as e:
                failures += 1
                log.warning(
                    "claim from queue %s failed: %s", self.queue, e,
                    extra={"event": "producer.claim_failed", "queue": self.queue},
                )  # fmt: skip
                await anyio.sleep(backoff.jittered(min(5.0, 0.1 * 2**failures)))
                continue
            failures = 0
            for job in jobs:
                await self.workers.submit(job)
            saturated = len(jobs) == limit
            if jobs:
                poll_s = MIN_POLL_S
            if not saturated:
                await self.wakeup.wait(poll_s)
                poll_s = min(poll_s * 2, MAX_POLL_S)

    async def claim(self, limit: int) -> list[ClaimedJob]:
        started = time.perf_counter()
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                self.q["job_claim"], self.queue, limit, self.member_id, self.lease
            )
        self.claim_seconds.append(time.perf_counter() - started)
        if len(self.claim_seconds) > 1000:
            del self.claim_seconds[:500]
        self.claimed += len(rows)
        return [_claimed(row) for row in rows]


def _claimed(row: asyncpg.Record) -> ClaimedJob:
    return ClaimedJob(
        id=row["id"], fence=row["fence"], kind=row["kind"], queue=row["queue"],
        attempt=row["attempt"], max_attempts=row["max_attempts"], crashes=row["crashes"],
        priority=row["priority"], tenant=row["tenant"], enqueued_at=row["enqueued_at"],
        scheduled_at=row["scheduled_at"], args=row["args"].encode(),
    )  # fmt: skip
