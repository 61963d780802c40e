"""Log lines: the job's fields reach every line logged while it runs, and a worker's
prints become JSON lines too."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from pgjobd import log
from pgjobd.handler_api import JobContext

NOW = datetime(2026, 11, 30, tzinfo=UTC)


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(log.JsonFormatter())
    handler.addFilter(log.ContextFilter({"member": "m1", "worker_pid": 42}))
    logger = logging.getLogger("test.pgjobd.log")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield out
    logger.removeHandler(handler)


def parsed(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_job_fields_reach_lines_of_any_logger_while_the_job_runs(lines: io.StringIO) -> None:
    logger = logging.getLogger("test.pgjobd.log")
    logger.info("outside")
    token = log.job_fields.set({"job_id": 7, "kind": "k", "queue": "q", "attempt": 2})
    try:
        logger.info("inside", extra={"event": "x"})
    finally:
        log.job_fields.reset(token)
    outside, inside = parsed(lines)
    assert outside["member"] == "m1" and "job_id" not in outside
    assert inside["job_id"] == 7 and inside["attempt"] == 2 and inside["event"] == "x"
    assert "event" not in outside
    assert inside["worker_pid"] == 42


def test_a_handlers_ctx_logger_fields_reach_the_json_line(lines: io.StringIO) -> None:
    ctx = JobContext(
        id=9, kind="send", queue="mail", attempt=1, max_attempts=3, tenant=None,
        enqueued_at=NOW, scheduled_at=NOW, logger=logging.getLogger("test.pgjobd.log"),
    )  # fmt: skip
    ctx.logger.warning("hello %s", "there", extra={"to": "a@b"})
    (line,) = parsed(lines)
    assert line["msg"] == "hello there"
    assert {k: line[k] for k in ("job_id", "kind", "queue", "attempt", "to", "member")} == {
        "job_id": 9, "kind": "send", "queue": "mail", "attempt": 1, "to": "a@b", "member": "m1",
    }  # fmt: skip


def test_printed_lines_become_log_lines(lines: io.StringIO) -> None:
    stream = log.LineLogger(logging.getLogger("test.pgjobd.log"), logging.INFO, "stdout")
    print("one", file=stream)
    print("two\nthree", end="", file=stream)
    stream.flush()
    assert [(r["msg"], r["event"], r["stream"]) for r in parsed(lines)] == [
        ("one", "job.output", "stdout"),
        ("two", "job.output", "stdout"),
        ("three", "job.output", "stdout"),
    ]
