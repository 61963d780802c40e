"""Connections to PostgreSQL: the member's pool, and dedicated sessions (LISTEN, the
leader's lock) that must never come from a pool — asyncpg's pool release runs UNLISTEN
and unlocks advisory locks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import asyncpg

from pgjobd.config import Config

ResetHook = Callable[[asyncpg.Connection], Awaitable[None]]


def session_settings(
    statement_timeout: timedelta,
    idle_in_transaction_timeout: timedelta,
    application_name: str = "pgjobd",
    tenant: str | None = None,
) -> dict[str, str]:
    """Settings every session pgjobd opens runs with (the daemon's, the client's and the
    CLI's); the name shows in pg_stat_activity. `tenant` sets pgjobd.tenant (see
    sql/rls.sql)."""
    settings = {
        "application_name": application_name,
        "statement_timeout": str(_ms(statement_timeout)),
        # A session that idles inside a transaction holds back vacuum on the hot table;
        # pgjobd's own transactions are single statements, so this never fires for them.
        "idle_in_transaction_session_timeout": str(_ms(idle_in_transaction_timeout)),
        # Notice a dead peer within a minute rather than the kernel's two hours.
        "tcp_keepalives_idle": "30",
        "tcp_keepalives_interval": "10",
        "tcp_keepalives_count": "3",
    }
    if tenant is not None:
        settings["pgjobd.tenant"] = tenant
    return settings


def _ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)


def server_settings(config: Config, application_name: str = "pgjobd") -> dict[str, str]:
    """`session_settings` from the [database] table."""
    database = config.database
    return session_settings(
        database.statement_timeout, database.idle_in_transaction_session_timeout,
        application_name,
    )  # fmt: skip


def connect_options(config: Config, application_name: str = "pgjobd") -> dict[str, Any]:
    """asyncpg.connect / create_pool options: the connect timeout and session settings."""
    return {
        "timeout": config.database.connect_timeout.total_seconds(),
        "server_settings": server_settings(config, application_name),
    }


async def create_pool(
    config: Config,
    *,
    max_size: int | None = None,
    reset: ResetHook | None = None,
    application_name: str = "pgjobd",
) -> asyncpg.Pool:
    pool_max = max_size or config.database.pool_max
    pool: asyncpg.Pool = await asyncpg.create_pool(
        config.require_dsn(),
        min_size=min(config.database.pool_min, pool_max),
        max_size=pool_max,
        reset=reset,
        **connect_options(config, application_name),
    )
    return pool


async def connect_session(
    config: Config, application_name: str, dsn: str | None = None
) -> asyncpg.Connection:
    """A dedicated session, not from any pool, named e.g. "pgjobd listener"."""
    conn: asyncpg.Connection = await asyncpg.connect(
        dsn or config.require_dsn(), **connect_options(config, application_name)
    )
    return conn


@asynccontextmanager
async def acquire(pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    """A connection from `pool`, as ``pool.acquire()`` gives, except that a connection
    whose use ended in anything but an error PostgreSQL reported (a cancelled task, a
    timeout, a lost or confused connection) is closed instead of going back to the pool.

    Such a connection may be in the middle of an operation. asyncpg would keep it for
    the pool until the server confirms a cancel request, which a server that is
    restarting or unreachable never does: the pool slot stays taken, or the connection
    comes back to answer its next use with "cannot switch to state 12; another
    operation is in progress". After a PostgresError the connection is in a known state
    and is reused.
    """
    conn: asyncpg.Connection = await pool.acquire()
    try:
        yield conn
    except BaseException as e:
        if isinstance(e, asyncpg.PostgresError):
            await pool.release(conn)
        else:
            # The pool takes the slot back and connects afresh on a later acquire. (A
            # connection already closed went back to the pool: its proxy refuses.)
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()
        raise
    await pool.release(conn)
