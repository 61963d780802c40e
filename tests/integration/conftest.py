"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from pgjobd import migrate


@pytest.fixture
async def producer_login(dsn: str, conn: asyncpg.Connection, schema: str) -> AsyncIterator[str]:
    """A login role whose only privilege is membership in <schema>_producer."""
    await migrate.migrate(conn, schema, roles=True)
    login = f"{schema}_app"
    await conn.execute(f"CREATE ROLE {login} LOGIN")
    await conn.execute(f"GRANT {schema}_producer TO {login}")
    try:
        yield login
    finally:
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        for role in (
            login,
            *(f"{schema}_{r}" for r in ("producer", "readonly", "admin", "worker")),
        ):
            await conn.execute(f"DROP ROLE IF EXISTS {role}")
