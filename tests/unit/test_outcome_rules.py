"""What the completer decides for each outcome: final or not, reason, delay; and the
backoff it uses. Pure functions: no database."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.backoff import retry_delay_s
from pgjobd.completer import Completer
from pgjobd.config import QueueConfig
from pgjobd.duration import Duration
from pgjobd.model import ClaimedJob, Outcome, OutcomeKind

NOW = datetime(2026, 11, 30, tzinfo=UTC)
QUEUE = QueueConfig(
    backoff_base=Duration(seconds=1), backoff_max=Duration(seconds=60), max_crashes=3
)


def claimed(attempt: int = 1, max_attempts: int = 5, crashes: int = 0) -> ClaimedJob:
    return ClaimedJob(
        id=7, fence=70, kind="k", queue="default", attempt=attempt, max_attempts=max_attempts,
        crashes=crashes, priority=0, tenant=None, enqueued_at=NOW, scheduled_at=NOW, args=b"{}",
    )  # fmt: skip


def decide(outcome: Outcome, queue: QueueConfig = QUEUE) -> tuple[bool, str | None, float]:
    completer = Completer(None, None, "m", {"default": queue}, None)  # type: ignore[arg-type]
    row = completer._failure_row(outcome)
    final, reason, delay = row[3], row[4], row[5]
    assert isinstance(delay, timedelta)
    return final, reason, delay.total_seconds()


@pytest.mark.parametrize(
    ("kind", "attempt", "crashes", "expected"),
    [
        ("failed", 1, 0, (False, None)),
        ("failed", 5, 0, (True, "attempts_exhausted")),
        ("retry", 5, 0, (True, "attempts_exhausted")),
        ("crashed", 1, 0, (False, None)),
        ("crashed", 1, 2, (True, "worker_crash")),  # third crash: quarantined
        ("crashed", 5, 0, (True, "attempts_exhausted")),
        ("unknown_kind", 5, 0, (True, "unknown_kind")),
        ("unknown_kind", 1, 0, (False, None)),
        ("discarded", 1, 0, (True, "discarded")),
        ("invalid_args", 1, 0, (True, "invalid_args")),
        ("snoozed", 5, 0, (False, None)),  # a snooze never spends an attempt
        ("given_back", 5, 0, (False, None)),
    ],
)
def test_final_and_reason(
    kind: OutcomeKind, attempt: int, crashes: int, expected: tuple[bool, str | None]
) -> None:
    final, reason, _ = decide(Outcome(claimed(attempt, crashes=crashes), kind))
    assert (final, reason) == expected


def test_retry_and_snooze_use_the_handlers_delay_and_give_back_is_immediate() -> None:
    assert decide(Outcome(claimed(), "retry", after_s=12.5))[2] == 12.5
    assert decide(Outcome(claimed(), "snoozed", after_s=300.0))[2] == 300.0
    assert decide(Outcome(claimed(), "given_back"))[2] == 0.0


@given(attempt=st.integers(min_value=1, max_value=10_000), seed=st.integers())
def test_failed_attempts_back_off_within_the_full_jitter_window(attempt: int, seed: int) -> None:
    delay = retry_delay_s(attempt, 1.0, 60.0, random.Random(seed))
    assert 0.0 <= delay <= min(60.0, 2.0 ** min(attempt, 64))


@given(
    base=st.floats(min_value=0.0, max_value=100.0),
    cap=st.floats(min_value=0.0, max_value=1e6),
    attempt=st.integers(min_value=1, max_value=100),
)
def test_backoff_never_exceeds_its_cap(base: float, cap: float, attempt: int) -> None:
    assert 0.0 <= retry_delay_s(attempt, base, max(base, cap)) <= max(base, cap)


def test_full_jitter_spreads_retries() -> None:
    rng = random.Random(1)
    delays = [retry_delay_s(6, 1.0, 3600.0, rng) for _ in range(2000)]
    assert max(delays) <= 64.0
    assert min(delays) < 8.0 and max(delays) > 56.0  # spread over the whole window
