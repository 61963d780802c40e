"""Handlers whose outcomes PostgreSQL would refuse as they are, run by a real member:
every one is recorded, and the member keeps serving. Regression for bug 2 of issue 10
(at d1c1ca0 the first of them ended the completer, and the member with exit 1)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

from .conftest import MemberProcess, wait_all_final, wait_until

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]

HANDLERS = r"""
from datetime import timedelta

from pgjobd import Retry, Snooze, job

class BadName(Exception):
    pass


BadName.__qualname__ = "Bad\x00Name"  # a class name PostgreSQL cannot store as it is


@job
async def nul_result(args: dict[str, object]) -> dict[str, str]:
    return {"text": "a\x00b", "a\x00b": "key"}


@job(max_attempts=1)
async def nul_error(args: dict[str, object]) -> None:
    raise ValueError("a\x00b" * 10_000)


@job(max_attempts=1)
async def nul_class(args: dict[str, object]) -> None:
    raise BadName("x")


@job
async def far_snooze(args: dict[str, object]) -> None:
    raise Snooze(timedelta(days=999_999_999))


@job
async def far_retry(args: dict[str, object]) -> None:
    raise Retry(after=timedelta(days=999_999_999))


@job
async def fine(args: dict[str, object]) -> int:
    return 1
"""


async def test_outcomes_postgresql_would_refuse_do_not_stop_the_member(
    start_member: StartMember, conn: asyncpg.Connection, schema: str, tmp_path: Path
) -> None:
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "hostile.py").write_text(HANDLERS)
    member = await start_member(handlers=handlers)
    kinds = ["nul_result", "nul_error", "nul_class", "far_snooze", "far_retry", "fine"]
    ids = {kind: await conn.fetchval(f"SELECT {schema}.enqueue($1)", kind) for kind in kinds}

    async def settled() -> bool:
        live = await conn.fetch(
            f"SELECT id, state::text FROM {schema}.job WHERE state NOT IN ('scheduled', "
            "'retryable')"
        )
        return not live

    await wait_until(settled, timeout_s=60, what="every job recorded")
    records = await wait_all_final(conn, schema, 4)
    assert member.process.returncode is None, member.log[-3000:]

    assert records[ids["fine"]]["state"] == "completed"
    assert records[ids["nul_result"]]["state"] == "completed"
    result = await conn.fetchval(
        f"SELECT result->>'text' FROM {schema}.job_history WHERE id = $1", ids["nul_result"]
    )
    assert result == "a\ufffdb"
    for kind in ("nul_error", "nul_class"):
        assert records[ids[kind]]["state"] == "dead", kind
        assert "\ufffd" in records[ids[kind]]["last_error"]
    for kind in ("far_snooze", "far_retry"):
        row = await conn.fetchrow(
            f"SELECT run_at - now() AS delay, state::text FROM {schema}.job WHERE id = $1",
            ids[kind],
        )
        assert row["delay"] > timedelta(days=9 * 365), kind
    # and the member still runs new work
    later = await conn.fetchval(f"SELECT {schema}.enqueue('fine')")
    await wait_all_final(conn, schema, 5)
    assert (await conn.fetchval(
        f"SELECT state::text FROM {schema}.job_history WHERE id = $1", later
    )) == "completed"  # fmt: skip
    assert await member.stop() == 0, member.log[-3000:]
