"""Connections to PostgreSQL: the member's pool, and dedicated sessions (LISTEN, the
leader's lock) that must never come from a pool — asyncpg's pool release runs UNLISTEN
and unlocks advisory locks."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, NamedTuple, cast

import anyio
import asyncpg

from pgjobd.config import Config, Pooler, session_timeout_problem

# How long a connection whose statement timed out waits for its cancel to be confirmed.
CANCEL_WAIT_S = 5.0
# How much longer than statement_timeout the client waits for a statement's answer.
COMMAND_TIMEOUT_GRACE_S = 5.0
# What a pool runs on one of its connections (its reset on release, its warm-up on opening).
ConnectionHook = Callable[[asyncpg.Connection], Awaitable[None]]
# The member's pool plans its prepared statements once (see create_pool's `generic_plans`).
GENERIC_PLANS = {"plan_cache_mode": "force_generic_plan"}


def session_settings(
    statement_timeout: timedelta,
    idle_in_transaction_timeout: timedelta,
    application_name: str = "pgjobd",
    tenant: str | None = None,
) -> dict[str, str]:
    """Settings every session pgjobd opens runs with (the daemon's, the client's and the
    CLI's); the name shows in pg_stat_activity. `tenant` sets pgjobd.tenant (see
    sql/rls.sql)."""
    for name, value in (
        ("statement_timeout", statement_timeout),
        ("idle_in_transaction_timeout", idle_in_transaction_timeout),
    ):
        if problem := session_timeout_problem(value):
            raise ValueError(f"{name}: {problem}")
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
    """`session_settings` from the [database] table. (A stock PgBouncer passes on only
    application_name, client_encoding, DateStyle, TimeZone and
    standard_conforming_strings at startup, and refuses a connection that sends any
    other parameter unless its operator lists it in ignore_startup_parameters: see
    `settings_options`.)"""
    database = config.database
    return session_settings(
        database.statement_timeout, database.idle_in_transaction_session_timeout,
        application_name,
    )  # fmt: skip


class _Route(NamedTuple):
    """How one connection reaches PostgreSQL: its DSN and what sits in between."""

    dsn: str
    pooler: Pooler


def _pool_route(config: Config) -> _Route:
    return _Route(config.require_dsn(), config.database.pooler)


def _session_route(config: Config) -> _Route:
    """database.leader_dsn is a direct connection (or a session-mode pool, which behaves
    as one for what a session needs); without it, the pool's DSN and its pooler."""
    if config.database.leader_dsn is not None:
        return _Route(config.database.leader_dsn, "none")
    return _pool_route(config)


def statement_cache_options(pooler: Pooler) -> dict[str, Any]:
    """asyncpg options for connections through `pooler`. Through a transaction pooler a
    client's consecutive transactions run on different server connections, so a
    statement prepared in one is unknown in the next (PgBouncer < 1.21 does not track
    them): asyncpg then prepares each statement unnamed, with no cache."""
    return {"statement_cache_size": 0} if pooler == "transaction" else {}


def command_timeout(statement_timeout: timedelta, pooler: Pooler) -> dict[str, Any]:
    """asyncpg's client-side bound on a statement's answer, for statement_timeout."""
    timeout_s = statement_timeout.total_seconds()
    if timeout_s <= 0:
        return {}
    if pooler == "transaction":
        # statement_timeout cannot be set on a server connection that other clients
        # share: asyncpg cancels a statement that runs longer (PgBouncer forwards the
        # cancel request to the server connection running it).
        return {"command_timeout": timeout_s}
    # A backstop for the server's statement_timeout: a statement sent into a network
    # partition gets no answer, and TCP may retransmit for many minutes before giving
    # up; past this the connection is dropped for a fresh one.
    return {"command_timeout": timeout_s + COMMAND_TIMEOUT_GRACE_S}


def settings_options(
    settings: Mapping[str, str],
    pooler: Pooler,
    statement_timeout: timedelta,
    *,
    bounded: bool = True,
) -> dict[str, Any]:
    """asyncpg.connect / create_pool options that give each connection `settings`
    (from `session_settings`) through `pooler`: as startup parameters directly; through
    a pooler only the name at startup, the rest SET once connected in session mode
    (the options then hold an `init`), and in transaction mode none (a SET would stay on
    a server connection other clients share: statement_timeout becomes the client's
    bound). `bounded`: with the client-side bound on a statement's answer."""
    if pooler == "none":
        options: dict[str, Any] = {"server_settings": dict(settings)}
    else:
        name = settings.get("application_name", "pgjobd")
        options = {"server_settings": {"application_name": name}}
        options.update(statement_cache_options(pooler))
        if pooler == "session":
            rest = {k: v for k, v in settings.items() if k != "application_name"}
            options["init"] = functools.partial(_set_settings, settings=rest)
    if bounded:
        options.update(command_timeout(statement_timeout, pooler))
    return options


async def _set_settings(conn: asyncpg.Connection, settings: Mapping[str, str]) -> None:
    for name, value in settings.items():
        await conn.execute("SELECT set_config($1, $2, false)", name, value)


