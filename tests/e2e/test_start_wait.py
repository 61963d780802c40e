"""A member started while its database (or the pooler in front of it) is not reachable
yet waits for it, up to database.start_wait, then exits 1 naming the error. Found by
the `pgbouncer` chaos scenario: a member restarted while PgBouncer restarted exited at
once with 'database error: ConnectionRefusedError'."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import asyncpg
import pytest

from pgjobd.embedded import free_port

from .conftest import HANDLERS, MemberProcess, run_member, wait_all_final, wait_until

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]


def _on_port(dsn: str, port: int) -> str:
    url = urlsplit(dsn)
    user = f"{url.username}@" if url.username else ""
    return urlunsplit((url.scheme, f"{user}127.0.0.1:{port}", url.path, url.query, ""))


@asynccontextmanager
async def forwarder(port: int, to_host: str, to_port: int) -> AsyncIterator[None]:
    """A TCP forwarder on `port`: the database's address appearing late."""

    async def pipe(source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream) -> None:
        try:
            async for chunk in source:
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            await sink.aclose()

    async def serve(client: anyio.abc.SocketStream) -> None:
        server = await anyio.connect_tcp(to_host, to_port)
        async with server, client, anyio.create_task_group() as tg:
            tg.start_soon(pipe, client, server)
            tg.start_soon(pipe, server, client)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield
        tg.cancel_scope.cancel()


async def test_a_member_started_before_its_database_answers_waits_for_it(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    port = free_port()
    member = await start_member(server_dsn=_on_port(dsn, port), wait_ready=False)
    # Tried again, not given up: the wait is logged at every try.
    await wait_until(lambda: member.log.count("db.unreachable_at_start") >= 3 or None,
                     what="the member trying again while it waits")  # fmt: skip
    assert member.process.returncode is None, member.log[-2000:]
    server = urlsplit(dsn)
    async with forwarder(port, server.hostname or "127.0.0.1", server.port or 5432):
        await wait_until(
            lambda: conn.fetchval(f"SELECT count(*) FROM {schema}.member WHERE pid = $1",
                                  member.process.pid),
            what="the member joining once the database answers",
        )  # fmt: skip
        job_id = await conn.fetchval(f"SELECT {schema}.enqueue('echo', '{{}}')")
        records = await wait_all_final(conn, schema, 1)
        assert records[job_id]["state"] == "completed"
        await member.stop()


async def test_a_member_whose_database_never_answers_exits_1_after_start_wait(
    dsn: str, schema: str, tmp_path: Path
) -> None:
    config = tmp_path / "pgjobd.toml"
    config.write_text(
        f'[database]\nschema = "{schema}"\nstart_wait = "2s"\n'
        f'[daemon]\nhandlers = ["{HANDLERS}"]\nmetrics_listen = ""\nlog_format = "text"\n'
    )
    started = time.monotonic()
    member = await run_member(config, _on_port(dsn, free_port()), tmp_path / "member.log")
    with anyio.fail_after(60):
        code = await member.process.wait()
    took = time.monotonic() - started
    assert code == 1, member.log[-2000:]
    assert "database error" in member.log and "db.unreachable_at_start" in member.log
    assert took >= 2, took
