"""Records outcomes in batches: one statement per batch for completions, one for the rest.

Every write is fence-checked in SQL: an outcome whose job was meanwhile reaped (its
lease lost) changes nothing and is counted as stale. While the database cannot be
written, outcomes are kept and retried, and `accepting` is false so that producers
stop claiming more work than can be recorded.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from pgjobd import backoff, metrics
from pgjobd.config import QueueConfig
from pgjobd.errors import TRANSIENT
from pgjobd.migrate import PARTITION_DAYS_AHEAD
from pgjobd.model import Outcome
from pgjobd.queries import Queries

log = logging.getLogger(__name__)

MAX_BATCH = 500
FLUSH_AFTER_S = 0.005
# Outcomes that do not count an attempt, or end the job whatever attempts remain.
_ATTEMPT_NOT_COUNTED = frozenset({"snoozed", "given_back"})
# Outcomes logged only at debug level (the hot path).
_QUIET = frozenset({"completed", "snoozed"})
_FINAL_AT_ONCE = {"discarded": "discarded", "invalid_args": "invalid_args"}


class Completer:
    def __init__(
        self,
        pool: asyncpg.Pool,
        queries: Queries,
        member_id: str,
        queues: dict[str, QueueConfig],
        outcomes: MemoryObjectReceiveStream[Outcome],
    ) -> None:
        self.pool = pool
        self.q = queries
        self.member_id = member_id
        self.queues = queues
        self.outcomes = outcomes
        self.accepting = True
        self._accepting_again = anyio.Event()
        self.recorded = 0
        self.stale = 0
        # Jobs given back at a drain deadline: a later report of the same run (the
        # worker's, or its crash) must not be recorded on top.
        self.given_back: set[int] = set()

    async def wait_accepting(self) -> None:
        while not self.accepting:
            await self._accepting_again.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.outcomes:
            closed = False
            while not closed:
                batch: list[Outcome] = []
                try:
                    batch.append(await self.outcomes.receive())
                except anyio.EndOfStream:
                    return
                with anyio.move_on_after(FLUSH_AFTER_S):
                    while len(batch) < MAX_BATCH:
                        try:
                            batch.append(await self.outcomes.receive())
                        except anyio.EndOfStream:
                            closed = True
                            break
                with anyio.CancelScope(shield=True):
                    await self._flush_retrying(batch)

    async def _flush_retrying(self, batch: list[Outcome]) -> None:
        failures = 0
        while True:
            try:
                await self.flush(batch)
            except asyncpg.CheckViolationError as e:
                if "no partition" not in str(e):
                    raise
                # Today's history partition is missing (rotator behind): make it, go on.
                log.warning("creating missing history partitions: %s", e)
                async with self.pool.acquire() as conn:
                    await conn.execute(self.q["partitions_ensure"], PARTITION_DAYS_AHEAD)
                continue
            except TRANSIENT as e:
                failures += 1
                if self.accepting:
                    log.warning(
                        "cannot record %d outcomes, holding them: %s", len(batch), e,
                        extra={"event": "completer.blocked"},
                    )  # fmt: skip
                    self.accepting = False
                    self._accepting_again = anyio.Event()
                await anyio.sleep(backoff.jittered(min(5.0, 0.1 * 2**failures)))
                continue
            if not self.accepting:
                log.info("recording outcomes again", extra={"event": "completer.unblocked"})
                self.accepting = True
                self._accepting_again.set()
            return

    async def flush(self, batch: list[Outcome]) -> None:
        """Record one batch: completions in one statement, everything else in another."""
        completed = [o for o in batch if o.kind == "completed" and self._recordable(o)]
        others = [o for o in batch if o.kind != "completed" and self._recordable(o)]
        async with self.pool.acquire() as conn:
            if completed:
                rows = await conn.fetch(
                    self.q["job_complete_many"],
                    [o.job.id for o in completed],
                    [o.job.fence for o in completed],
                    [o.result.decode() if o.result is not None else None for o in completed],
                    [self.queues[o.job.queue].history == "all" for o in completed],
                )
                self._count(completed, rows)
            if others:
                columns = list(zip(*(self._failure_row(o) for o in others), strict=True))
                rows = await conn.fetch(self.q["job_fail_many"], *columns, self.member_id)
                self._count(others, rows)

    def _recordable(self, outcome: Outcome) -> bool:
        return outcome.kind == "given_back" or outcome.job.id not in self.given_back

    def _count(self, batch: list[Outcome], rows: list[asyncpg.Record]) -> None:
        # job_fail_many says why a job ended (dead: the reason; or cancelled), else NULL.
        reasons: dict[int, str | None] = {row["id"]: row.get("reason") for row in rows}
        self.recorded += len(reasons)
        recorded = [(o, reasons[o.job.id]) for o in batch if o.job.id in reasons]
        metrics.record_outcomes(recorded)
        self._log_outcomes(recorded)
        lost = [o for o in batch if o.job.id not in reasons]
        if lost:
            self.stale += len(lost)
            for o in lost:
                metrics.STALE_OUTCOMES.labels(o.job.queue).inc()
            log.warning(
                "dropped %d outcomes whose lease was lost: job ids %s",
                len(lost), ", ".join(str(o.job.id) for o in lost[:20]),
                extra={"event": "job.stale_outcome", "member": self.member_id,
                       "job_ids": [o.job.id for o in lost[:100]]},
            )  # fmt: skip

    def _log_outcomes(self, recorded: list[tuple[Outcome, str | None]]) -> None:
        """One line per recorded outcome: completions and snoozes at debug (none on the
        hot path by default), failed attempts at warning, dead jobs at error."""
        debug = log.isEnabledFor(logging.DEBUG)
        for outcome, reason in recorded:
            kind = outcome.kind
            if kind in _QUIET and reason is None and not debug:
                continue
            job = outcome.job
            fields: dict[str, Any] = {
                "job_id": job.id, "kind": job.kind, "queue": job.queue,
                "attempt": job.attempt, "member": self.member_id, "outcome": kind,
                "duration_s": round(outcome.duration_s, 6),
            }  # fmt: skip
            error = ": ".join(e for e in (outcome.error_class, outcome.error_message) if e)
            if error:
                fields["error"] = error
            if reason == "cancelled":
                fields["event"] = "job.cancelled"
                log.info("job %d (%s) cancelled", job.id, job.kind, extra=fields)
            elif reason is not None:
                fields.update(event="job.dead", reason=reason)
                log.error(
                    "job %d (%s) is dead (%s) after attempt %d: %s",
                    job.id, job.kind, reason, job.attempt, error or kind, extra=fields,
                )  # fmt: skip
            elif kind in _QUIET:
                fields["event"] = f"job.{kind}"
                log.debug("job %d (%s) %s", job.id, job.kind, kind, extra=fields)
            elif kind == "given_back":
                fields["event"] = "job.given_back"
                log.info("job %d (%s) given back", job.id, job.kind, extra=fields)
            else:
                fields["event"] = "job.failed"
                log.warning(
                    "job %d (%s) attempt %d of %d failed (%s); it will run again: %s",
                    job.id, job.kind, job.attempt, job.max_attempts, kind, error or kind,
                    extra=fields,
                )  # fmt: skip

    def _failure_row(self, outcome: Outcome) -> tuple[Any, ...]:
        """(id, fence, outcome, final, reason, delay, error class, message, traceback,
        duration, keep history) for job_fail_many."""
        job = outcome.job
        queue = self.queues.get(job.queue) or self.queues["default"]
        reason = _FINAL_AT_ONCE.get(outcome.kind)
        if reason is None and outcome.kind == "crashed" and job.crashes + 1 >= queue.max_crashes:
            reason = "worker_crash"
        if (
            reason is None
            and outcome.kind not in _ATTEMPT_NOT_COUNTED
            and job.attempt >= job.max_attempts
        ):
            reason = "unknown_kind" if outcome.kind == "unknown_kind" else "attempts_exhausted"
        if outcome.kind in ("retry", "snoozed") and outcome.after_s is not None:
            delay_s = outcome.after_s
        elif outcome.kind == "given_back":
            delay_s = 0.0
        else:
            delay_s = backoff.retry_delay_s(
                job.attempt, queue.backoff_base.total_seconds(), queue.backoff_max.total_seconds()
            )
        return (
            job.id, job.fence, outcome.kind, reason is not None, reason,
            timedelta(seconds=delay_s), outcome.error_class, outcome.error_message,
            outcome.traceback, outcome.duration_s, queue.history != "none",
        )  # fmt: skip
