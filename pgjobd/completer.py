"""Records outcomes in batches: one statement per batch for completions, one for the rest.

Every write is fence-checked in SQL: an outcome whose job was meanwhile reaped (its
lease lost) changes nothing and is counted as stale.

- Every outcome is made storable first (pgjobd.outcome): no value a handler returns or
  raises can make PostgreSQL refuse it. Should a statement still fail on the values of
  its batch, the batch is split in halves until the outcome at fault is alone; that
  one is recorded as a failed attempt (pgjobd.UnstorableOutcome, naming the error) and
  its neighbours are recorded as they were.
- While the database cannot be written (it is away, read-only, or refuses for reasons
  of its own), outcomes are kept and retried at least every RETRY_MAX_S, so they are
  recorded within about a second of its return; meanwhile `accepting` is false and
  producers claim nothing, so the first thing written on its return is what was kept.
- At shutdown (`give_up_after`, or the task cancelled) every try is bounded: what is
  not recorded by the deadline is logged (completer.abandoned, with the job ids) and
  left to the reaper, which takes each job back when its lease runs out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from pgjobd import backoff, db, metrics
from pgjobd.config import QueueConfig
from pgjobd.errors import TRANSIENT
from pgjobd.fingerprint import fingerprint
from pgjobd.migrate import PARTITION_DAYS_AHEAD
from pgjobd.model import Outcome
from pgjobd.notifier import Wakeup
from pgjobd.outcome import MAX_MESSAGE_CHARS, storable, storable_text
from pgjobd.queries import Queries
from pgjobd.statements.job import CompleteRow, FailRow

log = logging.getLogger(__name__)

MAX_BATCH = 500
FLUSH_AFTER_S = 0.005
# The longest wait between two tries of outcomes kept while the database is away.
RETRY_MAX_S = 1.0
# How long a member shutting down tries to record what it still holds.
FINAL_FLUSH_S = 5.0
UNSTORABLE = "pgjobd.UnstorableOutcome"
# SQLSTATE classes that say nothing about a batch's values: the connection, the
# server's state or resources, privileges, the schema, locks, cancels. Tried again later.
_NOT_THE_VALUES = frozenset({"08", "25", "28", "3D", "3F", "40", "42", "53", "55", "57", "58"})
# Outcomes logged only at debug level (the hot path).
_QUIET = frozenset({"completed", "snoozed"})

Write = Callable[[list[Outcome]], Awaitable[None]]


def refused_values(error: BaseException) -> bool:
    """Whether `error` may come from the values written (so splitting the batch finds
    the one at fault), rather than from the database's state (so trying later helps)."""
    if isinstance(error, asyncpg.PostgresError):
        sqlstate = error.sqlstate or ""
        return not isinstance(error, TRANSIENT) and sqlstate[:2] not in _NOT_THE_VALUES
    # A value asyncpg cannot send (its client-side DataError is an InterfaceError too).
    return isinstance(error, (ValueError, TypeError, OverflowError))


