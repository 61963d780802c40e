"""`@job(redact=[...])`: the listed args fields stay out of the member's log, the stored
errors and tracebacks, and the admin CLI's `jobs show` and `dlq list`."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable

import anyio
import asyncpg
import pytest

from pgjobd.redact import REDACTED

from .conftest import MemberProcess, wait_all_final
from .events import JSON_LOG, events

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]
PASSWORD = "hunter2-s3cret"
CARD = "4111111111111111"


async def test_redacted_fields_stay_out_of_logs_errors_and_cli_output(
    dsn: str, conn: asyncpg.Connection, schema: str, start_member: StartMember
) -> None:
    member = await start_member(daemon=JSON_LOG)
    args = {"password": PASSWORD, "card": {"number": CARD, "brand": "visa"}, "user": "ann"}
    job_id = await conn.fetchval(
        f"SELECT {schema}.enqueue('leaks_its_secrets', $1::jsonb)", json.dumps(args)
    )
    records = await wait_all_final(conn, schema, 1)
    assert records[job_id]["state"] == "dead"

    lines = events(member, "job.log", job_id=job_id)
    assert len(lines) == 2, member.log[-3000:]
    assert all(PASSWORD not in line["msg"] and CARD not in line["msg"] for line in lines)
    assert any(REDACTED in line["msg"] for line in lines)
    assert PASSWORD not in member.log and CARD not in member.log
    assert PASSWORD not in records[job_id]["last_error"]
    attempt = await conn.fetchrow(
        f"SELECT error_message, traceback FROM {schema}.job_attempt WHERE job_id = $1", job_id
    )
    for text in (attempt["error_message"], attempt["traceback"]):
        assert PASSWORD not in text and CARD not in text and REDACTED in text
    assert await conn.fetchval(
        f"SELECT redact FROM {schema}.kind WHERE name = 'leaks_its_secrets'"
    ) == ["password", "card.number"]

    common = ["--dsn", dsn, "--schema", schema]
    for command in (["jobs", "show", str(job_id)], ["dlq", "list"]):
        for output in (["--json"], []):
            done = await anyio.run_process([sys.executable, "-m", "pgjobd", *command, *common,
                                            *output])  # fmt: skip
            shown = done.stdout.decode()
            assert PASSWORD not in shown and CARD not in shown, (command, output)
            assert REDACTED in shown or (command[0] == "dlq" and not output)
    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "jobs", "show", str(job_id), *common, "--json"]
    )
    assert json.loads(done.stdout)["args"] == {
        "password": REDACTED, "card": {"number": REDACTED, "brand": "visa"}, "user": "ann",
    }  # fmt: skip
    await member.stop()
