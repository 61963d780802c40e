"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from pgjobd import migrate
from tests.logins import create_logins, drop_roles


@pytest.fixture
async def logins(conn: asyncpg.Connection, schema: str) -> AsyncIterator[dict[str, str]]:
    """`migrate --roles`, and one login role per group role that holds only that group
    (tests.logins.create_logins)."""
    await migrate.migrate(conn, schema, roles=True)
    try:
        yield await create_logins(conn, schema)
    finally:
        await drop_roles(conn, schema)


@pytest.fixture
async def producer_login(logins: dict[str, str]) -> str:
    """A login role whose only privilege is membership in <schema>_producer."""
    return logins["producer"]
