"""The values that flow between the daemon's parts: claimed jobs, outcomes, kinds."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

# The verdict on one run of a job: what became of it, as the worker (or the supervisor,
# for a worker that died or hung) reports it:
#   completed     the handler returned
#   failed        the handler raised; retried with backoff until attempts are spent
#   retry         the handler raised Retry(after=...): retried then, attempt counted
#   snoozed       the handler raised Snooze(...): back later, attempt not counted
#   discarded     Discard(...) or an exception listed in discard_on: dead at once
#   invalid_args  the args do not convert to the handler's args type: dead at once
#   unknown_kind  no handler for the kind on this member: retried (another member, or
#                 a later deploy, may know it) until attempts are spent
#   crashed       the worker process died or was killed holding the job
#   given_back    never run to an end (drain): available again, attempt not charged
Verdict = Literal[
    "completed", "failed", "retry", "snoozed", "discarded", "invalid_args", "unknown_kind",
    "crashed", "given_back",
]  # fmt: skip


class ClaimedJob(msgspec.Struct, frozen=True):
    """A job this member holds, as the claim statement returned it."""

    id: int
    fence: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    crashes: int
    priority: int
    tenant: str | None
    enqueued_at: datetime
    scheduled_at: datetime  # run_at: when the job was due
    args: bytes  # the JSON text, decoded only in the worker process
    # What it waited for (depends_on, after) and how many `after` jobs failed. Their
    # results are read only when the handler asks (ctx.results(): ResultsWanted).
    depends_on: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    after_failed: int = 0
    # The W3C trace context stored at enqueue (pgjobd.tracing), or None.
    trace_context: dict[str, str] | None = None


class Outcome(msgspec.Struct, frozen=True):
    """The end of one attempt of one job, for the completer to record (fence-checked)."""

    job: ClaimedJob
    verdict: Verdict
    duration_s: float = 0.0
    result: bytes | None = None  # JSON text of a completed handler's return value
    error_class: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    after_s: float | None = None  # Retry(after=) / Snooze(...)
    fingerprint: str | None = None  # of the error; the completer fills in a missing one


class KindInfo(msgspec.Struct, frozen=True):
    """A handler's declared defaults, as a worker process reports them when ready."""

    kind: str
    queue: str | None
    priority: int | None
    max_attempts: int | None
    timeout_s: float | None
    global_concurrency: int | None = None
    rate_limit: str | None = None  # "N/DURATION", as flow.RateLimit writes it
    redact: tuple[str, ...] = ()
    circuit_breaker: str | None = None  # failures "N/DURATION", as flow.RateLimit writes it
    breaker_cooldown_s: float | None = None
