"""/metrics, /healthz and /readyz of a real `pgjobd run`, and its JSON log lines: exact
counter values after a known workload, readiness through a crash loop and a drain."""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MemberProcess, wait_all_final, wait_until
from .test_supervision import _gated_job, _worker_pid

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def get(port: int, path: str) -> tuple[int, str]:
    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await anyio.to_thread.run_sync(fetch)


async def scrape(port: int) -> Samples:
    status, text = await get(port, "/metrics")
    assert status == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def start_with_metrics(start_member: StartMember, **kwargs: object) -> tuple[
    MemberProcess, int
]:  # fmt: skip
    port = free_port()
    extra = str(kwargs.pop("daemon", ""))
    member = await start_member(daemon=f'metrics_listen = "127.0.0.1:{port}"\n{extra}', **kwargs)
    await wait_until(
        lambda: _status(port, "/readyz", 200), what="/readyz 200", timeout_s=20
    )  # fmt: skip
    return member, port


async def _status(port: int, path: str, wanted: int) -> bool:
    try:
        return (await get(port, path))[0] == wanted
    except OSError:
        return False


async def test_counters_and_histograms_after_a_known_workload(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    member, port = await start_with_metrics(start_member)
    assert await get(port, "/healthz") == (200, '{"status":"ok","problems":[]}\n')

    enqueue = f"SELECT {schema}.enqueue($1)"
    for kind, count in [("echo", 5), ("always_fails", 2), ("discards", 1),
                        ("retries_then_succeeds", 1)]:  # fmt: skip
        for _ in range(count):
            await conn.fetchval(enqueue, kind)
    await wait_all_final(conn, schema, 9)
    # Alone, so that its crashes take no other job with them.
    await conn.fetchval(enqueue, "exits")
    await wait_all_final(conn, schema, 10)

    want = {
        ("pgjobd_jobs_completed_total", "echo"): 5,
        ("pgjobd_jobs_completed_total", "retries_then_succeeds"): 1,
        ("pgjobd_jobs_failed_total", "always_fails"): 6,  # 3 attempts each
        ("pgjobd_jobs_retried_total", "always_fails"): 4,
        ("pgjobd_jobs_failed_total", "retries_then_succeeds"): 2,  # Retry(after=) twice
        ("pgjobd_jobs_retried_total", "retries_then_succeeds"): 2,
        ("pgjobd_jobs_discarded_total", "discards"): 1,
        ("pgjobd_jobs_failed_total", "exits"): 3,  # max_crashes = 3 (the default)
        ("pgjobd_jobs_quarantined_total", "exits"): 1,
        ("pgjobd_job_duration_seconds_count", "echo"): 5,
        ("pgjobd_jobs_claimed_total", "always_fails"): 6,
    }

    async def counted() -> Samples | None:
        samples = await scrape(port)
        got = {key: value(samples, key[0], queue="default", kind=key[1]) for key in want}
        return samples if got == want else None

    samples = await wait_until(counted, what="counters", timeout_s=10)

    def dead(kind: str, reason: str) -> float:
        return value(samples, "pgjobd_jobs_dead_total", queue="default", kind=kind, reason=reason)

    assert dead("always_fails", "attempts_exhausted") == 2
    assert dead("discards", "discarded") == 1
    assert dead("exits", "worker_crash") == 1
    assert value(samples, "pgjobd_worker_restarts_total", queue="default", reason="crash") == 3
    # One wait per claim: 5 + 6 + 1 + 3 + 3 attempts.
    assert value(samples, "pgjobd_job_wait_seconds_count", queue="default") == 18
    assert value(samples, "pgjobd_claim_duration_seconds_count", queue="default") >= 1
    assert value(samples, "pgjobd_stale_outcomes_total", queue="default") == 0
    assert value(samples, "pgjobd_jobs_in_flight", queue="default") == 0
    # 2, or 1 while the last crashed one is being replaced.
    assert value(samples, "pgjobd_worker_processes", queue="default") >= 1
    assert value(samples, "pgjobd_ready") == 1

    # The only member leads, and exports the fleet-wide gauges. They are read every 5 s
    # (queue_stats), so one reading may predate the drain: wait for the drained one.
    async def leading() -> Samples | None:
        s = await scrape(port)
        found = ("pgjobd_queue_oldest_available_age_seconds", frozenset({("queue", "other")}))
        drained = all(
            value(s, "pgjobd_queue_jobs", queue="default", state=state) == 0
            for state in ("available", "running")
        )
        return s if value(s, "pgjobd_leader") == 1 and found in s and drained else None

    samples = await wait_until(leading, what="leader gauges of the drained queue", timeout_s=20)
    assert value(samples, "pgjobd_leader_term") >= 1
    assert value(samples, "pgjobd_role_tick_duration_seconds_count", role="reaper") >= 1
    assert value(samples, "pgjobd_role_errors_total", role="reaper") == 0
    assert member.process.returncode is None


async def test_readyz_fails_while_a_queue_crash_loops(
    start_member: StartMember, tmp_path: Path
) -> None:
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "ok.py").write_text(
        "from pgjobd import job\n\n@job\nasync def ok(args: dict) -> str:\n    return 'ok'\n"
    )
    member, port = await start_with_metrics(
        start_member, handlers=handlers,
        queues="[queues.default]\nconcurrency = 1\nprocesses = 1\n"
        "[queues.other]\nconcurrency = 1\nprocesses = 1\n",
    )  # fmt: skip
    default_pid = await wait_until(
        lambda: _worker_pid(member.process.pid, "default"), what="default worker"
    )
    (handlers / "broken.py").write_text("raise RuntimeError('bad deploy')\n")
    os.kill(default_pid, signal.SIGKILL)  # its replacements cannot import the handlers

    async def crash_looping() -> str | None:
        status, body = await get(port, "/readyz")
        return body if status == 503 and "queue default crash-looping" in body else None

    body = json.loads(await wait_until(crash_looping, timeout_s=60, what="readyz 503"))
    assert body["status"] == "unavailable"
    assert any("bad deploy" in problem for problem in body["problems"]), body
    assert (await get(port, "/healthz"))[0] == 200  # alive: no reason to restart it
    samples = await scrape(port)
    assert value(samples, "pgjobd_queue_crash_looping", queue="default") == 1
    assert value(samples, "pgjobd_queue_crash_looping", queue="other") == 0
    assert value(samples, "pgjobd_ready") == 0
    restarts = "pgjobd_worker_restarts_total"
    assert value(samples, restarts, queue="default", reason="crash") == 1
    # (The kill, soon after start, counts as the first of the 5 failures in a row.)
    assert value(samples, restarts, queue="default", reason="boot_failure") >= 4


