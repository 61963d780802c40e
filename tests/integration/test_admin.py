"""The admin CLI (`pgjobd status/jobs/queues/dlq/cron`) as real processes against the
test's schema, and pgjobd.admin called directly: JSON shapes, effects, audit rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import anyio
import asyncpg
import msgspec
import pytest

from pgjobd import admin
from pgjobd.client import Client
from tests.e2e.conftest import MemberProcess, pgbouncer, route, start_member, wait_until

pytestmark = pytest.mark.anyio

__all__ = ["pgbouncer", "route", "start_member"]  # fixtures: imported to be used here

OS_USER = "admin-test-user"

# The fixed keys of contract §4, and what docs/cli.md adds to them.
STATUS_MEMBER_KEYS = {"id", "host", "pid", "leader", "started_at", "heartbeat_at"}
STATUS_MEMBER_DOCUMENTED = STATUS_MEMBER_KEYS | {"version", "uptime_s", "queues"}
STATUS_QUEUE_KEYS = {
    "available", "scheduled", "running", "retryable", "oldest_available_age_s", "paused",
}  # fmt: skip
STATUS_QUEUE_DOCUMENTED = STATUS_QUEUE_KEYS | {
    "dead_last_hour", "throughput_per_s", "limited", "blocked"
}  # fmt: skip
SHOW_KEYS = {
    "id", "kind", "queue", "state", "attempt", "max_attempts", "args", "result", "reason",
    "errors",
}  # fmt: skip

QUEUES = """
[queues.default]
concurrency = 4
processes = 1
backoff_base = "0s"
backoff_max = "10ms"

