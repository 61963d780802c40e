"""The delay the completer gives each outcome, and the backoff it uses. Pure functions:
no database. (Whether an outcome ends its job is the database's rule, job_end_reason:
tests/integration/test_end_reason.py.)"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from pgjobd.backoff import retry_delay_s
from pgjobd.completer import Completer
from pgjobd.config import QueueConfig
from pgjobd.duration import Duration
from pgjobd.model import ClaimedJob, Outcome

NOW = datetime(2026, 11, 30, tzinfo=UTC)
QUEUE = QueueConfig(
    backoff_base=Duration(seconds=1), backoff_max=Duration(seconds=60), max_crashes=3
)


def claimed(attempt: int = 1, max_attempts: int = 5, crashes: int = 0) -> ClaimedJob:
    return ClaimedJob(
        id=7, fence=70, kind="k", queue="default", attempt=attempt, max_attempts=max_attempts,
        crashes=crashes, priority=0, tenant=None, enqueued_at=NOW, scheduled_at=NOW, args=b"{}",
    )  # fmt: skip


def decide(outcome: Outcome, queue: QueueConfig = QUEUE) -> float:
    """The delay job_fail_many applies if the job runs again."""
    completer = Completer(None, None, "m", {"default": queue}, None)  # type: ignore[arg-type]
    delay = completer._failure_row(outcome)[4]
    assert isinstance(delay, timedelta)
    return delay.total_seconds()


def test_retry_and_snooze_use_the_handlers_delay_and_give_back_is_immediate() -> None:
    assert decide(Outcome(claimed(), "retry", after_s=12.5)) == 12.5
    assert decide(Outcome(claimed(), "snoozed", after_s=300.0)) == 300.0
    assert decide(Outcome(claimed(), "given_back")) == 0.0


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
