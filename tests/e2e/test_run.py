"""`pgjobd run` end to end: jobs enqueued from the CLI, Python and SQL are claimed, run
in worker processes and recorded, once, with the right outcome."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import Client, JobSpec

from .conftest import MemberProcess, final_records, wait_all_final, wait_until
from .events import JSON_LOG, events, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]


@pytest.mark.core
async def test_jobs_from_cli_python_and_sql_complete_once(
    client: Client, dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    member = await start_member()
    from_python = await client.enqueue("echo", {"via": "python"})
    bulk = await client.enqueue_many([("echo", {"n": i}) for i in range(50)])
    from_sql = await conn.fetchval(f"SELECT {schema}.enqueue('echo', '{{\"via\": \"sql\"}}')")
    cli = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "enqueue", "echo", '{"via": "cli"}',
         "--dsn", dsn, "--schema", schema],
    )  # fmt: skip
    from_cli = int(cli.stdout)

    records = await wait_all_final(conn, schema, 53)

    for job_id in (from_python, from_sql, from_cli, *bulk):
        assert records[job_id]["state"] == "completed"
        assert records[job_id]["attempt"] == 1
    assert json.loads(records[from_cli]["result"]) == {"echo": {"via": "cli"}}
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0
    assert await member.stop() == 0


async def test_kinds_are_declared_so_sql_enqueues_land_in_the_right_queue(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    await start_member()

    kinds = {
        r["name"]: tuple(r)[1:]
        for r in await conn.fetch(f"SELECT name, queue, priority, max_attempts FROM {schema}.kind")
    }
    assert kinds["declared_elsewhere"] == ("other", 2, 7)
    assert kinds["echo"] == ("default", 0, 20)

    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('declared_elsewhere')")
    records = await wait_all_final(conn, schema, 1)
    assert records[job_id]["queue"] == "other"
    assert records[job_id]["state"] == "completed"


@pytest.mark.core
async def test_every_outcome_is_recorded_as_the_contract_says(
    client: Client,
    dsn: str,
    schema: str,
    conn: asyncpg.Connection,
    start_member: StartMember,
    tmp_path: Path,
) -> None:
    await start_member()
    ids = dict(
        zip(
            ["fails", "retries", "snoozes", "discards", "discard_on", "bad_args",
             "typed", "unknown"],
            await client.enqueue_many([
                ("always_fails", {"x": 1}),
                ("retries_then_succeeds", {}),
                ("snoozes_once", {"path": str(tmp_path / "snoozed")}),
                ("discards", {}),
                ("discards_on_key_error", {}),
                ("typed", {"n": "not a number"}),
                ("typed", {"n": 21}),
                JobSpec("nobody_handles_this", {}, max_attempts=2),
            ]),
            strict=True,
        )
    )  # fmt: skip

    records = await wait_all_final(conn, schema, len(ids))

    def final(name: str) -> tuple[str, str | None, int]:
        r = records[ids[name]]
        return r["state"], r["reason"], r["attempt"]

    assert final("fails") == ("dead", "attempts_exhausted", 3)
    assert "ValueError: boom on {'x': 1}" in records[ids["fails"]]["last_error"]
    assert final("retries") == ("completed", None, 3)
    assert final("snoozes") == ("completed", None, 1)  # the snooze did not use an attempt
    assert final("discards") == ("dead", "discarded", 1)
    assert "not worth retrying" in records[ids["discards"]]["last_error"]
    assert final("discard_on") == ("dead", "discarded", 1)
    assert final("bad_args") == ("dead", "invalid_args", 1)
    assert "Expected `int`, got `str`" in records[ids["bad_args"]]["last_error"]
    assert final("typed") == ("completed", None, 1)
    assert json.loads(records[ids["typed"]]["result"]) == 42
    assert final("unknown") == ("dead", "unknown_kind", 2)

    attempts = await conn.fetch(
        f"SELECT job_id, attempt, outcome, error_class, traceback, member "
        f"FROM {schema}.job_attempt ORDER BY job_id, attempt"
    )
    failed = [(a["attempt"], a["outcome"]) for a in attempts if a["job_id"] == ids["fails"]]
    assert failed == [(1, "failed"), (2, "failed"), (3, "failed")]
    first = next(a for a in attempts if a["job_id"] == ids["fails"])
    assert first["error_class"] == "ValueError"
    assert "raise ValueError" in first["traceback"]
    assert first["member"]
    assert not [a for a in attempts if a["job_id"] == ids["snoozes"]]


@pytest.mark.core
async def test_two_members_never_run_one_job_at_once(
    client: Client,
    dsn: str,
    schema: str,
    conn: asyncpg.Connection,
    start_member: StartMember,
    tmp_path: Path,
) -> None:
    ledger = tmp_path / "ledger"
    await start_member()
    await start_member()
    # Both members claiming before the jobs come: a member's row appears before its
    # workers are up, and one member alone can run 400 short jobs before the other's
    # first claim (seen through PgBouncer). 16 jobs held at a gate fill both members'
    # slots (concurrency 8 each), so all 16 start only once both claim.
    release = tmp_path / "release"
    gates = [{"started": str(tmp_path / f"started_{i}"), "release": str(release)}
             for i in range(16)]  # fmt: skip
    gate_ids = await client.enqueue_many([("waits_for_gate", gate) for gate in gates])
    await wait_until(
        lambda: all(Path(gate["started"]).exists() for gate in gates),
        what="16 gated jobs running at once, 8 in each member",
    )
    ids = await client.enqueue_many(
        [("record", {"path": str(ledger), "hold_s": 0.002}) for _ in range(400)]
    )
    release.touch()  # both members' slots free at once: each claims a share of the 400

    records = await wait_all_final(conn, schema, len(ids) + len(gate_ids), timeout_s=60)

    runs = [line.split() for line in ledger.read_text().splitlines()]
    ran = sorted(int(run[0]) for run in runs)
    assert ran == sorted(ids)  # each job ran exactly once: no fault, no repeat
    assert {r["state"] for r in records.values()} == {"completed"}
    assert len({records[i]["owner"] for i in gate_ids}) == 2  # both members claimed
    assert len({records[i]["owner"] for i in ids}) == 2  # and both took a share of the 400


@pytest.mark.core
async def test_a_lost_listen_session_falls_back_to_polling_and_reconnects(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    await start_member()
    listener_query = "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgjobd listener'"
    old = await wait_until(lambda: conn.fetchval(listener_query), what="listener session")

    await conn.execute("SELECT pg_terminate_backend($1)", old)
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('echo')")

    records = await wait_all_final(conn, schema, 1)
    assert records[job_id]["state"] == "completed"
    new = await wait_until(
        lambda: conn.fetchval(listener_query + " AND pid <> $1", old), what="a new listener"
    )
    assert new != old


@pytest.mark.core
async def test_an_outcome_whose_fence_was_taken_changes_nothing(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    member = await start_member(daemon=JSON_LOG)
    gate = {"started": str(tmp_path / "started"), "release": str(tmp_path / "release")}
    job_id = await conn.fetchval(
        f"SELECT {schema}.enqueue('waits_for_gate', $1::jsonb)", json.dumps(gate)
    )
    await wait_until(lambda: anyio.Path(gate["started"]).exists(), what="handler started")

    # What a reaper does to a job whose member looks dead: take it back, new fence.
    await conn.execute(
        f"UPDATE {schema}.job SET fence = fence + 1000, owner = 'someone-else' WHERE id = $1",
        job_id,
    )
    await anyio.Path(gate["release"]).write_text("go")
    await wait_for_event(member, "job.stale_outcome", job_ids=[job_id])  # dropped, logged

    row = await conn.fetchrow(f"SELECT state, owner FROM {schema}.job WHERE id = $1", job_id)
    assert tuple(row) == ("running", "someone-else")
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history") == 0


@pytest.mark.core
async def test_sigterm_drains_and_leaves_the_fleet(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    member = await start_member()
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('echo')")
    await wait_all_final(conn, schema, 1)

    assert await member.stop(signal.SIGTERM) == 0
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.member") == 0
    assert (
        await conn.fetchval(f"SELECT state FROM {schema}.job_history WHERE id = $1", job_id)
    ) == "completed"


async def test_a_handler_module_that_fails_to_import_exits_78(
    start_member: StartMember, tmp_path: Path
) -> None:
    broken = tmp_path / "broken_handlers"
    broken.mkdir()
    (broken / "bad.py").write_text("raise RuntimeError('cannot start')\n")

    member = await start_member(daemon=JSON_LOG, handlers=broken, wait_ready=False)

    with anyio.fail_after(30):
        status = await member.process.wait()
    assert status == 78
    failed = events(member, "worker.boot_failed", worker_queue="default")
    assert failed, member.log[-3000:]
    assert "bad.py" in failed[0]["msg"] and "cannot start" in failed[0]["msg"]


async def test_history_none_keeps_no_final_records(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    await start_member(
        queues='[queues.default]\nconcurrency = 4\nprocesses = 1\nhistory = "none"\n'
    )
    await conn.execute(f"SELECT {schema}.enqueue('echo') FROM generate_series(1, 20)")

    await wait_until(lambda: _empty(conn, schema), what="hot table empty")
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history") == 0


async def _empty(conn: asyncpg.Connection, schema: str) -> bool:
    return await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0


@pytest.mark.core
async def test_a_job_whose_lease_is_lost_is_cancelled_in_its_worker(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    member = await start_member(daemon='lease = "1500ms"\n' + JSON_LOG)
    watch = {"started": str(tmp_path / "started"), "saw_cancel": str(tmp_path / "cancelled")}
    job_id = await conn.fetchval(
        f"SELECT {schema}.enqueue('runs_until_cancelled', $1::jsonb)", json.dumps(watch)
    )
    await wait_until(anyio.Path(watch["started"]).exists, what="handler started")

    await conn.execute(  # another member's reaper took the job
        f"UPDATE {schema}.job SET fence = fence + 1000, owner = 'other' WHERE id = $1", job_id
    )

    await wait_until(anyio.Path(watch["saw_cancel"]).exists, what="ctx.cancelled set")
    await wait_for_event(member, "job.stale_outcome", job_ids=[job_id])  # outcome dropped
    assert events(member, "lease.lost", job_id=job_id)
    assert await conn.fetchval(f"SELECT owner FROM {schema}.job WHERE id = $1", job_id) == "other"


@pytest.mark.core
async def test_a_paused_queue_is_not_claimed_from_until_resumed(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    await conn.execute(f"INSERT INTO {schema}.queue (name, paused) VALUES ('default', true)")
    await start_member()
    held = await conn.fetchval(f"SELECT {schema}.enqueue('echo')")
    other = await conn.fetchval(f"SELECT {schema}.enqueue('echo', queue => 'other')")

    await wait_all_final(conn, schema, 1)  # the other queue kept working meanwhile
    assert await conn.fetchval(f"SELECT state FROM {schema}.job WHERE id = $1", held) == (
        "available"
    )
    assert (await final_records(conn, schema)).keys() == {other}

    await conn.execute(f"UPDATE {schema}.queue SET paused = false WHERE name = 'default'")
    records = await wait_all_final(conn, schema, 2)
    assert records[held]["state"] == "completed"


async def test_systemd_hears_ready_watchdog_and_stopping(
    start_member: StartMember, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(address)
    listener.setblocking(False)
    heard: list[str] = []

    def drain_socket() -> list[str]:
        with contextlib.suppress(BlockingIOError):
            while True:
                heard.extend(listener.recv(4096).decode().split("\n"))
        return heard

    async def keep_draining() -> None:
        # A datagram socket queues only a few messages: unread, the member's next ping
        # would block it (as an unresponsive systemd would).
        while True:
            drain_socket()
            await anyio.sleep(0.02)

    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_draining)
            member = await start_member()
            await wait_until(lambda: "READY=1" in drain_socket(), what="READY=1")
            await wait_until(lambda: drain_socket().count("WATCHDOG=1") >= 3, what="watchdog pings")
            assert await member.stop() == 0
            assert "STOPPING=1" in drain_socket()
            assert drain_socket().index("READY=1") < drain_socket().index("STOPPING=1")
            tg.cancel_scope.cancel()
    finally:
        listener.close()


@pytest.mark.core
async def test_cancelling_a_running_job_reaches_its_handler(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    await start_member()
    watch = {"started": str(tmp_path / "started"), "saw_cancel": str(tmp_path / "cancelled")}
    job_id = await conn.fetchval(
        f"SELECT {schema}.enqueue('gives_up_when_cancelled', $1::jsonb)", json.dumps(watch)
    )
    await wait_until(anyio.Path(watch["started"]).exists, what="handler started")

    cancel = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "jobs", "cancel", str(job_id), "--dsn", dsn,
         "--schema", schema],
    )  # fmt: skip
    assert cancel.returncode == 0

    records = await wait_all_final(conn, schema, 1)
    assert (records[job_id]["state"], records[job_id]["reason"]) == ("cancelled", "cancelled")
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0
