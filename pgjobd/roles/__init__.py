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

import anyio
import asyncpg

from pgjobd import db
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


@asynccontextmanager
async def as_table_owner(
    conn: asyncpg.Connection, ctx: RoleContext, *, timeout_ms: int
) -> AsyncIterator[None]:
    """Session state for one DDL statement that needs the job tables' owner and cannot
    run in a transaction, nor so in a SECURITY DEFINER function: SET ROLE to the
    schema's maintainer role when the login is a worker (see sql/roles.sql), and an
    explicit statement_timeout of its own; both reset after it. (A cancelled statement's
    connection is terminated by `db.acquire`, not reset.) Check the term before: the
    maintainer may not read the leader table.

    Why not a SECURITY DEFINER function, like partitions_ensure and partition_drop:
    PostgreSQL refuses these statements inside a function or transaction block."""
    role = await ctx.queries.maintainer_role_to_set(
        conn, f"{ctx.config.database.schema}_maintainer"
    )
    await conn.execute(f"SET statement_timeout = {int(timeout_ms)}")
    if role is not None:
        await conn.execute(f'SET ROLE "{role}"')  # a schema-derived name: never quoted
    try:
        yield
    except asyncpg.PostgresError:
        await conn.execute(_RESET_OWNER_DDL)
        raise
    # Anything else (a cancellation, a broken connection) and the caller terminates the
    # connection (db.acquire does): resetting it would be an await in a cancelled scope.
    await conn.execute(_RESET_OWNER_DDL)


_RESET_OWNER_DDL = "RESET ROLE; RESET statement_timeout"


def owner_ddl_timeout_s(timeout_ms: int) -> float:
    """The client's wait for an `as_table_owner` statement's answer (asyncpg's
    `timeout=`): its own statement_timeout and the grace of every other statement."""
    return timeout_ms / 1000 + db.COMMAND_TIMEOUT_GRACE_S


@asynccontextmanager
async def owner_ddl_session(ctx: RoleContext, name: str) -> AsyncIterator[asyncpg.Connection]:
    """The connection for a role whose DDL runs `as_table_owner`: a pool connection,
    but through a pooler a session of its own (on database.leader_dsn when set). The
    SET ROLE and statement_timeout it sets are session state, which on a transaction
    pooler's shared server connection would reach other clients, and would not even
    hold for the DDL, sent in a transaction of its own."""
    if ctx.config.database.pooler == "none":
        async with db.acquire(ctx.pool) as conn:
            yield conn
        return
    conn = await db.connect_session(ctx.config, name)
    try:
        yield conn
    finally:
        with anyio.move_on_after(5, shield=True):
            await conn.close()
        if not conn.is_closed():
            conn.terminate()


class Role(Protocol):
    name: ClassVar[str]

    def interval_s(self, config: Config) -> float: ...

    async def tick(self, ctx: RoleContext) -> None:
        """One unit of work; safe to repeat, and to run while a deposed leader's last
        statement is still in flight (its writes are fenced)."""
