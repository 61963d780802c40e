"""Supervision with the real `pgjobd run`: crashes, poison pills, hung handlers,
recycling, crash loops and the drain, each asserted on the database."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import Client

from .conftest import MemberProcess, wait_all_final, wait_until
from .events import JSON_LOG, events, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]
ONE_QUEUE = '[queues.default]\nconcurrency = 4\nprocesses = 2\nbackoff_base = "0s"\n{extra}\n'


@pytest.mark.parametrize(
    ("kind", "message"),
    [("exits", "exit status 1"), ("segfaults", "signal 11 (SIGSEGV)")],
)
async def test_a_crashing_job_costs_only_itself_and_is_quarantined(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember,
    kind: str, message: str,
) -> None:  # fmt: skip
    await start_member(queues=ONE_QUEUE.format(extra="max_crashes = 3"))
    async with await Client.connect(dsn, schema=schema) as client:
        poison = await client.enqueue(kind, {})
        others = await client.enqueue_many([("echo", {"n": i}) for i in range(30)])

    records = await wait_all_final(conn, schema, 31, timeout_s=60)

    assert all(records[i]["state"] == "completed" for i in others)
    assert (records[poison]["state"], records[poison]["reason"]) == ("dead", "worker_crash")
    crashes = await conn.fetch(
        f"SELECT outcome, error_message FROM {schema}.job_attempt WHERE job_id = $1", poison
    )
    assert len(crashes) == 3  # quarantined at max_crashes, with attempts to spare
    assert all(c["outcome"] == "crashed" and message in c["error_message"] for c in crashes)


async def test_a_hung_handler_is_killed_and_its_slot_freed(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    member = await start_member(queues=ONE_QUEUE.format(extra=""), daemon=JSON_LOG)
    async with await Client.connect(dsn, schema=schema) as client:
        hung = await client.enqueue("hangs", {})
        flowing = [await client.enqueue("echo", {"n": i}) for i in range(10)]

    records = await wait_all_final(conn, schema, 11, timeout_s=60)

    assert all(records[i]["state"] == "completed" for i in flowing)
    assert (records[hung]["state"], records[hung]["reason"]) == ("dead", "attempts_exhausted")
    assert "ran past its timeout of 1s" in records[hung]["last_error"]
    assert events(member, "worker.killed", queue="default"), member.log[-3000:]


async def test_workers_are_recycled_after_max_jobs(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    member = await start_member(
        queues="[queues.default]\nconcurrency = 2\nprocesses = 1\nmax_jobs_per_process = 5\n",
        daemon=JSON_LOG,
    )
    async with await Client.connect(dsn, schema=schema) as client:
        await client.enqueue_many([("record", {"path": str(ledger)}) for _ in range(20)])

    records = await wait_all_final(conn, schema, 20, timeout_s=60)

    assert {r["state"] for r in records.values()} == {"completed"}
    assert {r["attempt"] for r in records.values()} == {1}  # recycling is not a failure
    pids = {line.split()[4] for line in ledger.read_text().splitlines()}
    assert len(pids) >= 4  # 20 jobs, at most 5 per process
    assert len(events(member, "worker.recycled", queue="default")) >= 3


async def test_a_worker_past_max_rss_is_recycled(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    member = await start_member(
        queues='[queues.default]\nconcurrency = 1\nprocesses = 1\nmax_rss = "100MB"\n',
        daemon=JSON_LOG,
    )
    await conn.execute(f"SELECT {schema}.enqueue('leaks') FROM generate_series(1, 3)")

    await wait_all_final(conn, schema, 3, timeout_s=60)
    # Recycled for its memory: max_rss is the only reason to recycle this queue has.
    await wait_for_event(member, "worker.recycled", queue="default")


async def test_a_crash_looping_queue_is_marked_failed_while_others_work(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "ok.py").write_text(
        "from pgjobd import job\n\n@job\nasync def ok(args: dict) -> str:\n    return 'ok'\n"
    )
    member = await start_member(
        handlers=handlers,
        queues="[queues.default]\nconcurrency = 1\nprocesses = 1\n"
        "[queues.other]\nconcurrency = 1\nprocesses = 1\n",
        daemon=JSON_LOG,
    )
    default_pid = await wait_until(
        lambda: _worker_pid(member.process.pid, "default"), what="default worker"
    )
    (handlers / "broken.py").write_text("raise RuntimeError('bad deploy')\n")
    os.kill(default_pid, signal.SIGKILL)  # its replacements cannot import the handlers

    await wait_for_event(member, "queue.failed", queue="default", timeout_s=60)
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('ok', queue => 'other')")
    records = await wait_all_final(conn, schema, 1)
    assert records[job_id]["state"] == "completed"  # the other queue kept working
    assert member.process.returncode is None


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
async def test_each_queues_workers_run_under_its_cpu_scheduling(
    start_member: StartMember,
) -> None:
    member = await start_member(
        queues="[queues.default]\nconcurrency = 2\nprocesses = 1\n\n"
        '[queues.io]\nconcurrency = 2\nprocesses = 1\ncpu_scheduling = "other"\n'
    )
    batch = await wait_until(lambda: _worker_pid(member.process.pid, "default"))
    other = await wait_until(lambda: _worker_pid(member.process.pid, "io"))
    assert os.sched_getscheduler(batch) == os.SCHED_BATCH  # the default
    assert os.sched_getscheduler(other) == os.SCHED_OTHER
    assert os.sched_getscheduler(member.process.pid) == os.SCHED_OTHER  # the supervisor's own


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
async def test_a_reload_changes_cpu_scheduling_with_the_new_workers_and_a_bad_one_changes_nothing(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    queue = "[queues.default]\nconcurrency = 2\nprocesses = 1\n"
    member = await start_member(queues=queue, daemon=JSON_LOG)
    config = tmp_path / "member0.toml"
    first = await wait_until(lambda: _worker_pid(member.process.pid, "default"))
    assert os.sched_getscheduler(first) == os.SCHED_BATCH

    config.write_text(config.read_text() + 'cpu_scheduling = "other"\n')
    member.send_signal(signal.SIGHUP)
    await wait_for_event(member, "member.reloaded")

    def replaced() -> set[int] | None:  # the old generation's worker gone, a new one up
        pids = _worker_pids(member.process.pid, "default")
        return pids if len(pids) == 1 and first not in pids else None

    [second] = await wait_until(replaced, what="the new generation's worker alone")
    assert os.sched_getscheduler(second) == os.SCHED_OTHER

    config.write_text(config.read_text().replace('"other"', '"fifo"'))
    check = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "check-config", "--config", str(config)], check=False
    )
    assert check.returncode == 78
    assert b'queues.default.cpu_scheduling: expected one of "batch", "other"' in check.stderr
    member.send_signal(signal.SIGHUP)
    rejected = await wait_for_event(member, "member.reload_rejected")
    assert "queues.default.cpu_scheduling" in rejected["msg"]
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('echo', '{{\"n\": 1}}')")
    records = await wait_all_final(conn, schema, 1)
    assert records[job_id]["state"] == "completed"  # the generation of the last good config
    assert _worker_pids(member.process.pid, "default") == {second}
    assert member.process.returncode is None


def _worker_pids(parent: int, queue: str) -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        is_worker = b"pgjobd.worker" in cmdline and queue.encode() in cmdline
        if f"\nPPid:\t{parent}\n" in status and is_worker:
            pids.add(int(proc.name))
    return pids


def _worker_pid(parent: int, queue: str) -> int | None:
    return min(_worker_pids(parent, queue), default=None)


async def _gated_job(conn: asyncpg.Connection, schema: str, tmp_path: Path) -> tuple[int, Path]:
    gate = {"started": str(tmp_path / "started"), "release": str(tmp_path / "never")}
    job_id = await conn.fetchval(
        f"SELECT {schema}.enqueue('waits_for_gate', $1::jsonb)", json.dumps(gate)
    )
    await wait_until(anyio.Path(gate["started"]).exists, what="job running")
    return job_id, Path(gate["started"])


@pytest.mark.parametrize("second_signal", [False, True])
async def test_drain_gives_back_what_does_not_finish(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path,
    second_signal: bool,
) -> None:  # fmt: skip
    drain = 'drain_timeout = "2s"\n' if not second_signal else ""
    member = await start_member(daemon=drain + JSON_LOG)
    job_id, _ = await _gated_job(conn, schema, tmp_path)

    stopping = time.monotonic()
    member.send_signal(signal.SIGTERM)
    if second_signal:
        await wait_for_event(member, "member.draining")
        member.send_signal(signal.SIGTERM)
    assert await member.stop(timeout_s=30) == 0
    took_s = time.monotonic() - stopping

    # drain_timeout 2s (or at once on a second signal), plus the worker's grace
    assert took_s < (9 if not second_signal else 8), took_s
    row = await conn.fetchrow(f"SELECT state, attempt FROM {schema}.job WHERE id = $1", job_id)
    assert tuple(row) == ("available", 0)  # given back, the attempt not charged
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_attempt") == 0
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.member") == 0
