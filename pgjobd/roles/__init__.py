"""The leader's singleton roles: each a module with a name, an interval and an
idempotent, fenced `tick`.

The fence is the leader's term (see sql/leader.sql): every role write runs inside
`fenced`, a transaction that commits only if the term is still open at its end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import ClassVar, Protocol

import asyncpg

from pgjobd.config import Config
from pgjobd.queries import Queries

# A role transaction holds its term's row FOR SHARE from its last statement to COMMIT;
# a next term's begin waits for that. A member frozen in between (SIGSTOP, a hung
# host) must not keep the next leader waiting: PostgreSQL ends such a session.
FENCED_IDLE_TIMEOUT = "10s"


@dataclass(frozen=True)
class RoleContext:
    """What a role's tick needs; `term` fences every role write."""

    pool: asyncpg.Pool
    queries: Queries
    config: Config
    member_id: str
    term: int


class Deposed(Exception):
    """The term ended before a role's write committed: the write was rolled back."""

    def __init__(self, term: int) -> None:
        super().__init__(f"term {term} has ended: this member is no longer leader")
        self.term = term


@asynccontextmanager
async def fenced(conn: asyncpg.Connection, ctx: RoleContext) -> AsyncIterator[None]:
    """A transaction for a role's writes that commits only while `ctx.term` is the
    current term, checked as its last statement (Deposed otherwise: rolled back)."""
    async with conn.transaction():
        await conn.execute(
            f"SET LOCAL idle_in_transaction_session_timeout = '{FENCED_IDLE_TIMEOUT}'"
        )
        yield
        if await ctx.queries.leader_term_holds(conn, ctx.term) is None:
            raise Deposed(ctx.term)


async def term_open(conn: asyncpg.Connection, ctx: RoleContext) -> None:
    """For DDL that cannot run in a transaction: Deposed unless the term is open now."""
    if not await ctx.queries.leader_term_open(conn, ctx.term):
        raise Deposed(ctx.term)


class Role(Protocol):
    name: ClassVar[str]

    def interval_s(self, config: Config) -> float: ...

    async def tick(self, ctx: RoleContext) -> None:
        """One unit of work; safe to repeat, and to run while a deposed leader's last
        statement is still in flight (its writes are fenced)."""
