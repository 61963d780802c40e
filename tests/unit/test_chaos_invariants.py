"""The chaos invariant on scheduling policies catches what it is meant to: an execution
under another policy than its queue's is reported; one under it, or where the platform
has no policies, is not."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from chaos.invariants import QUEUE_POLICY, check

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def one_completed_job(cpu_policy: int | None) -> dict[str, list[dict[str, Any]]]:
    return {
        "chaos_enqueued": [{"job_id": 1, "n": 0, "kind": "chaos_ok"}],
        "job_history": [
            {
                "id": 1,
                "kind": "chaos_ok",
                "state": "completed",
                "attempt": 1,
                "reason": None,
                "finished_at": T0 + timedelta(seconds=1),
                "unique_key": None,
            }
        ],
        "job_attempt": [],
        "job": [],
        "leader": [],
        "chaos_started": [{"job_id": 1, "attempt": 1}],
        "chaos_ledger": [
            {
                "job_id": 1,
                "attempt": 1,
                "kind": "chaos_ok",
                "outcome": "ok",
                "member_pid": 10,
                "worker_pid": 11,
                "started_at": T0,
                "ended_at": T0 + timedelta(seconds=1),
                "cpu_policy": cpu_policy,
            }
        ],
    }


def violations(cpu_policy: int | None) -> list[str]:
    return check(
        one_completed_job(cpu_policy), killed_members=[], expected_dead_kinds=set()
    ).violations


@pytest.mark.skipif(QUEUE_POLICY is None, reason="Linux scheduling policies")
def test_an_execution_under_its_queues_policy_passes_and_another_is_reported() -> None:
    assert violations(QUEUE_POLICY) == []
    assert violations(None) == []  # a platform without policies records none
    [violation] = violations(os.SCHED_OTHER)
    assert violation.startswith("execution not under its queue's cpu_scheduling: 1 case(s)")
    assert f"under policy {os.SCHED_OTHER}" in violation
