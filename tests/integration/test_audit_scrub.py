"""The audit trail covers every writing admin action (who, as PostgreSQL and as the caller
said, and the action's arguments) in the action's own transaction; `pgjobd scrub`
overwrites finished jobs' payloads and errors, refuses while live jobs match, and is
audited."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import anyio
import asyncpg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pgjobd import admin

pytestmark = pytest.mark.anyio
MARKER = {"scrubbed": True}


async def _audit(conn: asyncpg.Connection, schema: str) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        f"SELECT db_role, os_user, action, target, job_ids, detail::text, arguments::text "
        f"FROM {schema}.audit ORDER BY id"
    )
    return [
        {**dict(r), "detail": json.loads(r["detail"]), "arguments": json.loads(r["arguments"])}
        for r in rows
    ]


async def _finish(
    conn: asyncpg.Connection, schema: str, job_id: int, reason: str | None, error: str | None
) -> None:
    """Moves a live job to history as the completer would, with an attempt's error."""
    await conn.execute(
        f"SELECT count(*) FROM {schema}.job_move(ARRAY[$1::bigint], NULL, ARRAY[$2::text], "
        'ARRAY[$3::text], ARRAY[\'{"out": "secret result"}\'::jsonb])',
        job_id,
        reason,
        error,
    )
    if error is not None:
        await conn.execute(
            f"INSERT INTO {schema}.job_attempt (job_id, attempt, queue, kind, outcome, "
            "error_class, error_message, traceback) "
            "VALUES ($1, 1, 'default', 'k', 'failed', 'E', $2, 'Traceback: secret')",
            job_id,
            error,
        )


async def test_every_admin_action_records_who_and_its_arguments(
    conn: asyncpg.Connection, schema: str
) -> None:
    first = await conn.fetchval(f"SELECT {schema}.enqueue('k', '{{\"a\": 1}}')")
    second = await conn.fetchval(f"SELECT {schema}.enqueue('k')")
    await conn.execute(
        f"INSERT INTO {schema}.cron (name, schedule, kind) VALUES ('nightly', '0 3 * * *', 'k')"
    )
    await admin.cancel_jobs(conn, schema, [first], user="alice")
    await admin.retry_jobs(conn, schema, [first, second], user="alice")
    await admin.set_paused(conn, schema, "default", True, user="console-token:ops")
    await admin.set_paused(conn, schema, "default", False, user="alice")
    await admin.redrive(conn, schema, kind="k", since=timedelta(hours=1), user="alice")
    triggered = await admin.trigger_cron(conn, schema, "nightly", user="alice")
    other = await conn.fetchval(f"SELECT {schema}.enqueue('k2')")
    await _finish(conn, schema, other, None, None)
    await admin.scrub(conn, schema, kind="k2", user="bob")

    rows = await _audit(conn, schema)
    who = await conn.fetchval("SELECT current_user")
    assert [(r["action"], r["os_user"], r["db_role"]) for r in rows] == [
        ("jobs.cancel", "alice", who),
        ("jobs.retry", "alice", who),
        ("queues.pause", "console-token:ops", who),
        ("queues.resume", "alice", who),
        ("dlq.redrive", "alice", who),
        ("cron.trigger", "alice", who),
        ("jobs.scrub", "bob", who),
    ]
    assert [r["arguments"] for r in rows[:6]] == [
        {"ids": [first]},
        {"ids": [first, second]},
        {"queue": "default", "paused": True},
        {"queue": "default", "paused": False},
        {"kind": "k", "queue": None, "since": 3600.0, "fingerprint": None},
        {"name": "nightly"},
    ]
    assert rows[5]["job_ids"] == [triggered.id]
    scrub_args = rows[6]["arguments"]
    assert (scrub_args["tenant"], scrub_args["kind"], scrub_args["before"]) == (None, "k2", None)
    assert rows[6]["job_ids"] == [other]


async def test_the_action_and_its_audit_row_commit_together(
    conn: asyncpg.Connection, schema: str
) -> None:
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('k')")
    # An action that fails writes no row...
    with pytest.raises(admin.UnknownJobs):
        await admin.cancel_jobs(conn, schema, [job_id, job_id + 1000], user="alice")
    assert await _audit(conn, schema) == []
    # ...and an audit row that cannot be written undoes the action.
    await conn.execute(
        f"ALTER TABLE {schema}.audit ADD CONSTRAINT refuse CHECK (os_user <> 'mallory')"
    )
    with pytest.raises(asyncpg.CheckViolationError):
        await admin.cancel_jobs(conn, schema, [job_id], user="mallory")
    assert await conn.fetchval(f"SELECT state FROM {schema}.job WHERE id = $1", job_id) == (
        "available"
    )
    await conn.execute(f"ALTER TABLE {schema}.audit DROP CONSTRAINT refuse")


async def test_the_cli_audits_as_the_os_user(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "queues", "pause", "mail", "--dsn", dsn,
         "--schema", schema],
        env={**env, "USER": "carol"}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    [row] = await _audit(conn, schema)
    assert (row["action"], row["os_user"], row["target"]) == ("queues.pause", "carol", "mail")
    assert row["arguments"] == {"queue": "mail", "paused": True}


