"""One queue's claim loop: claims as many jobs as its workers have free slots, in one
statement, and hands them to the queue workers.

It claims only when a slot is free and the completer is keeping up. Between claims it
waits for a NOTIFY wake-up or, failing that, polls with an interval that doubles while
the queue stays empty (up to MAX_POLL_S) and drops back as soon as work turns up.

Queues without flow control claim with `job_claim`, the statement of an unlimited queue.
A queue with fleet-wide limits or groups (its own, or any kind's) claims with
`job_claim_flow`; `job_claim` refuses such a queue, so a producer that has not noticed a
new limit claims nothing rather than too much. Two of those claim by statements of their
own, without the queue's lock: one whose only limit is its global_concurrency, within
the member's allocation of it (`flow_allocate`, `job_claim_allocated`), and one whose
only limit is `fair = true`, by its jobs' tags (`job_claim_fair`). The producer reads
which path applies (`queue_claim_path_get`) at its first claim, and again at most every
FLOW_RECHECK_S after a claim that came back short (after the hand-over of what it took).
While a limit holds jobs back, it claims again FLOW_GATHER_S after one of its own jobs
ends (a fleet-wide count leaves out a job whose handler has ended here: OwnEnds) or
another member announces an end (queue_room_announce), or after MIN_POLL_S. Within an
allocation it claims as it does for free slots, the allocation's room standing for them
(its ceiling less the jobs the member runs): the room is the member's own, so no other
member's end is announced or waited for, and no claim is made while there is none.

A claim and the hand-over of what it claimed are one step that cancellation does not
split: once `job_claim` may have committed, the jobs reach the workers (or are given
back by them). Cancelling the producer (a drain, a reload retiring its workers) ends
its loops between claims; a claim in flight runs to its end, bounded by `stop()`.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple, Protocol, cast

import anyio
import asyncpg

from pgjobd import backoff, db, metrics
from pgjobd.completer import Completer, OwnEnds
from pgjobd.errors import retry_later
from pgjobd.model import ClaimedJob
from pgjobd.notifier import Wakeup
from pgjobd.queries import Queries
from pgjobd.statements.job import ClaimKey, ClaimPath, ClaimRow, FlowClaimRow

log = logging.getLogger(__name__)

CLAIMERS = 2
MIN_POLL_S = 0.05
MAX_POLL_S = 1.0
# When every slot was filled last time, wait up to this long for a share of the slots
# (BATCH_SHARE of them) to free up, so that one claim statement serves several jobs
# instead of one each; no longer than it takes them to free up (slots free in bursts:
# a worker reports what ended in one write), so that a queue with few slots does not
# pay the window on every claim. Half the slots rather than a quarter: at the default
# concurrency a claim of a quarter (5) is a round trip for 5 jobs, and two claim loops
# then bound the drain (bench/throughput.py --rounds 2:20:all, alternating: a quarter
# 3,970, 4,355, 3,761, 4,075 jobs/s; half 4,551, 4,995, 4,124, 4,237; at concurrency
# 100 the same within noise).
BATCH_WINDOW_S = 0.002
BATCH_SHARE = 2
# Under flow control a claim holds the queue's lock fleet-wide and costs milliseconds
# whatever it takes: wait longer, for half the slots (a claim per freed place would
# serialise the fleet on the lock; measured: bench/flow.py).
FLOW_BATCH_WINDOW_S = 0.025
FLOW_BATCH_SHARE = 2
FLOW_RECHECK_S = 1.0
# A claim held back by a limit waits this long once room comes back, so that it takes
# the places that free up meanwhile in one claim rather than one claim each (measured,
# bench/flow.py global_50 on a quiet box, single drains alternating: 0 s 4,344, 4,836,
# 6,261 jobs/s; 5 ms 4,975, 6,263, 6,907; 20 ms 5,292, 6,226, 6,733).
FLOW_GATHER_S = 0.005
# A member holds an allocation of a global_concurrency (flow_allocate, migration 0025) and
# claims within it without the queue's lock. It makes the allocation anew when it is
# smaller than the member's demand, at most every ALLOCATE_EVERY_S (each is a round trip
# under the queue's lock, fleet-wide) and less often while it comes back unchanged, and
# at least every ALLOCATE_RENEW_S while it claims: the
# allocation expires 5 s after it was made, and the renewal is also where the member
# learns that another wants a share and gives places back.
ALLOCATE_EVERY_S = 0.02
ALLOCATE_RENEW_S = 0.1


# A producer of a queue without flow control starts each claim after the furthest job
# its claims took, in claim order (job_claim's `after`), and from the head of the queue
# only when a job is available behind that cursor. Each claimed job leaves an index entry
# at the head of the claim index that a claim from the head walks again until vacuum
# removes it; while a snapshot holds the xmin horizon none can be skipped without a heap
# visit, and every claim's cost grew with every job run since (bench/horizon.py at the
# defaults: held at 0.30 of the free rate from the head every time, 0.55 every 8 claims;
# see decisions.md). Whether a job waits behind the cursor (a higher priority, a
# promoted or retried job due earlier, a transaction that committed after a later one, a
# claim rolled back, the cursor's own job rescued by the reaper) is asked beside the
# claims (job_available_behind, the walk from the head without locks, in a task of its
# own): once the jobs of a claim that came back short are handed over, and every
# CURSOR_HEAD_S while claims come back full. So the claims stay after the
# cursor and a held horizon's walk is off their path, and a job behind the cursor waits
# one look (and a claim from the head), up to CURSOR_HEAD_S while the queue has a
# backlog.
CURSOR_HEAD_S = 0.25


class ClaimStart(NamedTuple):
    """Where a claim started (None: the head), and the cursor's epoch then."""

    after: ClaimKey | None
    epoch: int