[queues.other]
concurrency = 1
processes = 1
"""

StartMember = Callable[..., Awaitable[MemberProcess]]


async def pgjobd(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    env["USER"] = OS_USER
    result = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", *args, "--dsn", dsn, "--schema", schema],
        env=env, check=False,
    )  # fmt: skip
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


async def pgjobd_json(dsn: str, schema: str, *args: str) -> Any:
    result = await pgjobd(dsn, schema, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


async def enqueue(conn: asyncpg.Connection, schema: str, kind: str = "echo", **options: Any) -> int:
    names = ", ".join(f"{name} => ${i}" for i, name in enumerate(options, start=3))
    sql = f"SELECT {schema}.enqueue($1, $2::jsonb{', ' if names else ''}{names})"
    job_id: int = await conn.fetchval(sql, kind, json.dumps({"n": 1}), *options.values())
    return job_id


async def bury(
    conn: asyncpg.Connection, schema: str, kind: str = "echo", *, state: str = "dead",
    queue: str = "default", attempt: int = 3, max_attempts: int = 3,
    unique_key: str | None = None, ago: str = "1 minute",
) -> int:  # fmt: skip
    """A final record of a job that never ran here (as the completer would write it)."""
    reasons = {"completed": None, "cancelled": "cancelled", "dead": "attempts_exhausted"}
    reason = reasons[state]
    job_id: int = await conn.fetchval(
        f"""INSERT INTO {schema}.job_history (id, finished_at, run_at, enqueued_at, attempt,
                max_attempts, priority, state, reason, queue, kind, unique_key, last_error, args)
            VALUES (nextval('{schema}.job_id_seq'), now() - $7::text::interval,
                    now() - interval '1h', now() - interval '1h', $1, $2, 0, $3, $4, $5, $6, $8,
                    'ValueError: boom', '{{"n": 1}}')
            RETURNING id""",
        attempt, max_attempts, state, reason, queue, kind, ago, unique_key,
    )  # fmt: skip
    return job_id


async def audit_rows(conn: asyncpg.Connection, schema: str) -> list[asyncpg.Record]:
    return await conn.fetch(f"SELECT * FROM {schema}.audit ORDER BY id")


async def history(conn: asyncpg.Connection, schema: str, job_id: int) -> list[asyncpg.Record]:
    return await conn.fetch(f"SELECT * FROM {schema}.job_history WHERE id = $1", job_id)


async def make_running(conn: asyncpg.Connection, schema: str, job_id: int) -> None:
    """As if a member had claimed it."""
    await conn.execute(
        f"""UPDATE {schema}.job SET state = 'running', owner = 'm-1', attempt = attempt + 1,
                fence = nextval('{schema}.fence_seq'), lease_expires_at = now() + interval '30s'
            WHERE id = $1""",
        job_id,
    )


# -- status ------------------------------------------------------------------------------


async def test_status_json_lists_live_members_leader_and_queues(
    dsn: str, conn: asyncpg.Connection, schema: str, start_member: StartMember
) -> None:
    member = await start_member(queues=QUEUES)
    ids = [await enqueue(conn, schema) for _ in range(3)]
    await wait_until(
        lambda: conn.fetchval(
            f"SELECT count(*) = 3 FROM {schema}.job_history WHERE id = ANY($1)", ids
        ),
        what="3 jobs completed",
    )
    await enqueue(conn, schema, queue="email", delay=timedelta(hours=1))
    await bury(conn, schema, queue="other")
    await bury(conn, schema, queue="other", ago="2 hours")  # not in the last hour
    await wait_until(
        lambda: conn.fetchval(f"SELECT count(*) FROM {schema}.leader"), what="a leader"
    )

    status = await pgjobd_json(dsn, schema, "status")
    plain = await pgjobd(dsn, schema, "status")

    assert set(status) == {"members", "leader", "queues", "breakers"}
    assert status["breakers"] == {}
    [listed] = status["members"]
    assert set(listed) == STATUS_MEMBER_DOCUMENTED and set(listed) >= STATUS_MEMBER_KEYS
    assert listed["pid"] == member.process.pid
    assert listed["leader"] is True
    assert sorted(listed["queues"]) == ["default", "other"]
    assert set(status["leader"]) == {"member", "term"}
    assert status["leader"]["member"] == listed["id"]
    assert isinstance(status["leader"]["term"], int)
    assert sorted(status["queues"]) == ["default", "email", "other"]
    for queue in status["queues"].values():
        assert set(queue) == STATUS_QUEUE_DOCUMENTED and set(queue) >= STATUS_QUEUE_KEYS
    default, email, other = (status["queues"][q] for q in ("default", "email", "other"))
    assert default["throughput_per_s"] == pytest.approx(3 / 60)
    assert default["oldest_available_age_s"] is None
    assert email["scheduled"] == 1 and email["oldest_available_age_s"] is None
    assert other["dead_last_hour"] == 1
    assert plain.returncode == 0, plain.stderr
    assert listed["id"] in plain.stdout and "default" in plain.stdout


async def test_status_with_no_members_and_an_available_backlog(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    await enqueue(conn, schema, queue="backlog")
    await conn.execute(
        f"UPDATE {schema}.job SET run_at = now() - interval '90 seconds' WHERE queue = 'backlog'"
    )
    await conn.execute(
        f"INSERT INTO {schema}.leader (member, backend_pid) VALUES ('gone', pg_backend_pid() + 1)"
    )

    status = await admin.status(conn, schema)

    assert status.members == [] and status.leader is None  # the term's session holds no lock
    backlog = status.queues["backlog"]
    assert backlog.available == 1 and not backlog.paused
    assert backlog.oldest_available_age_s is not None and backlog.oldest_available_age_s >= 90


# -- jobs --------------------------------------------------------------------------------


async def test_jobs_list_reads_live_and_final_jobs_with_filters(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    live = await enqueue(conn, schema, "a")
    other = await enqueue(conn, schema, "b", queue="other")
    dead = await bury(conn, schema, "a")

    everything = await pgjobd_json(dsn, schema, "jobs", "list")
    dead_a = await pgjobd_json(dsn, schema, "jobs", "list", "--state", "dead", "--kind", "a")
    available = await pgjobd_json(dsn, schema, "jobs", "list", "--state", "available")
    in_other = await pgjobd_json(dsn, schema, "jobs", "list", "--queue", "other")
    limited = await pgjobd_json(dsn, schema, "jobs", "list", "--limit", "1")
    bad = await pgjobd(dsn, schema, "jobs", "list", "--state", "sleeping")

    assert [j["id"] for j in everything["jobs"]] == [dead, other, live]
    assert [j["id"] for j in dead_a["jobs"]] == [dead]
    assert dead_a["jobs"][0]["reason"] == "attempts_exhausted"
    assert [j["id"] for j in available["jobs"]] == [other, live]
    assert [j["id"] for j in in_other["jobs"]] == [other]
    assert [j["id"] for j in limited["jobs"]] == [dead]
    assert bad.returncode == 2


async def test_jobs_show_json_is_the_clients_job_info(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    job_id = await bury(conn, schema, "a")
    client = Client(await asyncpg.create_pool(dsn, min_size=1, max_size=1), schema=schema)
    try:
        info = await client.job(job_id)
    finally:
        await client.pool.close()

    shown = await pgjobd_json(dsn, schema, "jobs", "show", str(job_id))
    missing = await pgjobd(dsn, schema, "jobs", "show", "987654321")

    assert info is not None
    assert set(shown) >= SHOW_KEYS
    assert shown == json.loads(msgspec.json.encode(info))
    assert shown["state"] == "dead" and shown["reason"] == "attempts_exhausted"
    assert missing.returncode == 1 and "987654321" in missing.stderr


async def test_cancel_of_a_pending_job_is_immediate_and_audited(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    pending = await enqueue(conn, schema, unique_key="once")
    scheduled = await enqueue(conn, schema, run_at=datetime(2100, 1, 1))

    done = await pgjobd_json(dsn, schema, "jobs", "cancel", str(pending), str(scheduled))

    assert done["action"] == "jobs.cancel"
    assert done["jobs"] == [
        {"id": pending, "outcome": "cancelled", "state": "available"},
        {"id": scheduled, "outcome": "cancelled", "state": "scheduled"},
    ]
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0
    for job_id in (pending, scheduled):
        [record] = await history(conn, schema, job_id)
        assert (record["state"], record["reason"]) == ("cancelled", "cancelled")
    shown = await pgjobd_json(dsn, schema, "jobs", "show", str(pending))
    assert (shown["state"], shown["reason"]) == ("cancelled", "cancelled")
    # A cancelled job frees its unique key.
    assert await enqueue(conn, schema, unique_key="once") != pending
    [row] = await audit_rows(conn, schema)
    assert row["id"] == done["audit_id"]
    assert row["db_role"] == await conn.fetchval("SELECT current_user")
    assert row["os_user"] == OS_USER
    assert row["action"] == "jobs.cancel" and row["target"] is None
    assert list(row["job_ids"]) == [pending, scheduled]


async def test_cancel_of_a_running_job_sets_the_flag_and_tells_its_member(
    conn: asyncpg.Connection, dsn: str, schema: str
) -> None:
    job_id = await enqueue(conn, schema)
    await make_running(conn, schema, job_id)
    heard: list[str] = []
    listener = await asyncpg.connect(dsn)
    await listener.add_listener(f"{schema}.job_cancel", lambda *a: heard.append(a[3]))
    try:
        outcome = await admin.cancel_jobs(conn, schema, [job_id], user="someone")
        await wait_until(lambda: heard, 5, "the job_cancel notification")
    finally:
        await listener.close()

    assert [(o.id, o.outcome, o.state) for o in outcome.jobs] == [
        (job_id, "cancel_requested", "running")
    ]
    row = await conn.fetchrow(
        f"SELECT state, cancel_requested FROM {schema}.job WHERE id = $1", job_id
    )
    assert tuple(row) == ("running", True)
    assert heard == [str(job_id)]


async def test_cancel_of_a_finished_job_changes_nothing(
    conn: asyncpg.Connection, schema: str
) -> None:
    job_id = await bury(conn, schema, state="completed")

    done = await admin.cancel_jobs(conn, schema, [job_id, job_id])

    assert [(o.outcome, o.state) for o in done.jobs] == [("already_final", "completed")]
    [record] = await history(conn, schema, job_id)
    assert record["state"] == "completed"


@pytest.mark.parametrize("action", ["cancel", "retry"])
async def test_an_unknown_id_is_exit_1_and_nothing_changes(
    dsn: str, conn: asyncpg.Connection, schema: str, action: str
) -> None:
    live = await enqueue(conn, schema, run_at=datetime(2100, 1, 1))
    dead = await bury(conn, schema)

    result = await pgjobd(dsn, schema, "jobs", action, str(live), str(dead), "424242", "434343")

    assert result.returncode == 1
    assert "no such jobs: 424242, 434343" in result.stderr
    assert await conn.fetchval(f"SELECT state::text FROM {schema}.job WHERE id = $1", live) == (
        "scheduled"
    )
    assert [r["state"] for r in await history(conn, schema, dead)] == ["dead"]
    assert await audit_rows(conn, schema) == []


@pytest.mark.parametrize("action", ["cancel", "retry"])
async def test_an_id_beyond_64_bits_is_a_usage_error_and_nothing_changes(
    dsn: str, conn: asyncpg.Connection, schema: str, action: str
) -> None:
    live = await enqueue(conn, schema, run_at=datetime(2100, 1, 1))

    result = await pgjobd(dsn, schema, "jobs", action, str(live), str(2**63))

    assert result.returncode == 2, result.stderr
    assert f"job ids are 64-bit integers, got {2**63}" in result.stderr
    assert await audit_rows(conn, schema) == []


async def test_retry_makes_waiting_jobs_available_now(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    retryable = await enqueue(conn, schema)
    await conn.execute(
        f"UPDATE {schema}.job SET state = 'retryable', attempt = 1, run_at = now() + interval '1h' "
        "WHERE id = $1",
        retryable,
    )
    available = await enqueue(conn, schema)
    running = await enqueue(conn, schema)
    await make_running(conn, schema, running)

    done = await pgjobd_json(
        dsn, schema, "jobs", "retry", str(retryable), str(available), str(running)
    )

    assert [(j["id"], j["outcome"]) for j in done["jobs"]] == [
        (retryable, "made_available"), (available, "already_available"), (running, "running"),
    ]  # fmt: skip
    row = await conn.fetchrow(
        f"SELECT state::text, attempt, run_at <= now() AS due FROM {schema}.job WHERE id = $1",
        retryable,
    )
    assert tuple(row) == ("available", 1, True)


async def test_retry_of_a_dead_job_runs_it_again_under_its_id_with_one_final_record(
    dsn: str, conn: asyncpg.Connection, schema: str, start_member: StartMember
) -> None:
    await start_member(queues=QUEUES)
    # A job that failed for real: three attempts, then dead.
    failing = await enqueue(conn, schema, "always_fails")
    await wait_until(lambda: history(conn, schema, failing), what="always_fails dead")
    # A job that is dead, though its handler would now succeed.
    fixed = await bury(conn, schema, "echo", attempt=3, max_attempts=3)

    done = await pgjobd_json(dsn, schema, "jobs", "retry", str(failing), str(fixed))

    assert [(j["id"], j["outcome"], j["state"]) for j in done["jobs"]] == [
        (failing, "retried", "dead"), (fixed, "retried", "dead"),
    ]  # fmt: skip

    async def final(job_id: int) -> list[asyncpg.Record] | None:
        live = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE id = $1", job_id)
        return None if live else await history(conn, schema, job_id)

    [completed] = await wait_until(lambda: final(fixed), what="the redone job finished")
    assert completed["state"] == "completed" and completed["attempt"] == 4
    assert json.loads(completed["result"]) == {"echo": {"n": 1}}
    [dead_again] = await wait_until(lambda: final(failing), what="always_fails dead again")
    assert dead_again["state"] == "dead"
    assert (dead_again["attempt"], dead_again["max_attempts"]) == (4, 4)  # one more attempt
    attempts = await conn.fetch(
        f"SELECT attempt FROM {schema}.job_attempt WHERE job_id = $1 ORDER BY attempt", failing
    )
    assert [a["attempt"] for a in attempts] == [1, 2, 3, 4]
    [row] = await audit_rows(conn, schema)
    assert row["action"] == "jobs.retry" and list(row["job_ids"]) == [failing, fixed]


async def test_retry_blocked_by_a_live_unique_key_changes_nothing(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    dead = await bury(conn, schema, unique_key="k-1")
    await enqueue(conn, schema, unique_key="k-1")

    result = await pgjobd(dsn, schema, "jobs", "retry", str(dead))

    assert result.returncode == 1 and f"cannot retry job(s) {dead}" in result.stderr
    assert [r["state"] for r in await history(conn, schema, dead)] == ["dead"]
    assert await audit_rows(conn, schema) == []


async def test_client_cancel_and_retry(dsn: str, conn: asyncpg.Connection, schema: str) -> None:
    job_id = await enqueue(conn, schema)
    async with await Client.connect(dsn, schema=schema) as client:
        assert await client.cancel(job_id) == "cancelled"
        assert await client.cancel(job_id) == "already_final"
        assert await client.retry(job_id) == "retried"
        info = await client.job(job_id)
        with pytest.raises(admin.UnknownJobs, match="no such job: 55555"):
            await client.retry(55555)

    assert info is not None and info.state == "available"
    rows = await audit_rows(conn, schema)
    assert [r["action"] for r in rows] == ["jobs.cancel", "jobs.cancel", "jobs.retry"]
    assert {r["os_user"] for r in rows} == {admin.os_user()}


# -- queues ------------------------------------------------------------------------------


async def test_pause_and_resume_toggle_the_queue_and_notify_members(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    heard: list[tuple[str, str]] = []
    listener = await asyncpg.connect(dsn)
    for channel in ("queue_control", "job_ready"):
        await listener.add_listener(f"{schema}.{channel}", lambda *a: heard.append((a[2], a[3])))
    try:
        paused = await pgjobd_json(dsn, schema, "queues", "pause", "email")
        row = await conn.fetchrow(
            f"SELECT paused, updated_by FROM {schema}.queue WHERE name = 'email'"
        )
        again = await pgjobd_json(dsn, schema, "queues", "pause", "email")
        resumed = await pgjobd_json(dsn, schema, "queues", "resume", "email")
        await wait_until(lambda: len(heard) == 4, 5, "four notifications")
    finally:
        await listener.close()
    bad = await pgjobd(dsn, schema, "queues", "pause", "no spaces")

    assert paused == {
        "action": "queues.pause", "queue": "email", "paused": True, "changed": True,
        "audit_id": paused["audit_id"],
    }  # fmt: skip
    assert tuple(row) == (True, OS_USER)
    assert (again["paused"], again["changed"]) == (True, False)
    assert (resumed["paused"], resumed["changed"]) == (False, True)
    assert not await conn.fetchval(f"SELECT paused FROM {schema}.queue WHERE name = 'email'")
    assert heard == [
        (f"{schema}.queue_control", "email"), (f"{schema}.queue_control", "email"),
        (f"{schema}.queue_control", "email"), (f"{schema}.job_ready", "email"),
    ]  # fmt: skip
    assert bad.returncode == 2 and "invalid queue name" in bad.stderr
    rows = await audit_rows(conn, schema)
    assert [(r["action"], r["target"]) for r in rows] == [
        ("queues.pause", "email"), ("queues.pause", "email"), ("queues.resume", "email"),
    ]  # fmt: skip


async def test_a_paused_queue_is_not_claimed_fleet_wide(
    dsn: str, conn: asyncpg.Connection, schema: str, start_member: StartMember
) -> None:
    await start_member(queues=QUEUES)
    assert (await pgjobd(dsn, schema, "queues", "pause", "other")).returncode == 0
    held = await enqueue(conn, schema, "echo", queue="other")
    flowing = await enqueue(conn, schema, "echo")
    await wait_until(lambda: history(conn, schema, flowing), what="the default queue's job")
    await anyio.sleep(0.5)
    assert await conn.fetchval(f"SELECT state::text FROM {schema}.job WHERE id = $1", held) == (
        "available"
    )

    assert (await pgjobd(dsn, schema, "queues", "resume", "other")).returncode == 0

    await wait_until(lambda: history(conn, schema, held), what="the resumed queue's job")


# -- dead letters ------------------------------------------------------------------------


async def test_dlq_list_and_redrive_with_filters(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    old = await bury(conn, schema, "report", ago="3 hours")
    recent = await bury(conn, schema, "report", attempt=5, max_attempts=5)
    other_kind = await bury(conn, schema, "mail")
    await bury(conn, schema, "report", state="completed")
    blocked = await bury(conn, schema, "report", unique_key="r-1", ago="2 minutes")
    await enqueue(conn, schema, "report", unique_key="r-1")

    everything = await pgjobd_json(dsn, schema, "dlq", "list")
    reports = await pgjobd_json(dsn, schema, "dlq", "list", "--kind", "report", "--since", "1h")
    redriven = await pgjobd_json(dsn, schema, "dlq", "redrive", "--kind", "report", "--since", "1h")
    bad_since = await pgjobd(dsn, schema, "dlq", "list", "--since", "last week")

    assert [j["id"] for j in everything["jobs"]] == [other_kind, recent, blocked, old]
    assert [j["id"] for j in reports["jobs"]] == [recent, blocked]
    assert reports["jobs"][0]["args"] == {"n": 1}
    assert redriven["ids"] == [recent] and redriven["blocked"] == [blocked]
    row = await conn.fetchrow(
        f"SELECT state::text, attempt, max_attempts FROM {schema}.job WHERE id = $1", recent
    )
    assert tuple(row) == ("available", 5, 6)
    assert await history(conn, schema, recent) == []
    left = await pgjobd_json(dsn, schema, "dlq", "list")
    assert [j["id"] for j in left["jobs"]] == [other_kind, blocked, old]
    assert bad_since.returncode == 2
    [audit] = await audit_rows(conn, schema)
    assert audit["action"] == "dlq.redrive" and list(audit["job_ids"]) == [recent]
    assert json.loads(audit["detail"])["blocked"] == [blocked]


# -- cron --------------------------------------------------------------------------------


async def test_cron_list_and_trigger(dsn: str, conn: asyncpg.Connection, schema: str) -> None:
    await conn.execute(
        f"""INSERT INTO {schema}.cron (name, schedule, timezone, kind, args, queue, source)
            VALUES ('nightly', '0 2 * * *', 'Europe/Berlin', 'report', '{{"scope": "all"}}',
                    'reports', 'api'),
                   ('broken', 'not a schedule', 'UTC', 'report', '{{}}', NULL, 'api')"""
    )
    now = await conn.fetchval("SELECT now()")

    listed = await pgjobd_json(dsn, schema, "cron", "list")
    triggered = await pgjobd_json(dsn, schema, "cron", "trigger", "nightly")
    unknown = await pgjobd(dsn, schema, "cron", "trigger", "nope")
    plain = await pgjobd(dsn, schema, "cron", "list")

    broken, nightly = listed["schedules"]
    assert broken["name"] == "broken" and broken["next_run"] is None
    assert "invalid cron schedule" in broken["error"]
    assert nightly["schedule"] == "0 2 * * *" and nightly["args"] == {"scope": "all"}
    next_run = datetime.fromisoformat(nightly["next_run"])
    assert now < next_run <= now + timedelta(days=1, hours=1)
    assert next_run.astimezone(ZoneInfo("Europe/Berlin")).hour == 2
    job = await conn.fetchrow(f"SELECT kind, queue, args FROM {schema}.job WHERE id = $1",
                              triggered["id"])  # fmt: skip
    assert (job["kind"], job["queue"], json.loads(job["args"])) == (
        "report",
        "reports",
        {"scope": "all"},
    )
    assert unknown.returncode == 1 and "no such cron schedule: nope" in unknown.stderr
    assert plain.returncode == 0 and "nightly" in plain.stdout
    [audit] = await audit_rows(conn, schema)
    assert (audit["action"], audit["target"], list(audit["job_ids"])) == (
        "cron.trigger", "nightly", [triggered["id"]],
    )  # fmt: skip


# -- the audit table ---------------------------------------------------------------------


async def test_audit_rows_are_append_only(conn: asyncpg.Connection, schema: str) -> None:
    await admin.set_paused(conn, schema, "q", True, user="x")

    for statement in (f"UPDATE {schema}.audit SET action = 'nothing'",
                      f"DELETE FROM {schema}.audit", f"TRUNCATE {schema}.audit"):  # fmt: skip
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await conn.execute(statement)
    assert len(await audit_rows(conn, schema)) == 1


async def test_human_output_of_every_command_runs(
    dsn: str, conn: asyncpg.Connection, schema: str, tmp_path: Path
) -> None:
    job_id = await enqueue(conn, schema)
    dead = await bury(conn, schema)
    commands = [
        ["status"], ["jobs", "list"], ["jobs", "show", str(job_id)], ["dlq", "list"],
        ["cron", "list"], ["jobs", "cancel", str(job_id)], ["jobs", "retry", str(dead)],
        ["queues", "pause", "default"], ["queues", "resume", "default"], ["dlq", "redrive"],
    ]  # fmt: skip
    for command in commands:
        result = await pgjobd(dsn, schema, *command)
        assert result.returncode == 0, (command, result.stderr)
        assert result.stdout.strip(), command


async def test_a_cancelled_running_job_that_completes_stays_completed(
    dsn: str, conn: asyncpg.Connection, schema: str, start_member: StartMember, tmp_path: Path
) -> None:
    await start_member(queues=QUEUES)
    started, release = tmp_path / "started", tmp_path / "release"
    job_id = await conn.fetchval(
        f"SELECT {schema}.enqueue('waits_for_gate', $1::jsonb)",
        json.dumps({"started": str(started), "release": str(release)}),
    )
    await wait_until(started.exists, what="the handler started")

    done = await pgjobd_json(dsn, schema, "jobs", "cancel", str(job_id))
    flagged = await conn.fetchval(
        f"SELECT cancel_requested FROM {schema}.job WHERE id = $1", job_id
    )
    release.write_text("go")

    assert done["jobs"] == [{"id": job_id, "outcome": "cancel_requested", "state": "running"}]
    assert flagged is True
    [record] = await wait_until(lambda: history(conn, schema, job_id), what="finished")
    assert record["state"] == "completed"
