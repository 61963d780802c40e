"""Whether an attempt that did not complete ends its job: one rule in SQL,
job_end_reason, for the completer's failures and the reaper's expired leases."""

from __future__ import annotations

from datetime import timedelta

import asyncpg
import pytest

from pgjobd.queries import for_schema
from pgjobd.statements.job import FailRow
from pgjobd.statements.leader import QueueCrashes

pytestmark = pytest.mark.anyio

MAX_ATTEMPTS = 5
MAX_CRASHES = 3


@pytest.mark.parametrize(
    ("outcome", "attempt", "crashes", "cancel_requested", "expected"),
    [
        ("failed", 1, 0, False, None),
        ("failed", 5, 0, False, "attempts_exhausted"),
        ("retry", 5, 0, False, "attempts_exhausted"),
        ("crashed", 1, 0, False, None),
        ("crashed", 1, 2, False, "worker_crash"),  # third crash: quarantined
        ("crashed", 5, 0, False, "attempts_exhausted"),
        ("crashed", 5, 2, False, "worker_crash"),
        ("unknown_kind", 5, 0, False, "unknown_kind"),
        ("unknown_kind", 1, 0, False, None),
        ("discarded", 1, 0, False, "discarded"),
        ("invalid_args", 1, 0, False, "invalid_args"),
        ("snoozed", 5, 0, False, None),  # a snooze never spends an attempt
        ("given_back", 5, 0, False, None),
        ("given_back", 1, 0, True, "cancelled"),
        ("failed", 1, 0, True, "cancelled"),
        ("discarded", 5, 2, True, "cancelled"),
        # The reaper's expired leases count as crashes.
        ("lease_expired", 1, 0, False, None),
        ("lease_expired", 1, 2, False, "worker_crash"),
        ("lease_expired", 5, 0, False, "attempts_exhausted"),
        ("lease_expired", 5, 2, True, "cancelled"),
    ],
)
async def test_end_reason(
    conn: asyncpg.Connection,
    schema: str,
    outcome: str,
    attempt: int,
    crashes: int,
    cancel_requested: bool,
    expected: str | None,
) -> None:
    reason = await conn.fetchval(
        f"SELECT {schema}.job_end_reason($1, $2, $3, $4, $5, $6)",
        outcome, attempt, MAX_ATTEMPTS, crashes, MAX_CRASHES, cancel_requested,
    )  # fmt: skip
    assert reason == expected


@pytest.mark.parametrize("crashes", [0, MAX_CRASHES - 1])
async def test_completer_and_reaper_end_a_crashed_job_alike(
    conn: asyncpg.Connection, schema: str, crashes: int
) -> None:
    """The same job state, crashed in its worker or lost with its member's lease,
    ends (or not) the same way through job_fail_many and job_reap_expired."""
    q = for_schema(schema)
    term = await q.leader_term_begin(conn, "test")
    ended = []
    for path in ("completer", "reaper"):
        job_id, fence = await conn.fetchrow(
            f"INSERT INTO {schema}.job (state, queue, kind, args, owner, fence, attempt, "
            "crashes, lease_expires_at, attempted_at) VALUES ('running', 'default', 'k', "
            "'{}', 'm', 1, 1, $1, now() - interval '1 second', now()) RETURNING id, fence",
            crashes,
        )
        if path == "completer":
            row = FailRow(
                job_id, fence, "crashed", MAX_CRASHES, timedelta(0), "WorkerCrashed", None,
                None, 0.1, True,
            )  # fmt: skip
            await q.job_fail_many(conn, [row], "m")
        else:
            await q.job_reap_expired(
                conn, term, timedelta(0), 10, [QueueCrashes("default", MAX_CRASHES)], MAX_CRASHES
            )
        ended.append(
            await conn.fetchval(f"SELECT reason FROM {schema}.job_history WHERE id = $1", job_id)
        )
    expected = "worker_crash" if crashes == MAX_CRASHES - 1 else None
    assert ended == [expected, expected]
