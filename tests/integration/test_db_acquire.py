"""db.acquire: a connection whose use ended in anything but an error PostgreSQL
reported is closed, not kept for the pool.

A TCP proxy between the pool and the server stands in for a server that is restarting
or out of reach: once cut, it takes connections but answers nothing, so a cancel
request sent to it is never confirmed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg
import pytest

from pgjobd import db
from pgjobd.client import skip_session_reset
from pgjobd.config import Config, DatabaseConfig, Duration

pytestmark = pytest.mark.anyio
# The statement these tests interrupt. A backend whose client vanished mid-statement
# sleeps on until it next writes to the socket: it would hold the xmin horizon (and
# look like a culprit to the horizon tests) for half a minute after its test.
LONG_SLEEP = "SELECT pg_sleep(30) /* pgjobd test_db_acquire */"


@pytest.fixture(autouse=True)
async def end_interrupted_statements(dsn: str) -> AsyncIterator[None]:
    yield
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE query = $1 AND pid <> pg_backend_pid()",
            LONG_SLEEP,
        )
    finally:
        await admin.close()


class CuttableProxy:
    """Forwards TCP both ways until cut; then drops what it reads and leaves new
    connections unanswered."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.cut = False
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Future[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        if self.cut:
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers.append(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pump(source, sink))
            self.tasks.add(task)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                if not self.cut:
                    sink.write(data)
                    await sink.drain()
            sink.close()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in self.writers:
            writer.close()
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def proxy(dsn: str) -> AsyncIterator[tuple[CuttableProxy, str]]:
    parts = urlsplit(dsn)
    running = CuttableProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    port = await running.start()
    user = f"{parts.username}@" if parts.username else ""
    yield running, urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))
    await running.close()


async def _pool(dsn: str) -> asyncpg.Pool:
    pool: asyncpg.Pool = await asyncpg.create_pool(
        dsn, min_size=1, max_size=1, reset=skip_session_reset
    )
    return pool


async def test_a_statement_interrupted_while_the_server_is_away_frees_its_slot(
    proxy: tuple[CuttableProxy, str],
) -> None:
    # Regression (d1c1ca0, with pool.acquire): the one pool slot stayed taken by a
    # connection waiting for its cancel request to be confirmed; the acquire below,
    # after the server was back, waited in vain.
    cuttable, proxied_dsn = proxy
    pool = await _pool(proxied_dsn)
    try:
        with anyio.move_on_after(0.2):  # as a drain or a bounded attempt cancels
            async with db.acquire(pool) as conn:
                cuttable.cut = True
                await conn.execute(LONG_SLEEP)
        cuttable.cut = False
        with anyio.fail_after(15):
            async with db.acquire(pool) as conn:
                assert await conn.fetchval("SELECT 1") == 1
    finally:
        pool.terminate()


async def test_a_statement_whose_backend_was_terminated_leaves_the_pool_working(
    dsn: str, conn: asyncpg.Connection
) -> None:
    pool = await _pool(dsn)
    try:
        for _ in range(3):
            async with db.acquire(pool) as pooled:
                pid = pooled.get_server_pid()

            async def terminate(pid: int = pid) -> None:
                active = "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'"
                while not await conn.fetchval(active, pid):  # noqa: ASYNC110 (polls the server)
                    await anyio.sleep(0.01)
                await conn.execute("SELECT pg_terminate_backend($1)", pid)

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(terminate)
                    with pytest.raises((asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
                                        asyncpg.AdminShutdownError)):  # fmt: skip
                        async with db.acquire(pool) as pooled:
                            await pooled.execute(LONG_SLEEP)
                async with db.acquire(pool) as pooled:
                    assert pooled.get_server_pid() != pid
                    assert await pooled.fetchval("SELECT 1") == 1
    finally:
        pool.terminate()


async def test_a_cancelled_statement_leaves_the_pool_working(dsn: str) -> None:
    pool = await _pool(dsn)
    try:
        for _ in range(3):
            with anyio.move_on_after(0.05):
                async with db.acquire(pool) as conn:
                    await conn.execute(LONG_SLEEP)
            with anyio.fail_after(15):
                async with db.acquire(pool) as conn:
                    assert await conn.fetchval("SELECT 1") == 1
    finally:
        pool.terminate()


async def test_a_postgres_error_keeps_the_connection(dsn: str) -> None:
    pool = await _pool(dsn)
    try:
        async with db.acquire(pool) as conn:
            pid = conn.get_server_pid()
        with pytest.raises(asyncpg.DivisionByZeroError):
            async with db.acquire(pool) as conn:
                await conn.fetchval("SELECT 1 / 0")
        async with db.acquire(pool) as conn:
            assert conn.get_server_pid() == pid
    finally:
        pool.terminate()


async def test_a_connection_the_body_closed_itself_is_handled(dsn: str) -> None:
    pool = await _pool(dsn)
    try:
        with pytest.raises(KeyError):
            async with db.acquire(pool) as conn:
                conn.terminate()
                raise KeyError("the body's own error comes out")
        async with db.acquire(pool) as conn:
            conn.terminate()
        async with db.acquire(pool) as conn:
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        pool.terminate()


async def test_a_statement_sent_into_a_partition_is_given_up_and_the_pool_recovers(
    proxy: tuple[CuttableProxy, str],
) -> None:
    # Regression (issue 18, chaos `partition`): a member cut off for longer than its
    # lease kept statements waiting for answers that TCP retransmission would deliver
    # only minutes after the link came back; it resumed no work for over a minute after
    # the heal. A statement now waits at most statement_timeout + a grace.
    cuttable, proxied_dsn = proxy
    config = Config(
        database=DatabaseConfig(pool_min=1, pool_max=1, statement_timeout=Duration(seconds=1)),
        dsn=proxied_dsn,
    )
    pool = await db.create_pool(config)
    try:
        started = anyio.current_time()
        with pytest.raises(TimeoutError):
            async with db.acquire(pool) as conn:
                cuttable.cut = True  # nothing passes; the server never answers
                await conn.fetchval("SELECT 1")
        waited = anyio.current_time() - started
        assert waited < 1 + db.COMMAND_TIMEOUT_GRACE_S + db.CANCEL_WAIT_S + 5, waited
        cuttable.cut = False
        with anyio.fail_after(15):
            async with db.acquire(pool) as conn:
                assert await conn.fetchval("SELECT 1") == 1
    finally:
        pool.terminate()
