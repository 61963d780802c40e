"""The web console's reads (sql/web.sql)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from pgjobd.statements import Conn, Rendered, rows_of, statement


class AttemptRow(NamedTuple):
    attempt: int
    failed_at: datetime
    duration_s: float | None
    member: str | None
    outcome: str
    error_class: str | None
    error_message: str | None
    traceback: str | None
    fingerprint: str | None


class SampleRow(NamedTuple):
    at: datetime
    available: int
    scheduled: int
    running: int
    retryable: int
    completed: int
    dead: int
    cancelled: int


class WebStatements(Rendered):
    @statement("web_job_attempts")
    async def web_job_attempts(self, conn: Conn, job_id: int) -> list[AttemptRow]:
        return rows_of(AttemptRow, await conn.fetch(self.sql("web_job_attempts"), job_id))

    @statement("web_samples")
    async def web_samples(
        self, conn: Conn, within: timedelta, queues: Sequence[str] | None
    ) -> list[SampleRow]:
        return rows_of(SampleRow, await conn.fetch(self.sql("web_samples"), within, queues))

    @statement("web_now")
    async def web_now(self, conn: Conn) -> datetime:
        now: datetime = await conn.fetchval(self.sql("web_now"))
        return now
