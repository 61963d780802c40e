"""The member's shutdown path against bad timing and hostile handlers, with the real
`pgjobd run`: a claim in flight when a drain or reload starts, a locked row during
lease renewal, SIGTERM to the whole process group, a second SIGTERM, and handlers
whose descendants leave their worker's process group."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd.queries import for_schema
from pgjobd.statements.job import AttemptKey

from .conftest import MemberProcess, wait_until
from .events import JSON_LOG, event_names, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]

QUEUES = """
[queues.default]
concurrency = 2
processes = 1
"""

HANDLERS = '''
import asyncio
import os
import time
from pathlib import Path

from pgjobd import JobContext, job


def _write(path: str, text: str) -> None:
    Path(path + ".tmp").write_text(text)
    os.replace(path + ".tmp", path)


@job(max_attempts=1)
async def quick(args: dict) -> str:
    return "done"


@job(max_attempts=1, timeout="120s")
def gated(args: dict) -> int:
    """Marks its start (with its pid), then waits for the release file."""
    _write(args["started"], str(os.getpid()))
    while not os.path.exists(args["release"]):
        time.sleep(0.01)
    return os.getpid()


@job(max_attempts=1, timeout="120s")
def spins(args: dict) -> None:
    """Never ends by itself (a def handler: its thread cannot be interrupted)."""
    _write(args["started"], str(os.getpid()))
    while True:
        time.sleep(0.01)


@job(max_attempts=5, timeout="120s")
async def watches(args: dict, ctx: JobContext) -> str:
    """Runs until its ctx.cancelled is set; marks both per attempt."""
    Path(args["dir"], f"started-{ctx.attempt}").touch()
    while not ctx.cancelled.is_set():
        await asyncio.sleep(0.01)
    Path(args["dir"], f"cancelled-{ctx.attempt}").touch()
    return "cancelled"


@job(max_attempts=1)
def double_forks(args: dict) -> str:
    """Leaves a grandchild behind in a session of its own, its parent gone."""
    read, write = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.close(write)
            time.sleep(3600)
            os._exit(0)
        os.write(write, str(pid).encode())
        os._exit(0)
    os.close(write)
    grandchild = int(os.read(read, 64))
    os.close(read)
    _write(args["pidfile"], str(grandchild))
    return "left behind"


@job(max_attempts=1)
def leaves_the_group(args: dict) -> str:
    """Starts a child that moves to a process group of its own, and completes."""
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        time.sleep(3600)
        os._exit(0)
    _write(args["pidfile"], str(pid))
    return "left behind"
'''


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


def handlers_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "hardening_handlers"
    directory.mkdir(exist_ok=True)
    (directory / "hardening.py").write_text(HANDLERS)
    return directory


async def enqueue(conn: asyncpg.Connection, schema: str, kind: str, args: object = None) -> int:
    job_id: int = await conn.fetchval(
        f"SELECT {schema}.enqueue($1, $2::jsonb)", kind, json.dumps(args or {})
    )
    return job_id


async def read_pid(path: Path) -> int:
    await wait_until(anyio.Path(path).exists, what=f"{path.name} written")
    return int(await anyio.Path(path).read_text())


async def exit_status(member: MemberProcess, timeout_s: float = 30) -> int:
    """Wait for a member that is stopping by itself (another signal would change how)."""
    with anyio.fail_after(timeout_s):
        return await member.process.wait()


# -- a claim in flight when the member stops claiming (bug 1) ---------------------------

HOOK_KEY = 746_001


@asynccontextmanager
async def claims_held_open(
    dsn: str, schema: str, conn: asyncpg.Connection
) -> AsyncIterator[asyncpg.Connection]:
    """Every claim waits, inside job_claim, until the yielded session lets go of an
    advisory lock, and ignores cancel requests meanwhile: a claim that was in flight
    commits whatever its caller does."""
    await conn.execute(f"""
        CREATE FUNCTION {schema}.hold_claim() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            LOOP
                BEGIN
                    PERFORM pg_advisory_xact_lock({HOOK_KEY});
                    EXIT;
                EXCEPTION WHEN query_canceled THEN
                    NULL;  -- the client gave up on the claim: it commits all the same
                END;
            END LOOP;
            RETURN NEW;
        END $$;
        CREATE TRIGGER hold_claim BEFORE UPDATE ON {schema}.job FOR EACH ROW
            WHEN (OLD.state = 'available' AND NEW.state = 'running')
            EXECUTE FUNCTION {schema}.hold_claim();
    """)  # fmt: skip
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", HOOK_KEY)
        yield holder
    finally:
        await holder.close()


async def claim_waiting(conn: asyncpg.Connection) -> bool:
    waiting: int = await conn.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = $1",
        HOOK_KEY,
    )
    return waiting > 0


async def ran_once_or_given_back(conn: asyncpg.Connection, schema: str, job_id: int) -> str:
    """'completed' (it ran, on its first attempt) or 'available' (given back, its
    attempt not charged); anything else fails the test."""
    attempts = await conn.fetchval(
        f"SELECT count(*) FROM {schema}.job_attempt WHERE job_id = $1", job_id
    )
    assert attempts == 0, "an attempt was charged to a job no handler started"
    done = await conn.fetchrow(
        f"SELECT state::text, attempt FROM {schema}.job_history WHERE id = $1", job_id
    )
    if done is not None:
        assert (done["state"], done["attempt"]) == ("completed", 1)
        return "completed"
    live = await conn.fetchrow(
        f"SELECT state::text, attempt, owner FROM {schema}.job WHERE id = $1", job_id
    )
    assert live is not None
    assert (live["state"], live["attempt"], live["owner"]) == ("available", 0, None), (
        f"stranded: {dict(live)}"
    )
    return "available"


@pytest.mark.core
async def test_a_claim_in_flight_at_sigterm_is_handed_over_not_stranded(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    """At d1c1ca0 the drain cancelled the producer inside job_claim: the claim
    committed, its job stayed `running` under a member that left (for the reaper to
    charge an attempt and, at max_attempts = 1, bury it unrun)."""
    async with claims_held_open(dsn, schema, conn) as holder:
        member = await start_member(QUEUES, daemon=JSON_LOG, handlers=handlers_dir(tmp_path))
        job_id = await enqueue(conn, schema, "quick")
        await wait_until(lambda: claim_waiting(conn), what="a claim in flight")
        member.send_signal(signal.SIGTERM)
        await wait_for_event(member, "member.draining")
        await holder.execute("SELECT pg_advisory_unlock($1)", HOOK_KEY)
        assert await member.stop() == 0
    assert await ran_once_or_given_back(conn, schema, job_id) in ("completed", "available")


@pytest.mark.core
async def test_a_claim_in_flight_at_reload_is_handed_over_not_stranded(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    """At d1c1ca0 a reload cancelled the old generation's producer inside job_claim:
    its job stayed `running`, unrenewed, until the reaper charged it an attempt."""
    async with claims_held_open(dsn, schema, conn) as holder:
        member = await start_member(
            QUEUES, daemon='lease = "2s"\n' + JSON_LOG, handlers=handlers_dir(tmp_path)
        )
        job_id = await enqueue(conn, schema, "quick")
        await wait_until(lambda: claim_waiting(conn), what="a claim in flight")
        member.send_signal(signal.SIGHUP)
        await wait_for_event(member, "member.reloaded")
        await holder.execute("SELECT pg_advisory_unlock($1)", HOOK_KEY)

        async def settled() -> bool:
            final = await conn.fetchval(
                f"SELECT count(*) FROM {schema}.job_history WHERE id = $1", job_id
            )
            return bool(final)

        await wait_until(settled, timeout_s=30, what="the job ran")
        assert await ran_once_or_given_back(conn, schema, job_id) == "completed"
        assert member.process.returncode is None
        assert await member.stop() == 0


# -- lease renewal and a locked row (item 7b) --------------------------------------------


async def test_lease_renewal_skips_a_row_another_transaction_holds(
    dsn: str, schema: str, conn: asyncpg.Connection
) -> None:
    """One locked row must not stall the renewal of every lease of the member: it is
    skipped, reported as still held (not lost), and the others are renewed. At
    d1c1ca0 the renewal waited for the lock."""
    q = for_schema(schema)
    for _ in range(3):
        await enqueue(conn, schema, "quick")
    claimed = await q.job_claim(conn, "default", 3, "m1", timedelta(seconds=30))
    (locked, free, gone) = sorted(AttemptKey(row.id, row.fence) for row in claimed)
    await conn.execute(f"DELETE FROM {schema}.job WHERE id = $1", gone[0])  # reaped, say
    other = await asyncpg.connect(dsn)
    try:
        async with other.transaction():
            await other.execute(f"SELECT FROM {schema}.job WHERE id = $1 FOR UPDATE", locked[0])
            with anyio.fail_after(10):
                rows = await q.job_lease_renew(conn, "m1", [locked, free, gone], timedelta(hours=1))
    finally:
        await other.close()
    returned = {(row.id, row.fence): row.renewed for row in rows}
    assert returned == {locked: False, free: True}  # `gone` is the only one lost
    query = f"SELECT id, lease_expires_at - now() > '10 minutes' FROM {schema}.job"
    leases = {row[0]: row[1] for row in await conn.fetch(query)}
    assert leases == {locked[0]: False, free[0]: True}


async def test_a_job_claimed_again_by_its_member_keeps_its_live_attempt(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    """Bug 3: the reaper took the job from this member while its attempt ran on, and
    the same member claimed it again. The stale attempt is cancelled as lost; the live
    one is renewed and runs on. At d1c1ca0 both were held by id: the new attempt
    replaced the old one, which was never cancelled."""
    member = await start_member(
        QUEUES, daemon='lease = "2s"\ndrain_timeout = "1s"\n', handlers=handlers_dir(tmp_path)
    )
    marks = anyio.Path(tmp_path)
    job_id = await enqueue(conn, schema, "watches", {"dir": str(tmp_path)})
    await wait_until((marks / "started-1").exists, what="attempt 1 started")
    await conn.execute(  # what the reaper does to a job whose lease ran out
        f"UPDATE {schema}.job SET state = 'available', fence = NULL, owner = NULL,"
        f" lease_expires_at = NULL WHERE id = $1",
        job_id,
    )
    await wait_until((marks / "started-2").exists, what="attempt 2 started")
    await wait_until((marks / "cancelled-1").exists, what="the stale attempt cancelled")
    fence = await conn.fetchval(f"SELECT fence FROM {schema}.job WHERE id = $1", job_id)
    for _ in range(2):  # two renewals of the live attempt's lease
        before = await conn.fetchval(
            f"SELECT lease_expires_at FROM {schema}.job WHERE id = $1", job_id
        )

        async def renewed(before: object = before) -> bool:
            now = await conn.fetchval(
                f"SELECT lease_expires_at FROM {schema}.job WHERE id = $1 AND fence = $2",
                job_id,
                fence,
            )
            return bool(now is not None and now > before)

        await wait_until(renewed, what="the live attempt's lease renewed")
    assert not await (marks / "cancelled-2").exists()
    assert await exit_status_after_sigterm(member) == 0


async def exit_status_after_sigterm(member: MemberProcess) -> int:
    member.send_signal(signal.SIGTERM)
    return await exit_status(member)


# -- signals at bad moments (item 5) -----------------------------------------------------


async def test_sigterm_to_the_whole_process_group_starts_no_replacement_workers(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    """`timeout` and some init systems signal every process of the group: the workers
    must not stop behind the member's back, nor be replaced mid-drain. At d1c1ca0 the
    idle worker took the SIGTERM, exited, and the pool started a new one."""
    started, release = tmp_path / "started", tmp_path / "release"
    queues = QUEUES.replace("processes = 1", "processes = 2")
    member = await start_member(
        queues, daemon=JSON_LOG, handlers=handlers_dir(tmp_path), new_session=True
    )
    job_id = await enqueue(
        conn, schema, "gated", {"started": str(started), "release": str(release)}
    )
    await read_pid(started)
    os.killpg(member.process.pid, signal.SIGTERM)
    await wait_for_event(member, "member.draining")
    await anyio.sleep(1.0)  # room for a worker to exit and be replaced (the bug)
    release.touch()
    assert await exit_status(member) == 0
    assert "worker.replaced" not in event_names(member), member.log[-3000:]
    state = await conn.fetchval(
        f"SELECT state::text FROM {schema}.job_history WHERE id = $1", job_id
    )
    assert state == "completed"


@pytest.mark.parametrize("how", ["second_sigterm", "drain_timeout"])
async def test_no_handler_runs_once_its_job_was_given_back(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path, how: str
) -> None:
    """The worker holding the job is killed first, then the job given back. At d1c1ca0
    the job was given back while its handler still ran (for the pool's grace period,
    or on)."""
    started = tmp_path / "started"
    drain = '"60s"' if how == "second_sigterm" else '"1s"'
    member = await start_member(
        QUEUES, daemon=f"drain_timeout = {drain}\n" + JSON_LOG, handlers=handlers_dir(tmp_path)
    )
    job_id = await enqueue(conn, schema, "spins", {"started": str(started)})
    worker = await read_pid(started)
    member.send_signal(signal.SIGTERM)
    if how == "second_sigterm":
        await wait_for_event(member, "member.draining")
        member.send_signal(signal.SIGTERM)

    async def given_back() -> bool:
        state = await conn.fetchval(f"SELECT state::text FROM {schema}.job WHERE id = $1", job_id)
        return state == "available"

    await wait_until(given_back, what="the job given back")
    assert not alive(worker), "the handler still runs after its job was given back"
    assert await exit_status(member) == 0
    row = await conn.fetchrow(f"SELECT attempt, owner FROM {schema}.job WHERE id = $1", job_id)
    assert (row["attempt"], row["owner"]) == (0, None)


# -- descendants that leave their worker's process group (item 4) -----------------------


async def test_an_orphan_a_handler_left_behind_is_killed_while_the_member_runs(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    """A double fork into a session of its own escapes the worker's process group; the
    member, a child subreaper, inherits the orphan and kills it."""
    pidfile = tmp_path / "orphan"
    member = await start_member(QUEUES, handlers=handlers_dir(tmp_path))
    await enqueue(conn, schema, "double_forks", {"pidfile": str(pidfile)})
    orphan = await read_pid(pidfile)
    await wait_until(lambda: not alive(orphan), what="the orphan killed")
    assert member.process.returncode is None
    assert await member.stop() == 0


async def test_nothing_a_handler_started_outlives_the_member(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    """A child that moved to a process group of its own outlives its worker's group
    kill; it is the member's to end when the worker goes."""
    pidfile = tmp_path / "escaped"
    member = await start_member(QUEUES, handlers=handlers_dir(tmp_path))
    job_id = await enqueue(conn, schema, "leaves_the_group", {"pidfile": str(pidfile)})
    escaped = await read_pid(pidfile)

    async def completed() -> bool:
        return bool(
            await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history WHERE id = $1", job_id)
        )

    await wait_until(completed, what="the job completed")
    assert alive(escaped)  # its worker lives on, and so may what it started
    assert await member.stop() == 0
    assert not alive(escaped), "a process a handler started outlived the member"
