"""The statements of sql/testing.sql: what the testing kit (pgjobd.testing) reads and
changes in a test's schema."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from pgjobd.statements import Conn, Rendered, rows_of, statement


class LiveJob(NamedTuple):
    """A live job, as job_list_live reads it."""

    id: int
    kind: str
    queue: str
    state: str
    args: str  # JSON text
    priority: int
    tenant: str | None
    unique_key: str | None
    run_at: datetime
    attempt: int
    max_attempts: int


class TestingStatements(Rendered):
    @statement("job_due_queues")
    async def job_due_queues(self, conn: Conn, queue: str | None) -> list[str]:
        return [row[0] for row in await conn.fetch(self.sql("job_due_queues"), queue)]

    @statement("job_fast_forward")
    async def job_fast_forward(self, conn: Conn, queue: str | None) -> None:
        await conn.execute(self.sql("job_fast_forward"), queue)

    @statement("job_list_live")
    async def job_list_live(
        self, conn: Conn, kind: str | None, queue: str | None, tenant: str | None,
        args: str | None,
    ) -> list[LiveJob]:  # fmt: skip
        records = await conn.fetch(self.sql("job_list_live"), kind, queue, tenant, args)
        return rows_of(LiveJob, records)
