"""Fixtures shared by every test: one PostgreSQL server per session, one schema per test.

The server is $PGJOBD_TEST_DSN when set (CI points it at a real server), otherwise a
throwaway embedded cluster started once for the session. Each test that needs the pgjobd
tables gets its own freshly migrated schema, dropped afterwards: no initdb per test.

A test that leaves a schema or a process behind fails (see `no_leaks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import asyncpg
import pytest

from pgjobd.config import Config, DatabaseConfig
from pgjobd.embedded import Cluster
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.migrate import migrate
from pgjobd.pgbouncer import PgBouncer, PgBouncerError, find_program
from pgjobd.queries import for_schema
from pgjobd.roles import RoleContext

# pytester: the testing kit's plugin is tested by running pytest on sample suites.
pytest_plugins = ("pytester",)


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
        session_pids = {cluster.pid} if cluster.pid is not None else set()
        SESSION_PIDS.update(session_pids)
        try:
            yield cluster.dsn()
        finally:
            SESSION_PIDS.difference_update(session_pids)


@pytest.fixture(scope="session")
def stock_pgbouncer(dsn: str) -> Iterator[PgBouncer]:
    """A PgBouncer with its stock settings in transaction mode in front of the session's
    server, for the whole session (skipped where pgbouncer is not installed)."""
    try:
        find_program()
    except PgBouncerError as e:
        pytest.skip(str(e))
    with PgBouncer.start(dsn) as bouncer:
        SESSION_PIDS.add(bouncer.pid)
        try:
            yield bouncer
        finally:
            SESSION_PIDS.discard(bouncer.pid)


@pytest.fixture(scope="session")
def pgjobd_dsn(dsn: str) -> str:
    """The testing kit's fixtures (pgjobd.testing.plugin) use the session's server
    instead of starting a cluster of their own."""
    return dsn


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


async def drop_schema(conn: asyncpg.Connection, name: str) -> None:
    """DROP SCHEMA ... CASCADE that cannot hang the suite: a member killed at the end of
    its test may leave a backend finishing a statement on the schema's tables for a
    moment (in CI: the clock-skew test's leader mid partition DDL: a deadlock), and a
    test that failed may leave a session of its own in a transaction holding locks (a
    statement whose arguments asyncpg refused: the drop waited on it for 21 minutes).
    So the drop waits at most 5 s for a lock, then ends the sessions holding locks in
    the schema and tries again."""
    await conn.execute("SET lock_timeout = '5s'")
    try:
        for attempt in range(20):
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
                return
            except (asyncpg.DeadlockDetectedError, asyncpg.LockNotAvailableError):
                if attempt == 19:
                    raise
                await conn.execute(
                    "SELECT pg_terminate_backend(l.pid) FROM pg_locks AS l "
                    "JOIN pg_class AS c ON c.oid = l.relation "
                    "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = $1 AND l.pid <> pg_backend_pid() AND l.granted",
                    name,
                )
                await asyncio.sleep(0.25)
    finally:
        await conn.execute("RESET lock_timeout")


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
        await drop_schema(admin, schema_name)
        await admin.close()


@pytest.fixture
async def leading(dsn: str, schema: str) -> AsyncIterator[RoleContext]:
    """A role context whose term was begun by a session of ours holding the leader
    lock: a role's tick, run in the test's process, acts as the fleet's leader would."""
    session = await asyncpg.connect(dsn)
    key = lock_key(LEADER, schema)
    assert await session.fetchval("SELECT pg_try_advisory_lock($1, $2)", *key)
    queries = for_schema(schema)
    term = await queries.leader_term_begin(session, "test")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        yield RoleContext(
            pool, queries, Config(database=DatabaseConfig(schema=schema)), "test", term
        )
    finally:
        await pool.close()
        await session.close()


# -- leak checks: a test that leaves a schema or a process behind fails -----------------

# Fixtures that hand a test a schema name of its own: the schema must be gone afterwards.
SCHEMA_FIXTURES = ("schema_name", "schema", "scratch_schema")
# Processes alive for the whole session (the embedded cluster's postmaster): they and
# their descendants (its backends) are never a test's leak.
SESSION_PIDS: set[int] = set()
# Every process the tests start inherits this variable, which tells them from other
# pytest runs' on the same machine even once orphaned (reparented away from pytest).
LEAK_TOKEN_VAR = "PGJOBD_TEST_LEAK_TOKEN"
LEAK_TOKEN = f"{LEAK_TOKEN_VAR}={os.getpid()}-{uuid.uuid4().hex}"
os.environ[LEAK_TOKEN_VAR] = LEAK_TOKEN.partition("=")[2]
LEAK_GRACE_S = 10.0  # time for a process the test stopped to finish exiting


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    start: int  # clock ticks after boot: with the pid, names one process for good

    def cmdline(self) -> str:
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return "?"


def _read_stat(pid: str) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:  # gone since listed
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return Proc(int(pid), int(fields[1]), fields[0], int(fields[19]))


def _carries_token(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return LEAK_TOKEN.encode() in f.read().split(b"\0")
    except OSError:
        return False


def _subtree(roots: set[int], children: dict[int, list[int]]) -> set[int]:
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def started_processes() -> dict[tuple[int, int], Proc]:
    """Live processes the tests started: pytest's descendants, and processes carrying
    this run's token (orphans included), less the session's own; zombies are dead."""
    me = os.getpid()
    pids = [name for name in os.listdir("/proc") if name.isdigit()]
    table = [p for p in map(_read_stat, pids) if p is not None]
    own = next((p for p in table if p.pid == me), None)
    children: dict[int, list[int]] = {}
    for proc in table:
        children.setdefault(proc.ppid, []).append(proc.pid)
    descendants = _subtree({me}, children) - {me}
    exempt = _subtree(SESSION_PIDS, children)
    return {
        (p.pid, p.start): p
        for p in table
        if p.state != "Z" and p.pid != me and p.pid not in exempt
        and (p.pid in descendants or (own is not None and p.start >= own.start
                                      and _carries_token(p.pid)))
    }  # fmt: skip


def _left_behind(before: dict[tuple[int, int], Proc]) -> list[Proc]:
    """Processes started since `before` and still alive after LEAK_GRACE_S."""
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        new = [p for key, p in started_processes().items() if key not in before]
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


def _kill(processes: Sequence[Proc]) -> None:
    for proc in processes:
        again = _read_stat(str(proc.pid))
        if again is not None and again.start == proc.start:  # not a reused pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)


def _remaining_schemas(dsn: str, names: list[str]) -> list[str]:
    """Which of these schemas exist; they are dropped. On a thread of its own: the
    test's event loop (if any) must not be touched."""
    found: list[str] = []
    errors: list[BaseException] = []

    async def check() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                "SELECT nspname FROM pg_namespace WHERE nspname = ANY($1::text[])", names
            )
            found.extend(row["nspname"] for row in rows)
            for name in found:
                await drop_schema(conn, name)
        finally:
            await conn.close()

    def run() -> None:
        try:
            asyncio.run(check())
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="schema leak check")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return found


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test (at teardown, after its other fixtures ended) if a process it
    started is still alive, or a schema handed to it still exists. Leaked processes are
    killed and leaked schemas dropped, so that the next test starts clean."""
    before = started_processes()
    yield
    problems = []
    leaked = _left_behind(before)
    if leaked:
        _kill(leaked)
        problems.append(
            f"{len(leaked)} process(es) still alive {LEAK_GRACE_S:.0f}s after the test "
            "(killed now):\n"
            + "\n".join(f"  pid {p.pid} (parent {p.ppid}): {p.cmdline()}" for p in leaked)
        )
    funcargs = getattr(request.node, "funcargs", None) or {}
    names = sorted({str(funcargs[f]) for f in SCHEMA_FIXTURES if f in funcargs})
    if names and "dsn" in funcargs:
        remaining = _remaining_schemas(funcargs["dsn"], names)
        if remaining:
            problems.append(f"schema(s) left behind (dropped now): {', '.join(remaining)}")
    if problems:
        pytest.fail(f"{request.node.nodeid} leaked:\n" + "\n".join(problems), pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Processes alive once every fixture has ended (a leak by a module- or
    session-scoped fixture, which no single test's check sees)."""
    leaked = _left_behind({})
    if leaked:
        _kill(leaked)
        lines = "\n".join(f"  pid {p.pid} (parent {p.ppid}): {p.cmdline()}" for p in leaked)
        print(f"\nprocesses left behind by the test session (killed now):\n{lines}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
