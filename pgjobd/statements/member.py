"""The statements of sql/member.sql: a member's row, its kinds, the partitions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pgjobd.statements import Conn, Rendered, columns, statement


class KindDeclared(NamedTuple):
    """A kind's effective defaults, as a member declares them."""

    kind: str
    queue: str
    priority: int
    max_attempts: int
    timeout_s: float
    redact: str  # the args fields its handler redacts, as a JSON array's text


class MemberStatements(Rendered):
    @statement("member_join")
    async def member_join(
        self, conn: Conn, member_id: str, host: str, pid: int, version: str,
        queues: Sequence[str],
    ) -> None:  # fmt: skip
        await conn.execute(self.sql("member_join"), member_id, host, pid, version, queues)

    @statement("member_heartbeat")
    async def member_heartbeat(
        self, conn: Conn, member_id: str, queues: Sequence[str]
    ) -> bool | None:
        """True while the member's row exists (None or False: it is gone)."""
        alive: bool | None = await conn.fetchval(self.sql("member_heartbeat"), member_id, queues)
        return alive

    @statement("member_leave")
    async def member_leave(self, conn: Conn, member_id: str) -> None:
        await conn.execute(self.sql("member_leave"), member_id)

    @statement("kind_declare_many")
    async def kind_declare_many(
        self, conn: Conn, kinds: Sequence[KindDeclared], member_id: str
    ) -> None:
        sql = self.sql("kind_declare_many")
        await conn.execute(sql, *columns(kinds, len(KindDeclared._fields)), member_id)

    @statement("partitions_ensure")
    async def partitions_ensure(self, conn: Conn, days_ahead: int) -> int:
        made: int = await conn.fetchval(self.sql("partitions_ensure"), days_ahead)
        return made