# A claimed row's place in claim order, as a plain tuple (ClaimKey's fields).
_claim_order = operator.attrgetter("priority", "scheduled_at", "id")


class ClaimCursor:
    """Where a producer's next job_claim starts, and when to look behind it (see
    CURSOR_HEAD_S)."""

    def __init__(self) -> None:
        self.after: ClaimKey | None = None
        self._epoch = 0  # how many times a look sent the cursor to the head
        self._looked_at = -math.inf

    def start(self) -> ClaimStart:
        """Where the next claim starts."""
        return ClaimStart(self.after, self._epoch)

    def took(self, start: ClaimStart, rows: Sequence[ClaimRow], limit: int) -> bool:
        """A claim of `limit` from `start` returned `rows`; whether to look behind the
        cursor now."""
        if start.epoch != self._epoch:
            # Sent to the head since this claim began: its rows must not move the cursor
            # past the job found behind before a claim from the head has taken it.
            return False
        if rows:
            last = ClaimKey.of(max(rows, key=_claim_order))
            # (Two claim loops share the cursor: it never moves back but to the head.)
            if self.after is None or last > self.after:
                self.after = last
        if self.after is None:
            return False
        now = time.monotonic()
        if len(rows) < limit or now - self._looked_at >= CURSOR_HEAD_S:
            self._looked_at = now
            return True
        return False

    def behind(self, looked_after: ClaimKey) -> None:
        """A job was available at or before `looked_after` (the cursor when the look
        began): the next claim starts from the head."""
        if self.after is not None and self.after >= looked_after:
            self.after = None
            self._epoch += 1


class Workers(Protocol):
    own_ends: OwnEnds | None

    def slots(self) -> int: ...
    def free_slots(self) -> int: ...
    def running(self) -> int: ...
    async def wait_changed(self) -> None: ...
    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None: ...