async def test_readyz_fails_while_draining(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    member, port = await start_with_metrics(start_member)
    await _gated_job(conn, schema, tmp_path)
    member.send_signal(signal.SIGTERM)

    async def draining() -> bool:
        status, body = await get(port, "/readyz")
        return status == 503 and "draining" in json.loads(body)["problems"]

    await wait_until(draining, what="readyz draining")
    assert (await get(port, "/healthz"))[0] == 200  # still alive while it drains
    assert value(await scrape(port), "pgjobd_draining") == 1
    (tmp_path / "never").write_text("open")  # let the gated job finish
    assert await member.stop() == 0


async def test_json_log_lines_name_the_job(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "talk.py").write_text(
        "import logging\n"
        "from pgjobd import JobContext, job\n\n"
        "@job(max_attempts=1)\n"
        "def talks(args: dict, ctx: JobContext) -> None:\n"
        "    ctx.logger.info('via ctx.logger', extra={'step': 1})\n"
        "    logging.getLogger('library').warning('via a library logger')\n"
        "    print('via print')\n"
        "    raise ValueError('and then it failed')\n"
    )
    member = await start_member(handlers=handlers, daemon='log_format = "json"')
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('talks')")
    await wait_all_final(conn, schema, 1)

    def lines() -> list[dict[str, object]]:
        found = []
        for line in member.log.splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"not a JSON line: {line!r}") from None
        return found

    def about_the_job() -> dict[str, dict[str, object]] | None:
        by_msg = {str(r["msg"]): r for r in lines() if r.get("job_id") == job_id}
        return by_msg if len(by_msg) >= 4 else None

    by_msg = await wait_until(about_the_job, what="job lines")
    job_fields = {"job_id": job_id, "kind": "talks", "queue": "default", "attempt": 1}
    for msg in ("via ctx.logger", "via a library logger", "via print"):
        line = by_msg[msg]
        assert {k: line[k] for k in job_fields} == job_fields, line
        assert isinstance(line["member"], str) and line["worker_pid"] != member.process.pid
    assert by_msg["via ctx.logger"]["step"] == 1
    assert by_msg["via print"]["event"] == "job.output"
    (dead,) = [r for r in by_msg.values() if r.get("event") == "job.dead"]
    assert dead["level"] == "error" and dead["reason"] == "attempts_exhausted"
    assert "ValueError: and then it failed" in str(dead["error"])
    assert {k: dead[k] for k in job_fields} == job_fields
    # The member's lines are JSON too, with stable event names.
    assert any(r.get("event") == "member.ready" for r in lines())
