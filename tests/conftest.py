"""Fixtures shared by every test: one PostgreSQL server per session, one schema per test.

The server is $PGJOBD_TEST_DSN when set (CI points it at a real server), otherwise a
throwaway embedded cluster started once for the session. Each test that needs the pgjobd
tables gets its own freshly migrated schema, dropped afterwards: no initdb per test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from pgjobd.config import Config, DatabaseConfig
from pgjobd.embedded import Cluster
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.migrate import migrate
from pgjobd.queries import for_schema
from pgjobd.roles import RoleContext


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def dsn() -> Iterator[str]:
    """DSN of the session's PostgreSQL server."""
    from_env = os.environ.get("PGJOBD_TEST_DSN")
    if from_env:
        yield from_env
        return
    with Cluster.throwaway() as cluster:
        yield cluster.dsn()


@pytest.fixture
async def conn(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(dsn)
    try:
        yield connection
    finally:
        await connection.close()


@pytest.fixture
def schema_name() -> str:
    """A schema name no other test uses; nothing is created."""
    return f"t_{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def schema(dsn: str, schema_name: str) -> AsyncIterator[str]:
    """A schema holding the pgjobd tables and functions, dropped after the test."""
    # A connection of its own, so that the drop works whatever state the test left
    # its connections in.
    admin = await asyncpg.connect(dsn)
    try:
        await migrate(admin, schema_name)
        yield schema_name
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema_name} CASCADE")
        await admin.close()


@pytest.fixture
async def leading(dsn: str, schema: str) -> AsyncIterator[RoleContext]:
    """A role context whose term was begun by a session of ours holding the leader
    lock: a role's tick, run in the test's process, acts as the fleet's leader would."""
    session = await asyncpg.connect(dsn)
    key = lock_key(LEADER, schema)
    assert await session.fetchval("SELECT pg_try_advisory_lock($1, $2)", *key)
    queries = for_schema(schema)
    term = await session.fetchval(queries["leader_term_begin"], "test")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        yield RoleContext(
            pool, queries, Config(database=DatabaseConfig(schema=schema)), "test", term
        )
    finally:
        await pool.close()
        await session.close()