async def test_scrub_overwrites_finished_jobs_of_a_tenant_and_leaves_the_rest(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    ids = {}
    for name, tenant in (("acme_done", "acme"), ("acme_dead", "acme"), ("other", "globex")):
        ids[name] = await conn.fetchval(
            f"SELECT {schema}.enqueue('k', '{{\"card\": \"4111\"}}', tenant => $1)", tenant
        )
    await _finish(conn, schema, ids["acme_done"], None, None)
    await _finish(conn, schema, ids["acme_dead"], "attempts_exhausted", "E: card 4111 declined")
    await _finish(conn, schema, ids["other"], "attempts_exhausted", "E: card 4111 declined")

    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "scrub", "--tenant", "acme", "--json", "--dsn", dsn,
         "--schema", schema], check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert sorted(result["ids"]) == sorted([ids["acme_done"], ids["acme_dead"]])
    assert result["attempts"] == 1

    history = {
        r["id"]: r
        for r in await conn.fetch(
            f"SELECT id, args::text, result::text, last_error FROM {schema}.job_history"
        )
    }
    for name in ("acme_done", "acme_dead"):
        row = history[ids[name]]
        assert json.loads(row["args"]) == MARKER
        assert json.loads(row["result"]) == MARKER
    assert json.loads(history[ids["acme_dead"]]["last_error"]) == MARKER
    assert history[ids["acme_done"]]["last_error"] is None  # nothing was there
    assert json.loads(history[ids["other"]]["args"]) == {"card": "4111"}
    attempts = {
        r["job_id"]: r
        for r in await conn.fetch(
            f"SELECT job_id, error_message, traceback FROM {schema}.job_attempt"
        )
    }
    assert json.loads(attempts[ids["acme_dead"]]["error_message"]) == MARKER
    assert json.loads(attempts[ids["acme_dead"]]["traceback"]) == MARKER
    assert attempts[ids["other"]]["error_message"] == "E: card 4111 declined"
    [audited] = await _audit(conn, schema)
    assert audited["action"] == "jobs.scrub"
    assert sorted(audited["job_ids"]) == sorted(result["ids"])
    assert audited["arguments"]["tenant"] == "acme"
    # Again: nothing left to scrub, still audited.
    again = await admin.scrub(conn, schema, tenant="acme")
    assert again.ids == []


async def test_scrub_refuses_while_live_jobs_match_and_changes_nothing(
    conn: asyncpg.Connection, schema: str
) -> None:
    finished = await conn.fetchval(f"SELECT {schema}.enqueue('k', tenant => 'acme')")
    await _finish(conn, schema, finished, None, None)
    live = await conn.fetchval(f"SELECT {schema}.enqueue('k', tenant => 'acme')")
    with pytest.raises(admin.ScrubRefused, match=f"live jobs match: {live}"):
        await admin.scrub(conn, schema, tenant="acme")
    args = await conn.fetchval(
        f"SELECT args::text FROM {schema}.job_history WHERE id = $1", finished
    )
    assert json.loads(args) == {}
    assert await _audit(conn, schema) == []
    # --before the live job was enqueued: it does not match, the finished one does.
    enqueued = await conn.fetchval(f"SELECT enqueued_at FROM {schema}.job WHERE id = $1", live)
    early = await admin.scrub(conn, schema, tenant="acme", before=enqueued)
    assert early.ids == [finished]


async def test_scrub_needs_a_tenant_or_a_kind(conn: asyncpg.Connection, schema: str) -> None:
    with pytest.raises(admin.InvalidInput, match="needs a tenant or a kind"):
        await admin.scrub(conn, schema)
    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "scrub", "--schema", schema], check=False
    )
    assert done.returncode == 2


# Tenants and kinds at the edges: empty, NUL, a lone surrogate, just over the limits,
# huge, and ordinary ones (which match nothing here).
EDGE_TEXT = st.one_of(
    st.sampled_from(["", " ", "\x00", "a\x00b", "\ud800", "t" * 256, "t" * 257, "k" * 129,
                     "x" * 100_000, "acme", "ok.kind", "-lead", "1st", "ünï", "'; DROP"]),
    st.text(max_size=20),
)  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tenant=st.none() | EDGE_TEXT, kind=st.none() | EDGE_TEXT,
       before=st.none() | st.sampled_from([timedelta(0), timedelta(days=-1),
                                           timedelta(days=36_500)]))  # fmt: skip
@example(tenant="a\x00b", kind=None, before=None)
@example(tenant=None, kind="x" * 100_000, before=None)
@example(tenant="\ud800", kind="ok", before=timedelta(days=36_500))
async def test_scrub_refuses_bad_tenants_and_kinds_by_name_and_the_admin_commands_keep_working(
    conn: asyncpg.Connection,
    schema: str,
    tenant: str | None,
    kind: str | None,
    before: timedelta | None,
) -> None:
    try:
        done = await admin.scrub(conn, schema, tenant=tenant, kind=kind, before=before)
    except admin.InvalidInput as e:
        assert "tenant" in str(e) or "kind" in str(e), str(e)
        assert len(str(e)) < 400  # names the problem without echoing the value back whole
    else:
        assert done.ids == []
    # Nothing half-written, and what reads the tables still works.
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history") == 0
    await admin.status(conn, schema)
    await admin.list_jobs(conn, schema)
    await admin.list_dead(conn, schema)


@pytest.mark.parametrize(
    "flag, value",
    [("--tenant", ""), ("--tenant", "t" * 257), ("--kind", "bad kind"), ("--kind", "k" * 129)],
)
async def test_the_cli_refuses_a_bad_scrub_filter_as_a_usage_error(
    dsn: str, schema: str, flag: str, value: str
) -> None:
    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "scrub", flag, value, "--dsn", dsn, "--schema", schema],
        check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr.decode()
    assert flag.removeprefix("--") in done.stderr.decode()
