"""Real `pgjobd run` members on a temporary config, this directory's handlers and the
test's own schema. Tests wait on database state, never on fixed sleeps.

With PGJOBD_TEST_POOLER=pgbouncer, the members' pools and the tests' clients go through
a stock PgBouncer in transaction mode (the members' leader and LISTEN sessions straight
to the server, on database.leader_dsn); `pytest -m core tests/e2e` is that leg.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from anyio.abc import Process

from pgjobd import Client
from pgjobd.config import Pooler
from pgjobd.pgbouncer import PgBouncer, find_program

HANDLERS = Path(__file__).parent / "handlers"
POOLER_VAR = "PGJOBD_TEST_POOLER"


@dataclass(frozen=True)
class Route:
    """How members' pools and the tests' clients reach the server: `dsn` through
    `pooler`; members' sessions (leader, LISTEN) use `leader_dsn` when it is set."""

    dsn: str
    pooler: Pooler = "none"
    leader_dsn: str | None = None

    def database_toml(self) -> str:
        if self.pooler == "none":
            return ""
        return f'pooler = "{self.pooler}"\nleader_dsn = "{self.leader_dsn}"\n'


@pytest.fixture(scope="session")
def pgbouncer(request: pytest.FixtureRequest) -> PgBouncer | None:
    """The session's PgBouncer when PGJOBD_TEST_POOLER=pgbouncer."""
    wanted = os.environ.get(POOLER_VAR, "")
    if wanted not in ("", "pgbouncer"):
        raise pytest.UsageError(f'{POOLER_VAR}: expected "pgbouncer" or unset, got {wanted!r}')
    if not wanted:
        return None
    find_program()  # the leg asked for: an error, not a skip, where it is not installed
    bouncer: PgBouncer = request.getfixturevalue("stock_pgbouncer")
    return bouncer


@pytest.fixture
def route(dsn: str, pgbouncer: PgBouncer | None) -> Route:
    if pgbouncer is None:
        return Route(dsn)
    return Route(pgbouncer.dsn(), "transaction", leader_dsn=dsn)


@pytest.fixture
async def client(route: Route, schema: str) -> AsyncIterator[Client]:
    """A Client on the test's schema, through the pooler in the PgBouncer leg."""
    async with await Client.connect(route.dsn, schema=schema, pooler=route.pooler) as c:
        yield c


class MemberProcess:
    def __init__(self, process: Process, log_path: Path) -> None:
        self.process = process
        self.log_path = log_path
        # Signals go through a pidfd, not process.send_signal: that polls the child
        # first (subprocess.Popen.send_signal) and so can reap it under asyncio's child
        # watcher, which then reports exit code 255 for a member that exited 0.
        # A child that ended quickly may already be reaped by the watcher: no pidfd, and
        # nothing to signal.
        self._pidfd: int | None = None
        with contextlib.suppress(ProcessLookupError):
            self._pidfd = os.pidfd_open(process.pid)
            weakref.finalize(self, os.close, self._pidfd)

    @property
    def watched(self) -> bool:
        """Whether the member was still there to watch (a pidfd is held) when wrapped."""
        return self._pidfd is not None

    def send_signal(self, sig: int) -> None:
        """Signal the member unless it has ended; never another process that took its pid."""
        if self._pidfd is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        self.send_signal(sig)
        with anyio.move_on_after(timeout_s):
            return await self.process.wait()
        self.process.kill()
        await self.process.wait()
        raise AssertionError(f"member did not stop within {timeout_s}s:\n{self.log[-3000:]}")


async def run_member(config: Path, dsn: str, log_path: Path) -> MemberProcess:
    """`pgjobd run --config CONFIG` against DSN, its output in LOG_PATH (for tests that
    bring their own server, such as a private cluster they stop)."""
    with log_path.open("wb") as log_file:
        process = await anyio.open_process(
            [sys.executable, "-m", "pgjobd", "run", "--config", str(config)],
            stdout=log_file, stderr=log_file, env={**os.environ, "PGJOBD_DSN": dsn},
        )  # fmt: skip
    return MemberProcess(process, log_path)


async def wait_until(
    check: Callable[[], Any], timeout_s: float = 20, what: str = "condition"
) -> Any:
    """Polls `check` (a query, or a plain function) until it gives something truthy."""
    with anyio.fail_after(timeout_s):
        while True:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
            await anyio.sleep(0.02)
    raise AssertionError(what)  # pragma: no cover


DEFAULT_QUEUES = """
[queues.default]
concurrency = 8
processes = 2
backoff_base = "0s"
backoff_max = "10ms"

[queues.other]
concurrency = 2
processes = 1
"""


@pytest.fixture
async def start_member(
    route: Route, schema: str, conn: asyncpg.Connection, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[MemberProcess]]]:
    started: list[MemberProcess] = []

    async def start(
        queues: str = DEFAULT_QUEUES, daemon: str = "", handlers: Path = HANDLERS,
        wait_ready: bool = True, server_dsn: str | None = None, new_session: bool = False,
        env: dict[str, str] | None = None,
    ) -> MemberProcess:  # fmt: skip
        index = len(started)
        # Defaults for what `daemon` does not set itself.
        defaults = {"drain_timeout": '"10s"', "metrics_listen": '""', "log_format": '"text"'}
        settings = "".join(f"{k} = {v}\n" for k, v in defaults.items() if k not in daemon)
        config = tmp_path / f"member{index}.toml"
        # A test's own server is reached directly.
        database = "" if server_dsn else route.database_toml()
        config.write_text(
            f'[database]\nschema = "{schema}"\n{database}\n'
            f'[daemon]\nhandlers = ["{handlers}"]\n{settings}{daemon}\n{queues}'
        )
        log_path = tmp_path / f"member{index}.log"
        environ = {**os.environ, "PGJOBD_DSN": server_dsn or route.dsn, **(env or {})}
        environ.pop("DATABASE_URL", None)
        with log_path.open("wb") as log_file:
            process = await anyio.open_process(
                [sys.executable, "-m", "pgjobd", "run", "--config", str(config)],
                stdout=log_file, stderr=log_file, env=environ, start_new_session=new_session,
            )  # fmt: skip
        member = MemberProcess(process, log_path)
        started.append(member)
        if wait_ready:
            await wait_until(lambda: _ready(conn, schema, process.pid, member), what="member ready")
        return member

    yield start
    for member in started:
        if member.process.returncode is None:
            await member.stop(signal.SIGKILL)


async def _ready(conn: asyncpg.Connection, schema: str, pid: int, member: MemberProcess) -> bool:
    if member.process.returncode is not None:
        raise AssertionError(f"member exited {member.process.returncode}:\n{member.log[-3000:]}")
    found = await conn.fetchval(f"SELECT count(*) FROM {schema}.member WHERE pid = $1", pid)
    return bool(found)


async def final_records(conn: asyncpg.Connection, schema: str) -> dict[int, asyncpg.Record]:
    rows = await conn.fetch(f"SELECT * FROM {schema}.job_history")
    return {row["id"]: row for row in rows}


async def wait_all_final(
    conn: asyncpg.Connection, schema: str, count: int, timeout_s: float = 30
) -> dict[int, asyncpg.Record]:
    async def done() -> dict[int, asyncpg.Record] | None:
        records = await final_records(conn, schema)
        return records if len(records) >= count else None

    records: dict[int, asyncpg.Record] = await wait_until(
        done, timeout_s, what=f"{count} final records"
    )
    return records