class Producer:
    def __init__(
        self,
        queue: str,
        *,
        pool: asyncpg.Pool,
        queries: Queries,
        workers: Workers,
        wakeup: Wakeup,
        completer: Completer,
        member_id: str,
        lease: timedelta,
    ) -> None:
        self.queue = queue
        self.pool = pool
        self.q = queries
        self.workers = workers
        self.wakeup = wakeup
        self.completer = completer
        self.member_id = member_id
        self.lease = lease
        self.reserved = 0  # slots a claim in flight will fill
        self._in_flight: set[anyio.CancelScope] = set()  # steps _shielded from cancelling
        self._stop_by: float | None = None
        self.claim_seconds: list[float] = []  # recent claim durations, for metrics
        self.claimed = 0
        self.cursor = ClaimCursor()  # job_claim's start (queues without flow control)
        self._look_due = False  # a claim asked for a look: asked once its jobs are handed over
        self._look_behind = anyio.Event()  # set: look for a job behind the cursor now
        self.path: ClaimPath | None = None  # which claim statement: None, not read yet
        self._allocated_at = -math.inf
        self._ceiling: int | None = None  # the allocation's ceiling, as last made
        self._renew_after_s = ALLOCATE_RENEW_S  # the allocation's renewal is due then
        self._flow_read_at = -math.inf
        self._flow_recheck = False  # a claim came back short with jobs: read the path after
        self.throttled = False  # the last claim was held back by a limit
        # The database held back a claim within the allocation where the workers' count
        # saw room (jobs running outside the workers' slots, as after a reload): wait
        # for room as under the queue's lock, not by the workers' count alone.
        self._room_misjudged = False
        self._flow_changed = anyio.Event()  # set (and made anew) as the claim path changes

    async def run(self) -> None:
        """Run CLAIMERS claim loops. Two loops overlap one claim's round trip with the
        next, so freed slots don't sit idle while a claim is in flight; slots are
        reserved before a claim, so together they never claim more than is free. Under
        flow control only the first claims, unless the queue's claims leave the queue's
        lock alone (an allocation's or a fair-only queue's, see _claim_flow): whole
        claims under the lock queue for it fleet-wide, and a second loop of the same
        member only waits there (and comes back empty more often: measured with
        bench/flow.py, global_50 before migration 0025, 4,282 jobs/s with one loop
        against 3,470 with two, medians of 3)."""
        async with anyio.create_task_group() as tg:
            for loop in range(CLAIMERS):
                tg.start_soon(self._claim_loop, loop)
            tg.start_soon(self._look_behind_loop)

    def stop(self, within_s: float) -> None:
        """Bound a claim in flight to `within_s` from now (the database may be away);
        the caller cancels the producer. A claim cut short may have committed: its jobs
        are then left to the reaper (attempt charged)."""
        self._stop_by = anyio.current_time() + within_s
        for scope in self._in_flight:
            scope.deadline = min(scope.deadline, self._stop_by)

    @contextmanager
    def _shielded(self) -> Iterator[anyio.CancelScope]:
        """A step that cancelling the producer does not cut short; only stop() bounds
        it (its scope's `cancelled_caught` then says so)."""
        with anyio.CancelScope(shield=True) as scope:
            if self._stop_by is not None:
                scope.deadline = self._stop_by
            self._in_flight.add(scope)
            try:
                yield scope
            finally:
                self._in_flight.discard(scope)

    @property
    def flow(self) -> bool | None:
        """Whether the queue claims under flow control (None: not read yet)."""
        return None if self.path is None else self.path != "plain"

    def _lock_free(self) -> bool:
        """Whether this queue's flow-control claims leave the queue's lock to others
        while they fetch their jobs (so that a second claim loop helps)."""
        return self.path in ("allocated", "fair")

    def _unreserved(self) -> int:
        free = self.workers.free_slots() - self.reserved
        if self._within_allocation():
            free = min(free, self._allocation_room())
        return free

    def _allocation_room(self) -> int:
        """The allocation's ceiling less the jobs the member runs and the slots its claims
        in flight reserved."""
        return cast(int, self._ceiling) - self.workers.running() - self.reserved

    def _within_allocation(self) -> bool:
        """Whether claims are bounded by the member's allocation as last made (until its
        renewal is due: the renewal's claim asks for every free slot, its demand)."""
        if self.path != "allocated" or self._ceiling is None:
            return False
        return not self._allocation_due()

    def _slots_poll_s(self) -> float:
        """How long to wait for a change of the workers' slots before looking again: at
        most until the allocation's renewal is due, when the claim asks for more."""
        if not self._within_allocation():
            return MIN_POLL_S
        due_in_s = self._allocated_at + self._renew_after_s - time.monotonic()
        return min(MIN_POLL_S, max(0.0, due_in_s))

    def _allocation_due(self) -> bool:
        return time.monotonic() - self._allocated_at >= self._renew_after_s

    async def _claim_loop(self, loop: int) -> None:
        poll_s = MIN_POLL_S
        saturated = False
        failures = 0
        while True:
            while loop > 0 and (self.flow is None or (self.flow and not self._lock_free())):
                await self._flow_changed.wait()
            while self._unreserved() <= 0:
                # Bounded: slots another loop reserved and did not fill come back without
                # a change of the workers' slots, and that loop may then sit out (flow
                # control), leaving this one to claim them.
                with anyio.move_on_after(self._slots_poll_s()):
                    await self.workers.wait_changed()
            await self.completer.wait_accepting()
            if saturated:
                await self._gather_slots()
            limit = self._unreserved()
            if limit <= 0:
                continue
            if self._stop_by is not None:
                return
            self.wakeup.clear()
            self.reserved += limit
            try:
                with self._shielded() as scope:
                    jobs = await self.claim(limit)
                    await self.workers.submit_many(jobs)
                if scope.cancelled_caught:
                    log.warning(
                        "a claim from queue %s did not end in time as the producer stopped; "
                        "what it claimed is left to the reaper", self.queue,
                        extra={"event": "producer.claim_abandoned", "queue": self.queue},
                    )  # fmt: skip
                    return
            except Exception as e:
                if not retry_later(e):
                    raise
                failures += 1
                log.warning(
                    "claim from queue %s failed: %s", self.queue, e,
                    extra={"event": "producer.claim_failed", "queue": self.queue},
                )  # fmt: skip
                await anyio.sleep(backoff.jittered(min(5.0, 0.1 * 2**failures)))
                continue
            finally:
                self.reserved -= limit
            failures = 0
            if self._look_due:  # (after the hand-over, as the re-read below)
                self._look_due = False
                self._look_behind.set()
            if self._flow_recheck:
                # Shielded as the claim is: a statement cut short sends a cancel request
                # on a connection of its own, which a pool closing under it breaks.
                with self._shielded():
                    await self._recheck_flow()
            saturated = len(jobs) == limit
            if jobs:
                poll_s = MIN_POLL_S
            if self.throttled:
                # (Within an allocation the loop's first wait is for room, as for slots.)
                if self.path != "allocated" or self._room_misjudged:
                    await self._wait_for_room()
            elif not saturated:
                await self.wakeup.wait(poll_s)
                poll_s = min(poll_s * 2, MAX_POLL_S)

    async def claim(self, limit: int) -> list[ClaimedJob]:
        started = time.perf_counter()
        async with db.acquire(self.pool) as conn:
            if self.flow is None:
                await self._read_flow(conn)
            if self.flow:
                rows, held = await self._claim_flow(conn, limit)
                self.throttled = bool(held)
                metrics.record_throttled(self.queue, [h for h in held if h is not None])
            else:
                start = self.cursor.start()
                rows = await self.q.job_claim(
                    conn, self.queue, limit, self.member_id, self.lease,
                    *(start.after or (None, None, None)),
                )  # fmt: skip
                self._took(start, rows, limit)
            if len(rows) < limit and time.monotonic() - self._flow_read_at >= FLOW_RECHECK_S:
                if rows:  # after their hand-over: nothing stands between a claim and it
                    self._flow_read_at = time.monotonic()
                    self._flow_recheck = True
                else:
                    await self._read_flow(conn)
        seconds = time.perf_counter() - started
        self.claim_seconds.append(seconds)
        if len(self.claim_seconds) > 1000:
            del self.claim_seconds[:500]
        self.claimed += len(rows)
        metrics.record_claim(
            self.queue, seconds, [row.kind for row in rows], [row.waited_s for row in rows]
        )
        return [row.claimed_job() for row in rows]

    def _took(self, start: ClaimStart, rows: Sequence[ClaimRow], limit: int) -> None:
        if self.cursor.took(start, rows, limit):
            self._look_due = True

    async def _look_behind_loop(self) -> None:
        """Look for a job available behind the claim cursor when a claim asks for it (see
        CURSOR_HEAD_S); one found sends the next claim to the head, at once."""
        while True:
            await self._look_behind.wait()
            self._look_behind = anyio.Event()
            after = self.cursor.after
            if after is None:
                continue
            if self._stop_by is not None:
                return
            try:
                # Shielded as a claim is (a statement cut short: see _claim_loop).
                with self._shielded() as scope:
                    async with db.acquire(self.pool) as conn:
                        behind = await self.q.job_available_behind(conn, self.queue, *after)
                if scope.cancelled_caught:
                    return
            except Exception as e:
                if not retry_later(e):
                    raise
                log.warning(  # (the claims ask again: at most every CURSOR_HEAD_S when full)
                    "looking behind the claim cursor of queue %s failed: %s", self.queue, e,
                    extra={"event": "producer.look_behind_failed", "queue": self.queue},
                )  # fmt: skip
                continue
            if behind:
                self.cursor.behind(after)
                self.wakeup.set()

    async def _claim_flow(
        self, conn: asyncpg.Connection, limit: int
    ) -> tuple[list[ClaimRow], list[str | None]]:
        """A claim under flow control, and the limits that held jobs back. A queue whose
        only limit is its global_concurrency claims within the member's allocation of it
        (_claim_allocated); one whose only limit is fair = true claims by its jobs' tags
        without the lock (job_claim_fair, which holds nothing back); any other takes the
        whole claim under its locks (job_claim_flow)."""
        if self.path == "fair":
            return await self.q.job_claim_fair(
                conn, self.queue, limit, self.member_id, self.lease
            ), []
        own = self.workers.own_ends
        ended = list(own.fences) if own is not None else []
        flow_rows = None
        if self.path == "allocated":
            flow_rows = await self._claim_allocated(conn, limit, ended)
            if flow_rows is None:
                self.path = "limited"  # a limit or groups since: the whole claim from now on
        if flow_rows is None:
            flow_rows = await self.q.job_claim_flow(
                conn, self.queue, limit, self.member_id, self.lease, ended
            )
        held = [row.held_by for row in flow_rows if row.id is None]
        return [row.claim_row() for row in flow_rows if row.id is not None], held

    async def _claim_allocated(
        self, conn: asyncpg.Connection, limit: int, ended: list[int]
    ) -> list[FlowClaimRow] | None:
        """A claim within the member's allocation of the queue's global_concurrency,
        made anew first when due (see ALLOCATE_EVERY_S); None when the queue has other
        limits since."""
        if self._allocation_due():
            self._allocated_at = time.monotonic()
            allocation = await self.q.flow_allocate(conn, self.queue, self.member_id, ended, limit)
            if allocation is None:
                return None
            self._allocated(allocation.ceiling, self.workers.running() + limit)
            # This claim's own slots are in `reserved`: its room is that and more.
            limit = min(limit, self._allocation_room() + limit)
            if limit <= 0:
                self._room_misjudged = False
                return [FlowClaimRow.held_back("global_concurrency")]  # no room: no claim
        start = self.cursor.start()
        rows = await self.q.job_claim_allocated(
            conn, self.queue, limit, self.member_id, self.lease, ended,
            *(start.after or (None, None, None)),
        )  # fmt: skip
        claimed = [row.claim_row() for row in rows if row.id is not None]
        self._room_misjudged = len(claimed) < len(rows)
        if len(claimed) == limit and self.workers.free_slots() > self.reserved:
            # Jobs were there for slots left free: the allocation held them back.
            metrics.record_throttled(self.queue, ["global_concurrency"])
        if len(claimed) == len(rows):
            self._took(start, claimed, limit)
        elif claimed:  # as many as the allocation allowed: a full claim of that many
            self._took(start, claimed, len(claimed))
        return rows

    def _allocated(self, ceiling: int, demand: int) -> None:
        """An allocation of `ceiling` places was made for a demand of `demand`. One short
        of the demand is renewed sooner (ALLOCATE_EVERY_S), and again later each time it
        comes back unchanged (up to ALLOCATE_RENEW_S): the other members give places
        back as their jobs end, after their own renewals, and a member held at its share
        need not ask the fleet-wide lock fifty times a second."""
        if ceiling >= demand:
            self._renew_after_s = ALLOCATE_RENEW_S
        elif ceiling != self._ceiling:
            self._renew_after_s = ALLOCATE_EVERY_S
        else:
            self._renew_after_s = min(self._renew_after_s * 2, ALLOCATE_RENEW_S)
        self._ceiling = ceiling

    async def _gather_slots(self) -> None:
        if self._within_allocation():
            enough = max(1, cast(int, self._ceiling) // BATCH_SHARE)
            window_s = BATCH_WINDOW_S
        elif self.path == "limited":
            enough = max(1, self.workers.slots() // FLOW_BATCH_SHARE)
            window_s = FLOW_BATCH_WINDOW_S
        else:
            enough, window_s = max(1, self.workers.slots() // BATCH_SHARE), BATCH_WINDOW_S
        with anyio.move_on_after(window_s):
            while self._unreserved() < enough:
                await self.workers.wait_changed()

    async def _wait_for_room(self) -> None:
        """A limit held the last claim back. Room comes back when a running job of the
        queue ends: here, the queue's workers set the wake-up as they free its place
        (OwnEnds); on another member, its completer announces it on the queue's
        wake-up once it has recorded the end (queue_room_announce). Wait for either,
        or poll should the announcement not come (the LISTEN session away, a rate
        limit's window moving on); then FLOW_GATHER_S more, for more room."""
        await self.wakeup.wait(MIN_POLL_S)
        await anyio.sleep(FLOW_GATHER_S)

    async def _recheck_flow(self) -> None:
        """The claim path's re-read that a short claim with jobs left until they were
        handed over. A failure leaves the path as it was, read again after the next
        short claim."""
        self._flow_recheck = False
        try:
            async with db.acquire(self.pool) as conn:
                await self._read_flow(conn)
        except Exception as e:
            if not retry_later(e):
                raise
            self._flow_read_at = -math.inf
            log.warning(
                "reading how queue %s claims failed: %s", self.queue, e,
                extra={"event": "producer.claim_path_failed", "queue": self.queue},
            )  # fmt: skip

    async def _read_flow(self, conn: asyncpg.Connection) -> None:
        path = cast(ClaimPath, await self.q.queue_claim_path_get(conn, self.queue))
        self._flow_read_at = time.monotonic()
        if path in ("allocated", "limited"):  # (a fair-only claim waits for no room)
            self.workers.own_ends = self.completer.track_ends(
                self.queue, self.wakeup, announce=path == "limited"
            )
        else:
            self.workers.own_ends = None
            self.completer.untrack_ends(self.queue)
        flow = path != "plain"
        if flow != self.flow and (flow or self.path is not None):
            self.throttled = False
            log.info(
                "queue %s claims %s", self.queue,
                "under flow control" if flow else "without flow control",
                extra={"event": "producer.flow_changed", "queue": self.queue, "flow": flow},
            )  # fmt: skip
        if path != self.path:
            self._allocated_at = -math.inf
            self._ceiling, self._renew_after_s = None, ALLOCATE_RENEW_S
            self.path = path
            self._flow_changed.set()
            self._flow_changed = anyio.Event()
