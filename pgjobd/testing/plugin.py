"""The pytest plugin of the testing kit (entry point `pgjobd`, loaded wherever pgjobd is
installed): fixtures for tests of applications that enqueue jobs and of their handlers.

- `pgjobd_dsn` (session): `$PGJOBD_TEST_DSN`, else a private embedded PostgreSQL
  cluster started on first use and removed at the end of the session.
- `pgjobd_client`: a `Client` on a fresh, migrated schema of its own, dropped after the
  test; the handlers' kinds are declared in it as a member's workers declare them.
- `pgjobd_drain`: `await pgjobd_drain(queue=None, fast_forward=False)` runs every due
  job of that schema inline (pgjobd.testing.drain) and returns the outcomes.
- `pgjobd_handlers` (session): the Registry of the configured handler directories:
  the ini option `pgjobd_handlers` (paths relative to the ini file), else the
  `daemon.handlers` of the TOML file named by `$PGJOBD_CONFIG`; that file also gives the
  drain the queues' settings and the middleware.

Async fixtures: use them from tests marked `pytest.mark.anyio` (the asyncio backend).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pgjobd.config import Config
from pgjobd.handler_loader import Registry

INI_HANDLERS = "pgjobd_handlers"

Drain = Callable[..., Awaitable[list[Any]]]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        INI_HANDLERS,
        type="paths",
        default=[],
        help="pgjobd handler directories for the pgjobd_drain fixture (relative to this "
        "file); default: daemon.handlers of the config named by $PGJOBD_CONFIG",
    )


@pytest.fixture(scope="session")
def pgjobd_dsn() -> Iterator[str]:
    """The DSN of the PostgreSQL server the pgjobd fixtures use."""
    from_env = os.environ.get("PGJOBD_TEST_DSN")
    if from_env:
        yield from_env
        return
    from pgjobd.embedded import Cluster  # noqa: PLC0415 (only when there is no server)

    with Cluster.throwaway() as cluster:
        yield cluster.dsn()


@pytest.fixture(scope="session")
def pgjobd_config() -> Config:
    """The configuration named by $PGJOBD_CONFIG, else the built-in defaults (whose
    handler directories are not used: see pgjobd_handlers)."""
    from pgjobd import config  # noqa: PLC0415

    path = os.environ.get("PGJOBD_CONFIG")
    return config.load(path) if path else Config(daemon=config.DaemonConfig(handlers=()))


@pytest.fixture(scope="session")
def pgjobd_handlers(pytestconfig: pytest.Config, pgjobd_config: Config) -> Registry:
    """The handlers of the configured directories (empty when none are configured)."""
    from pgjobd.handler_loader import load_directories  # noqa: PLC0415

    directories: list[Path] = list(pytestconfig.getini(INI_HANDLERS))
    if not directories:
        directories = list(pgjobd_config.daemon.handlers)
    return load_directories(directories)


@pytest.fixture
async def pgjobd_client(
    pgjobd_dsn: str, pgjobd_handlers: Registry, pgjobd_config: Config
) -> AsyncIterator[Any]:
    """A Client on a fresh schema of its own, dropped after the test."""
    import asyncpg  # noqa: PLC0415

    from pgjobd import testing  # noqa: PLC0415
    from pgjobd.client import Client  # noqa: PLC0415
    from pgjobd.db import session_settings  # noqa: PLC0415
    from pgjobd.migrate import migrate  # noqa: PLC0415

    schema = f"pgjobd_test_{uuid.uuid4().hex[:12]}"
    database = pgjobd_config.database
    admin = await asyncpg.connect(
        pgjobd_dsn,
        server_settings=session_settings(
            database.statement_timeout, database.idle_in_transaction_session_timeout,
            "pgjobd testing",
        ),
    )  # fmt: skip
    try:
        await migrate(admin, schema)
        client = await Client.connect(pgjobd_dsn, schema=schema, min_size=1, max_size=4)
        previous, testing.current.client = testing.current.client, client
        try:
            await testing.declare_kinds(client, pgjobd_handlers, pgjobd_config.queues)
            yield client
        finally:
            testing.current.client = previous
            await client.close()
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.close()


@pytest.fixture
def pgjobd_drain(pgjobd_client: Any, pgjobd_handlers: Registry, pgjobd_config: Config) -> Drain:
    """`await pgjobd_drain(queue=None, *, fast_forward=False)`: run every due job of
    pgjobd_client's schema with the configured handlers; returns the outcomes."""
    from pgjobd import middleware, testing  # noqa: PLC0415

    if not pgjobd_handlers:
        raise pytest.UsageError(
            "pgjobd_drain: no handlers: name their directories in the ini option "
            f"{INI_HANDLERS} or in daemon.handlers of the file named by $PGJOBD_CONFIG"
        )
    chain = middleware.load(pgjobd_config.daemon.middleware)

    async def drain(
        queue: str | None = None,
        *,
        fast_forward: bool = False,
        max_runs: int = testing.DEFAULT_MAX_RUNS,
    ) -> list[testing.RunOutcome]:
        return await testing.drain(
            pgjobd_client, pgjobd_handlers, queue=queue, fast_forward=fast_forward,
            queues=pgjobd_config.queues, middleware=chain, max_runs=max_runs,
        )  # fmt: skip

    return drain