def _missing_partition(error: BaseException) -> bool:
    return isinstance(error, asyncpg.CheckViolationError) and "no partition" in str(error)


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
        self.unstorable = 0
        self.abandoned: list[int] = []  # job ids left to the reaper at shutdown
        # Queues claiming under flow control (their producers say), each with its
        # OwnEnds: when their jobs end, the fleet's producers waiting for room are woken
        # (queue_room_announce).
        self.own_ends: dict[str, OwnEnds] = {}
        self._deadline: float | None = None  # set at shutdown: stop trying then
        self._attempt: anyio.CancelScope | None = None

    async def wait_accepting(self) -> None:
        while not self.accepting:
            await self._accepting_again.wait()

    def give_up_after(self, seconds: float) -> None:
        """Shutdown: stop trying to record outcomes `seconds` from now (the try in
        flight included); what is left then is logged and left to the reaper."""
        deadline = anyio.current_time() + seconds
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
        if self._attempt is not None:
            self._attempt.deadline = min(self._attempt.deadline, deadline)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        pending: list[Outcome] = []  # received, not yet recorded
        async with self.outcomes:
            try:
                while await self._receive_batch(pending):
                    await self._record_retrying(pending)
                    if pending:
                        return  # past the shutdown deadline
            finally:
                # Ended, past the deadline, or cancelled (the member is going down):
                # a bounded last try for what is held, then say what is left.
                with anyio.CancelScope(shield=True):
                    await self._finish(pending)

    async def _receive_batch(self, pending: list[Outcome]) -> bool:
        """Add the next batch to `pending`; False at the end of the stream."""
        try:
            pending.append(storable(await self.outcomes.receive()))
        except anyio.EndOfStream:
            return False
        with anyio.move_on_after(FLUSH_AFTER_S):
            while len(pending) < MAX_BATCH:
                try:
                    # What has arrived is taken without an event-loop turn per outcome.
                    outcome = self.outcomes.receive_nowait()
                except anyio.WouldBlock:
                    try:
                        outcome = await self.outcomes.receive()
                    except anyio.EndOfStream:
                        break
                except anyio.EndOfStream:
                    break
                pending.append(storable(outcome))
        return True

    async def _finish(self, pending: list[Outcome]) -> None:
        while True:
            try:
                pending.append(storable(self.outcomes.receive_nowait()))
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        if not pending:
            return
        if self._deadline is None:
            self.give_up_after(FINAL_FLUSH_S)
        left: list[Outcome] = []
        while pending:
            chunk, pending[:] = pending[:MAX_BATCH], pending[MAX_BATCH:]
            await self._record_retrying(chunk)
            left += chunk
        if left:
            ids = [o.job.id for o in left]
            self.abandoned += ids
            log.warning(
                "shutting down with %d outcomes not recorded (the database cannot be "
                "written); the reaper takes their jobs back when their leases run out: "
                "job ids %s", len(ids), ", ".join(map(str, ids[:20])),
                extra={"event": "completer.abandoned", "member": self.member_id,
                       "count": len(ids), "job_ids": ids[:1000]},
            )  # fmt: skip

    async def _record_retrying(self, pending: list[Outcome]) -> None:
        """Record `pending` (emptying it), trying again while the database cannot be
        written; past the shutdown deadline, return with what is left in it."""
        failures = 0
        while pending:
            now = anyio.current_time()
            if self._deadline is not None and now >= self._deadline:
                return
            try:
                with anyio.CancelScope(shield=True) as self._attempt:
                    if self._deadline is not None:
                        self._attempt.deadline = self._deadline
                    await self._write_all(pending)
            except Exception as e:
                if refused_values(e) or not isinstance(e, (*TRANSIENT, asyncpg.PostgresError)):
                    raise  # a bug: no split happened, or nothing a retry mends
                failures += 1
                if self.accepting:
                    log.warning(
                        "cannot record %d outcomes, holding them: %s", len(pending), e,
                        extra={"event": "completer.blocked"},
                    )  # fmt: skip
                    self.accepting = False
                    self._accepting_again = anyio.Event()
                delay = backoff.jittered(min(RETRY_MAX_S, 0.1 * 2**failures))
                if self._deadline is not None:
                    delay = min(delay, max(0.0, self._deadline - anyio.current_time()))
                await anyio.sleep(delay)
            finally:
                self._attempt = None
        if not self.accepting:
            log.info("recording outcomes again", extra={"event": "completer.unblocked"})
            self.accepting = True
            self._accepting_again.set()

    async def flush(self, batch: list[Outcome]) -> None:
        """Record one batch: completions in one statement, everything else in another.
        Raises only errors after which it may be tried again (the database is away);
        an outcome PostgreSQL refuses costs no other outcome anything."""
        await self._write_all([storable(o) for o in batch])

    async def _write_all(self, pending: list[Outcome]) -> None:
        """Record `pending`, removing from it what is recorded (or dropped)."""
        completed = [o for o in pending if o.verdict == "completed"]
        others = [o for o in pending if o.verdict != "completed"]
        for group, write in ((completed, self._complete), (others, self._fail)):
            if group:
                await self._write_splitting(group, write, pending)

    async def _write_splitting(
        self, group: list[Outcome], write: Write, pending: list[Outcome]
    ) -> None:
        try:
            await self._write_once(group, write)
        except Exception as e:
            if not refused_values(e):
                raise
            if len(group) == 1:
                await self._record_unstorable(group[0], e)
            else:
                half = len(group) // 2
                await self._write_splitting(group[:half], write, pending)
                await self._write_splitting(group[half:], write, pending)
                return
        _remove(pending, group)

    async def _write_once(self, group: list[Outcome], write: Write) -> None:
        try:
            await write(group)
        except asyncpg.CheckViolationError as e:
            if not _missing_partition(e):
                raise
            # Today's history partition is missing (rotator behind): make it, go on.
            log.warning("creating missing history partitions: %s", e)
            async with db.acquire(self.pool) as conn:
                await self.q.partitions_ensure(conn, PARTITION_DAYS_AHEAD)
            await write(group)

    async def _record_unstorable(self, outcome: Outcome, error: BaseException) -> None:
        """Record an outcome PostgreSQL refused as a failed attempt saying why."""
        self.unstorable += 1
        job = outcome.job
        message = storable_text(
            f"PostgreSQL refused to record this attempt's outcome ({outcome.verdict}): "
            f"{type(error).__name__}: {error}",
            MAX_MESSAGE_CHARS,
        )
        log.error(
            "job %d (%s): %s", job.id, job.kind, message,
            extra={"event": "job.unstorable_outcome", "job_id": job.id, "kind": job.kind,
                   "queue": job.queue, "attempt": job.attempt, "member": self.member_id},
        )  # fmt: skip
        failed = Outcome(
            job, "failed", duration_s=outcome.duration_s, error_class=UNSTORABLE,
            error_message=message,
        )  # fmt: skip
        try:
            await self._write_once([failed], self._fail)
        except Exception as e:
            if not refused_values(e):
                raise
            log.error(
                "job %d (%s): cannot record even that its outcome was refused (%s); "
                "the reaper takes it back when its lease runs out", job.id, job.kind, e,
                extra={"event": "completer.unrecordable", "job_id": job.id,
                       "member": self.member_id},
            )  # fmt: skip

    async def _complete(self, completed: list[Outcome]) -> None:
        keeps: dict[str, bool] = {}  # by queue: whether a completed job keeps a record
        rows = []
        for o in completed:
            job = o.job
            keep = keeps.get(job.queue)
            if keep is None:
                keep = keeps[job.queue] = self._queue(o).history == "all"
            result = o.result.decode() if o.result is not None else None
            rows.append(CompleteRow(job.id, job.fence, result, keep))
        async with db.acquire(self.pool) as conn:
            finished = await self.q.job_complete_many(conn, rows)
            self._forget_ends(completed)
            await self._announce_room(conn, completed)
        self._count(completed, {(key.id, key.fence): None for key in finished})

    async def _fail(self, others: list[Outcome]) -> None:
        rows = [self._failure_row(o) for o in others]
        async with db.acquire(self.pool) as conn:
            recorded = await self.q.job_fail_many(conn, rows, self.member_id)
            self._forget_ends(others)
            await self._announce_room(conn, others)
        self._count(others, {(r.id, r.fence): r.reason for r in recorded})

    def track_ends(self, queue: str, wakeup: Wakeup, *, announce: bool) -> OwnEnds:
        """The OwnEnds of a queue that claims under flow control; `announce`: whether its
        recorded ends are announced to the fleet (room for whole claims under the queue's
        lock, not for claims within allocations, whose room is each member's own)."""
        ends = self.own_ends.get(queue)
        if ends is None:
            ends = self.own_ends[queue] = OwnEnds(wakeup)
        ends.announce = announce
        return ends

    def untrack_ends(self, queue: str) -> None:
        self.own_ends.pop(queue, None)

    def _forget_ends(self, recorded: list[Outcome]) -> None:
        if self.own_ends:
            for outcome in recorded:
                own = self.own_ends.get(outcome.job.queue)
                if own is not None:
                    own.fences.discard(outcome.job.fence)

    async def _announce_room(self, conn: asyncpg.Connection, ended: list[Outcome]) -> None:
        """Best effort, after the batch is recorded: should it fail, the batch must not
        be written again (its jobs would count as stale); waiting producers poll."""
        if self.own_ends:
            queues = {o.job.queue for o in ended if self._announces(o.job.queue)}
            if queues:
                try:
                    await self.q.queue_room_announce(conn, sorted(queues), self.member_id)
                except (asyncpg.PostgresError, OSError, asyncpg.InterfaceError) as e:
                    log.debug("could not announce room in queues %s: %s", sorted(queues), e)

    def _announces(self, queue: str) -> bool:
        ends = self.own_ends.get(queue)
        return ends is not None and ends.announce

    def _queue(self, outcome: Outcome) -> QueueConfig:
        return self.queues.get(outcome.job.queue) or self.queues["default"]

    def _count(self, batch: list[Outcome], reasons: dict[tuple[int, int], str | None]) -> None:
        """Count and log the outcomes recorded: `reasons` has each attempt recorded, with
        why its job ended (dead: the reason; or cancelled), else None."""
        self.recorded += len(reasons)
        recorded: list[tuple[Outcome, str | None]] = []
        lost: list[Outcome] = []
        for o in batch:
            key = _key(o)
            if key in reasons:
                recorded.append((o, reasons[key]))
            else:
                lost.append(o)
        metrics.record_outcomes(recorded)
        self._log_outcomes(recorded)
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
            verdict = outcome.verdict
            if verdict in _QUIET and reason is None and not debug:
                continue
            job = outcome.job
            fields: dict[str, Any] = {
                "job_id": job.id, "kind": job.kind, "queue": job.queue,
                "attempt": job.attempt, "member": self.member_id, "outcome": verdict,
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
                    job.id, job.kind, reason, job.attempt, error or verdict, extra=fields,
                )  # fmt: skip
            elif verdict in _QUIET:
                fields["event"] = f"job.{verdict}"
                log.debug("job %d (%s) %s", job.id, job.kind, verdict, extra=fields)
            elif verdict == "given_back":
                fields["event"] = "job.given_back"
                log.info("job %d (%s) given back", job.id, job.kind, extra=fields)
            else:
                fields["event"] = "job.failed"
                log.warning(
                    "job %d (%s) attempt %d of %d failed (%s); it will run again: %s",
                    job.id, job.kind, job.attempt, job.max_attempts, verdict, error or verdict,
                    extra=fields,
                )  # fmt: skip

    def _failure_row(self, outcome: Outcome) -> FailRow:
        """The row for job_fail_many, with the error's fingerprint (computed here for
        the outcomes the supervisor made). Whether the job ends is decided there
        (job_end_reason, the reaper's rule too); the delay applies if it does not."""
        job = outcome.job
        queue = self._queue(outcome)
        if outcome.verdict in ("retry", "snoozed") and outcome.after_s is not None:
            delay_s = outcome.after_s
        elif outcome.verdict == "given_back":
            delay_s = 0.0
        else:
            delay_s = backoff.retry_delay_s(
                job.attempt, queue.backoff_base.total_seconds(), queue.backoff_max.total_seconds()
            )
        return FailRow(
            job.id, job.fence, outcome.verdict, queue.max_crashes, timedelta(seconds=delay_s),
            outcome.error_class, outcome.error_message, outcome.traceback, outcome.duration_s,
            queue.history != "none",
            outcome.fingerprint or fingerprint(outcome.error_class, outcome.error_message),
        )  # fmt: skip


class OwnEnds:
    """One flow queue's jobs whose handlers ended on this member and whose ends are not
    recorded yet, by fence. job_claim_flow leaves them out of its fleet-wide counts of
    running jobs (`ended`): this member's next claim takes their places at once, not
    after the write and the room announcement. The queue's workers add a job's fence
    before they hand its outcome over (and then set `wakeup`, for a producer that a
    limit holds back); the completer removes it once the outcome is written."""

    def __init__(self, wakeup: Wakeup) -> None:
        self.fences: set[int] = set()
        self.wakeup = wakeup
        self.announce = True


def _key(outcome: Outcome) -> tuple[int, int]:
    return outcome.job.id, outcome.job.fence


def _remove(pending: list[Outcome], done: list[Outcome]) -> None:
    """Remove `done`, a part of `pending`, from it."""
    if len(done) == len(pending):  # (all of it: a batch of completions alone, mostly)
        pending.clear()
        return
    gone = {id(o) for o in done}
    pending[:] = [o for o in pending if id(o) not in gone]