def _route_options(
    config: Config,
    pooler: Pooler,
    application_name: str,
    *,
    bounded: bool = True,
    extra_settings: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "timeout": config.database.connect_timeout.total_seconds(),
        **settings_options(
            {**server_settings(config, application_name), **(extra_settings or {})}, pooler,
            config.database.statement_timeout, bounded=bounded,
        ),
    }  # fmt: skip


def connect_options(config: Config, application_name: str = "pgjobd") -> dict[str, Any]:
    """asyncpg.connect / create_pool options for the DSN and its pooler: the connect
    timeout, the session settings (or what a pooler takes of them), the statement cache
    and the client-side bound. Through a session-mode pool they hold an `init` to run
    on each new connection (create_pool and connect_session do)."""
    return _route_options(config, config.database.pooler, application_name)


async def create_pool(
    config: Config,
    *,
    max_size: int | None = None,
    reset: ConnectionHook | None = None,
    application_name: str = "pgjobd",
    generic_plans: bool = False,
    warm: ConnectionHook | None = None,
) -> asyncpg.Pool:
    """`generic_plans`: each prepared statement of the pool's sessions runs with the plan
    made for any parameters, planned once per session (plan_cache_mode). PostgreSQL's
    default plans anew at every execution a statement whose plan for its parameters'
    values it estimates cheaper; it does so for job_claim (its LIMIT and cursor) at every
    claim, which took about a third of the claim's server time (decisions.md, issue 17).
    tests/integration/test_plans.py checks each job-path statement's generic plan.
    Through a transaction-mode pooler no setting reaches the server (and asyncpg's
    statements there are unnamed, so planned at every execution anyway).

    `warm`: run on each connection the pool opens, before its first use (after the
    pooler's session setup, if any), to prepare there the statements its users need at
    once. A statement it runs that PostgreSQL refuses (a schema not migrated yet) is left
    for its users to meet: the connection is kept, cold. Not through a transaction-mode
    pooler, where nothing prepared stays with a connection."""
    pool_max = max_size or config.database.pool_max
    options = _route_options(
        config, config.database.pooler, application_name,
        extra_settings=GENERIC_PLANS if generic_plans else None,
    )  # fmt: skip
    if warm is not None and config.database.pooler != "transaction":
        options["init"] = _warming(options.get("init"), warm)
    pool: asyncpg.Pool = await asyncpg.create_pool(
        config.require_dsn(),
        min_size=min(config.database.pool_min, pool_max),
        max_size=pool_max,
        reset=reset,
        **options,
    )
    return pool


def _warming(init: ConnectionHook | None, warm: ConnectionHook) -> ConnectionHook:
    async def init_and_warm(conn: asyncpg.Connection) -> None:
        if init is not None:
            await init(conn)
        with contextlib.suppress(asyncpg.PostgresError):
            await warm(conn)

    return init_and_warm


async def connect(
    config: Config, application_name: str, *, session: bool, bounded: bool = True
) -> asyncpg.Connection:
    """One connection, not from any pool, named e.g. "pgjobd listener": with `session`
    on database.leader_dsn when set (the leader's lock, LISTEN, migrate, DDL with session
    state), else on the DSN and its pooler. Not `bounded`: no client-side limit on a
    statement's answer (migrate's, which set their own statement_timeout)."""
    route = _session_route(config) if session else _pool_route(config)
    options = _route_options(config, route.pooler, application_name, bounded=bounded)
    init = options.pop("init", None)
    conn: asyncpg.Connection = await asyncpg.connect(route.dsn, **options)
    if init is not None:
        try:
            await init(conn)
        except BaseException:
            conn.terminate()
            raise
    return conn


async def connect_session(config: Config, application_name: str) -> asyncpg.Connection:
    """A dedicated session that must stay one session: on database.leader_dsn when set."""
    return await connect(config, application_name, session=True)


def acquire(pool: asyncpg.Pool) -> Acquired:
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
    return Acquired(pool)


class Acquired:
    """`async with acquire(pool) as conn` (a class rather than a generator: every
    statement of the job path goes through one)."""

    __slots__ = ("_conn", "_pool")

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> asyncpg.Connection:
        self._conn = await self._pool.acquire()
        return self._conn

    async def __aexit__(
        self, exc_type: type[BaseException] | None, e: BaseException | None, tb: object
    ) -> None:
        pool, conn = self._pool, cast(asyncpg.Connection, self._conn)
        self._conn = None
        if e is None or isinstance(e, asyncpg.PostgresError):
            await pool.release(conn)
        elif isinstance(e, TimeoutError):
            # A statement over command_timeout (the statement_timeout of a transaction
            # pooler's connections): asyncpg has sent a cancel request. Wait, briefly,
            # for the server to act on it, or the statement runs on after the client is
            # gone; release terminates the connection if the wait runs out.
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await pool.release(conn, timeout=CANCEL_WAIT_S)
        else:
            # The pool takes the slot back and connects afresh on a later acquire. (A
            # connection already closed went back to the pool: its proxy refuses.)
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()
