"""A queue's worker processes: start them, feed them jobs, replace them when they die.

The supervisor claims; worker processes (pgjobd.worker) only execute. A QueueWorkers always
knows which job is in which child, so a child's death is charged to exactly the jobs it
held, at once, as `crashed` outcomes.

- Slots: the queue's `concurrency` is split across its `processes` children (the first
  `concurrency % processes` children get one more). `submit` picks the ready child with
  the most free slots.
- Deadlines: a job must end within its timeout (the handler's declared timeout, else the
  queue's) plus `grace_s` after it was sent. The child cancels an async handler at its
  timeout; a watchdog SIGKILLs a child still holding a job past the deadline (a `def`
  handler's thread cannot be interrupted; an async one may block its event loop).
- Deaths: every job the child held becomes `crashed` with the exit status or signal in
  error_message; a SIGKILL we did not send gets an OOM hint. The child is replaced at
  once if it had been ready, else after a growing delay (BOOT_BACKOFF_S).
- Boot: `run` starts every child and waits for each one's Ready before it reports
  started. A child of that first generation that fails to boot (a handler module that
  does not import) makes `run` raise ConfigError with the child's message: the daemon
  exits 78 rather than crash-looping.
- Process groups: each child starts in a session (and process group) of its own, so a
  signal sent to the daemon's group (a terminal's Ctrl-C, `timeout`) does not reach it;
  children ignore SIGTERM, SIGINT and SIGHUP anyway, and the daemon drives shutdown.
  Every kill is a SIGKILL to the child's whole process group, and a child that ends for
  any reason takes its group with it: what a handler forked ends with its worker.
  Descendants that leave the group (setsid, setpgid) are the daemon's to sweep up as a
  child subreaper (see `become_subreaper`, `kill_strays`). Their stderr is the daemon's.
- Death: noticed from the process itself (its exit status), not from the end of its
  output, which a descendant holding the pipe open could delay forever.
- Draining: `drain()` makes the queue's workers take no more jobs and replace no child that ends.
  `give_back_all()` kills the children holding jobs first and then reports those jobs
  given_back, so that no handler still runs once its job has been given back.
- Shutdown: when `run` is cancelled, each child gets Stop and `grace_s` to finish what it
  holds (outcomes that arrive meanwhile are still sent, as long as `outcomes` accepts
  them), then SIGKILL. Jobs without an outcome stay in `held()` for the caller to give
  back; they are not reported as crashed.
- Keys: a job in flight is known by (id, fence), its attempt: a member may hold two
  attempts of one job when its lease ran out and the same member claimed it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from anyio.abc import Process, TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from pgjobd import metrics
from pgjobd.channel import Channel
from pgjobd.config import QueueConfig
from pgjobd.errors import ConfigError
from pgjobd.model import ClaimedJob, KindInfo, Outcome
from pgjobd.protocol import (
    EXIT_BOOT,
    MAX_FRAME,
    BootFailed,
    Cancel,
    Done,
    ProtocolError,
    Ready,
    Results,
    ResultsWanted,
    Run,
    Stop,
    ToChild,
    ToParent,
)

if TYPE_CHECKING:
    from pgjobd.completer import OwnEnds

log = logging.getLogger(__name__)

BOOT_TIMEOUT_S = 60.0
BOOT_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# A child that exits on its own this soon after Ready, holding no job, counts as a failed
# boot for the backoff (a handler module that kills its process from a thread).
MIN_UPTIME_S = 10.0
OOM_HINT = "(SIGKILL: possibly the kernel's OOM killer)"
# This many boot failures in a row mark the queue failed (it keeps retrying at the
# longest delay, and recovers by itself once a worker starts).
CRASH_LOOP_LIMIT = 5
RSS_CHECK_S = 5.0
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# After a child exited, how long frames it wrote before may take to be read. (Its output
# may never end: a descendant can hold the pipe open.)
READ_AFTER_EXIT_S = 1.0
PR_SET_CHILD_SUBREAPER = 36

JobKey = tuple[int, int]  # (id, fence): one attempt of a job


@dataclass(eq=False, slots=True)
class _Held:
    job: ClaimedJob
    sent_at: float
    timeout_s: float
    deadline: float


@dataclass(eq=False)
class _Child:
    index: int
    slots: int
    process: Process
    channel: Channel[ToParent]
    kinds: dict[str, KindInfo] = field(default_factory=dict)
    ready: bool = False
    retiring: bool = False
    held: dict[JobKey, _Held] = field(default_factory=dict)
    kill_reason: str | None = None  # set when we SIGKILL it; None: it died on its own
    overdue_job: JobKey | None = None
    ready_at: float = 0.0
    crashed_jobs: int = 0
    jobs_done: int = 0
    recycled: str | None = None  # why it was asked to stop and be replaced
    # A job that has crashed a worker before runs here without new neighbours: if it
    # kills the process again, it takes no job that arrived after it down with it.
    suspect: JobKey | None = None
    served: anyio.Event = field(default_factory=anyio.Event)  # set when its end is settled
    handing_over: bool = False  # an outcome it reported is being passed on

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def free(self) -> int:
        if not self.ready or self.retiring or self.suspect is not None:
            return 0
        return self.slots - len(self.held)


class _BootError(Exception):
    pass


class QueueWorkers:
    """One queue's worker processes, and the jobs in flight in them."""

    def __init__(
        self,
        queue: str,
        config: QueueConfig,
        handler_dirs: Sequence[Path],
        outcomes: MemoryObjectSendStream[Outcome],
        *,
        grace_s: float = 5.0,
        boot_timeout_s: float = BOOT_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        results_source: Callable[[list[int]], Awaitable[bytes | None]] | None = None,
        middleware: Sequence[str] = (),
    ) -> None:
        self.queue = queue
        # Reads the results a running job waited for, when its handler asks for them.
        self.results_source = results_source
        self.config = config
        self.handler_dirs = [Path(d) for d in handler_dirs]
        self.middleware = list(middleware)  # "module:callable" names, outermost first
        self.outcomes = outcomes
        self.grace_s = grace_s
        self.boot_timeout_s = boot_timeout_s
        # Added to the children's environment (the daemon's log format, its member id).
        self.env = dict(env or {})
        self._children: dict[int, _Child] = {}  # by slot index
        self._changed: anyio.Event | None = None
        self._deadlines_changed: anyio.Event | None = None
        self._tg: TaskGroup | None = None
        self._stopping = False
        self._draining = False
        self._slot_scopes: dict[int, anyio.CancelScope] = {}
        self._slot_ended: dict[int, anyio.Event] = {}
        self._watchdog_wakes_at = -math.inf  # no need to wake it for later deadlines
        # Why this queue cannot run workers (a crash loop), for /readyz; None when fine.
        self.failed: str | None = None
        # Set by the producer while the queue claims under flow control.
        self.own_ends: OwnEnds | None = None
        # A job that crashed before found no worker to run it apart and was given back:
        # more may wait (a dead member's jobs), so a claim takes one per worker with room.
        self._apart_waiting = False

    # -- the producer's and lease keeper's interface ---------------------------------

    def slots(self) -> int:
        """The queue's slots in all (its concurrency), free or not."""
        return self.config.concurrency

    def free_slots(self) -> int:
        """Slots of ready, not-retiring children, minus the jobs in flight in them. While
        jobs that crashed before may be waiting (one was given back for want of a worker
        to run it apart), one per child with room: a claim then takes no more of them
        than it can place, rather than giving back all but one each time a worker frees."""
        if self._draining:
            return 0
        if self._apart_waiting:
            return sum(1 for child in self._children.values() if child.free > 0)
        return sum(child.free for child in self._children.values())

    def running(self) -> int:
        """The jobs in flight in these workers (retiring children's too)."""
        return sum(len(child.held) for child in self._children.values())

    async def wait_free(self) -> None:
        """Return when free_slots() > 0."""
        while self.free_slots() <= 0:
            await self._changed_event().wait()

    async def submit(self, job: ClaimedJob) -> None:
        """Send the job to the ready child with the most free slots (see submit_many)."""
        await self.submit_many([job])

    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None:
        """Spread the jobs over the ready children, most free slots first, with one
        write per child.

        Call with no more jobs than free_slots(). A job that finds no free slot (a
        worker ended since the claim, or every worker is running a job that crashed
        before) or whose child dies before the job reaches it is reported given_back: it
        never ran.
        """
        batches: dict[_Child, list[Run]] = {}
        now = anyio.current_time()
        unplaced: list[ClaimedJob] = []
        crashed_before = False
        # Each child's room, kept here as jobs are placed: nothing else changes it before
        # the sends below (a placed job takes a place; a suspect takes the child's all).
        room = {} if self._draining else {c: c.free for c in self._children.values()}
        timeouts: dict[tuple[_Child, str], float] = {}
        for job in jobs:
            candidates = [c for c, free in room.items() if free > 0]
            if not candidates:
                # A worker ended while the claim was in flight and took its slots along,
                # or each one with room took a job that crashed before, alone.
                unplaced.append(job)
                continue
            if job.crashes:  # a suspected poison pill: the emptiest worker, to itself
                crashed_before = True
                child = min(candidates, key=lambda c: (len(c.held), c.index))
                child.suspect = (job.id, job.fence)
                room[child] = 0
            else:
                child = candidates[0]
                if len(candidates) > 1:
                    child = max(candidates, key=lambda c: (room[c], -c.index))
                room[child] -= 1
            timeout_s = timeouts.get((child, job.kind))
            if timeout_s is None:
                timeout_s = timeouts[child, job.kind] = self._timeout_s(child, job.kind)
            deadline = now + timeout_s + self.grace_s
            child.held[job.id, job.fence] = _Held(job, now, timeout_s, deadline)
            runs = batches.get(child)
            if runs is None:
                runs = batches[child] = []
            runs.append(Run(job, timeout_s))
            if deadline < self._watchdog_wakes_at:
                self._notify_deadlines()
        if unplaced and any(job.crashes for job in unplaced):
            self._apart_waiting = True
        elif self._apart_waiting and not crashed_before:  # a claim brought none: all placed
            self._apart_waiting = False
            self._notify_changed()
        for job in unplaced:  # never ran: available again, attempt not charged
            why = "no worker free to run it apart" if job.crashes else "no free worker slot"
            await self.outcomes.send(
                Outcome(job, "given_back", error_message=f"{why} after the claim")
            )
        for child, runs in batches.items():
            try:
                await child.channel.send_many(runs)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
                for run in runs:
                    if child.held.pop((run.job.id, run.job.fence), None) is not None:
                        self._notify_changed()
                        await self.outcomes.send(
                            Outcome(run.job, "given_back", error_message=f"worker gone: {e}")
                        )

    def _timeout_s(self, child: _Child, kind: str) -> float:
        """A job of `kind`'s timeout in `child`: its handler's own, else the queue's."""
        info = child.kinds.get(kind)
        if info is not None and info.timeout_s is not None:
            return info.timeout_s
        return self.config.timeout.total_seconds()

    def cancel(self, key: JobKey) -> None:
        """Set the attempt's ctx.cancelled in the child that holds it (no-op if none)."""
        for child in self._children.values():
            if key in child.held and self._tg is not None:
                self._tg.start_soon(self._send_quietly, child, Cancel(*key))
                return

    async def wait_changed(self) -> None:
        """Return at the next change of slots (a job started or ended, a child came or
        went)."""
        await self._changed_event().wait()

    async def wait_idle(self) -> None:
        """Return when no job is in flight in these workers."""
        while any(child.held for child in self._children.values()):
            await self._changed_event().wait()

    def live_processes(self) -> int:
        """Worker processes of this queue that have not exited."""
        return sum(1 for c in self._children.values() if c.process.returncode is None)

    def held(self) -> dict[JobKey, ClaimedJob]:
        """Every job in flight in these workers, by (id, fence)."""
        return {key: h.job for child in self._children.values() for key, h in child.held.items()}

    def drain(self) -> None:
        """Take no more jobs and replace no child that ends (the member is draining, or
        this generation retiring). The jobs held run on."""
        self._draining = True
        self._notify_changed()

    async def give_back_all(self, why: str) -> int:
        """Kill every child that holds a job, with its process group, and only then
        report the jobs it held given_back (attempt not charged): no handler runs on
        after its job was given back. Outcomes the children sent before they died are
        recorded as they are. Returns the number of jobs given back."""
        self.drain()
        self._stopping = True  # the deaths below are ours: not crashes
        holders = [child for child in self._children.values() if child.held]
        for child in holders:
            self._kill(child, f"killed: {why}")
        with anyio.move_on_after(self.grace_s + READ_AFTER_EXIT_S):
            for child in holders:
                await child.served.wait()
        given_back = 0
        for child in holders:
            if child.process.returncode is None:  # not reaped yet: never give back early
                log.error(
                    "queue %s: worker process %d has not exited after SIGKILL; its %d "
                    "jobs are left for the reaper", self.queue, child.pid, len(child.held),
                    extra={"event": "worker.unkillable", "queue": self.queue},
                )  # fmt: skip
                continue
            for key, held in list(child.held.items()):
                del child.held[key]
                given_back += 1
                await self.outcomes.send(Outcome(held.job, "given_back", error_message=why))
        self._notify_changed()
        return given_back

    # -- running -------------------------------------------------------------------

    async def run(
        self, *, task_status: TaskStatus[list[KindInfo]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the children, report their kinds, keep them alive until cancelled."""
        self._changed_event()
        self._deadlines_changed = anyio.Event()
        self._stopping = False
        first = await self._boot_first_generation()  # ConfigError: not in a group
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                for child in first:
                    self._children[child.index] = child
                    self._slot_ended[child.index] = anyio.Event()
                    tg.start_soon(self._keep_slot, child, name=f"{self.queue} worker slot")
                tg.start_soon(self._watchdog, name=f"{self.queue} worker watchdog")
                tg.start_soon(self._watch_memory, name=f"{self.queue} worker memory")
                self._notify_changed()
                kinds = {k: i for child in first for k, i in child.kinds.items()}
                log.info(
                    "queue %s: %d worker processes ready (%d slots)",
                    self.queue, len(first), self.config.concurrency,
                    extra={"event": "workers.ready", "queue": self.queue,
                           "pids": [c.pid for c in first]},
                )  # fmt: skip
                task_status.started(list(kinds.values()))
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._shutdown()
                tg.cancel_scope.cancel()

    def _slot_sizes(self) -> list[int]:
        base, extra = divmod(self.config.concurrency, self.config.processes)
        return [base + (1 if i < extra else 0) for i in range(self.config.processes)]

    async def _boot_first_generation(self) -> list[_Child]:
        booted: list[_Child] = []
        errors: list[str] = []

        async def boot(index: int, slots: int) -> None:
            child = await self._spawn(index, slots)
            booted.append(child)
            try:
                await self._await_ready(child)
            except _BootError as e:
                errors.append(str(e))

        try:
            async with anyio.create_task_group() as tg:
                for index, slots in enumerate(self._slot_sizes()):
                    tg.start_soon(boot, index, slots)
            if errors:
                raise ConfigError(errors[0])
        except BaseException:
            with anyio.CancelScope(shield=True):
                for child in booted:
                    await self._kill_and_reap(child)
            raise
        return sorted(booted, key=lambda c: c.index)

    async def _spawn(self, index: int, slots: int) -> _Child:
        command = [sys.executable, "-m", "pgjobd.worker", "--queue", self.queue]
        for directory in self.handler_dirs:
            command += ["--handler-dir", str(directory)]
        command += ["--slots", str(slots), "--cpu-scheduling", self.config.cpu_scheduling]
        for name in self.middleware:
            command += ["--middleware", name]
        _tree.spawning += 1
        try:
            process = await anyio.open_process(
                command, stderr=None, env={**os.environ, **self.env} if self.env else None,
                start_new_session=True,
            )  # fmt: skip
            _tree.worker_pids.add(process.pid)
        finally:
            _tree.spawning -= 1
        assert process.stdin is not None and process.stdout is not None
        channel: Channel[ToParent] = Channel(process.stdin, process.stdout, ToParent)
        return _Child(index=index, slots=slots, process=process, channel=channel)

    async def _await_ready(self, child: _Child) -> None:
        """Wait for the child's Ready; _BootError (child reaped) if it never comes."""
        message: ToParent | None = None
        problem = ""
        with anyio.move_on_after(self.boot_timeout_s) as scope:
            message, problem = await self._first_message(child)
        if isinstance(message, Ready):
            child.kinds = {info.kind: info for info in message.kinds}
            child.ready = True
            child.ready_at = anyio.current_time()
            return
        if scope.cancelled_caught:
            problem = f": not ready within {self.boot_timeout_s:g}s"
        elif isinstance(message, BootFailed):
            problem = f": {message.message}"
        elif message is not None:
            problem = f": sent {type(message).__name__} before Ready"
        if not scope.cancelled_caught:
            with anyio.move_on_after(self.grace_s, shield=True):
                await child.process.wait()  # it is exiting: let it say how
        returncode = await self._kill_and_reap(child)
        status = "boot failure" if returncode == EXIT_BOOT else describe_exit(returncode)
        raise _BootError(
            f"worker process {child.pid} of queue {self.queue!r} failed to start "
            f"({status}){problem}"
        )

    async def _first_message(self, child: _Child) -> tuple[ToParent | None, str]:
        """The child's first message, or None and what went wrong (its output ended,
        or was unreadable, or the child exited without a message: its output may stay
        open after it, held by a descendant)."""
        found: list[ToParent] = []
        problems: list[str] = []
        async with anyio.create_task_group() as tg:

            async def read() -> None:
                try:
                    found.append(await child.channel.receive())
                except anyio.EndOfStream:
                    pass
                except ProtocolError as e:
                    problems.append(f": {e}")
                tg.cancel_scope.cancel()

            async def wait_exit() -> None:
                await child.process.wait()
                await anyio.sleep(READ_AFTER_EXIT_S)  # for a frame written before
                tg.cancel_scope.cancel()

            tg.start_soon(read)
            tg.start_soon(wait_exit)
        return (found[0] if found else None), "".join(problems)

    async def _keep_slot(self, child: _Child) -> None:
        """Serve one slot's child, then its replacements, until the queue's workers stop.

        Runs shielded from the cancellation of run(): _shutdown ends it, so that outcomes
        arriving during the grace period are still read and sent.
        """
        index = child.index
        with anyio.CancelScope(shield=True) as scope:
            self._slot_scopes[index] = scope
            try:
                failures = 0
                current: _Child | None = child
                while True:
                    if current is not None:
                        self._children[index] = current
                        self._notify_changed()
                        await self._serve(current)
                        uptime = anyio.current_time() - current.ready_at
                        # Dying on its own, soon after Ready and with no job: back off too.
                        alone = not (
                            current.kill_reason or current.crashed_jobs or current.recycled
                        )
                        failures = failures + 1 if uptime < MIN_UPTIME_S and alone else 0
                    if self._stopping or self._draining:
                        return
                    if failures:
                        await self._sleep_unless_stopping(
                            BOOT_BACKOFF_S[min(failures, len(BOOT_BACKOFF_S)) - 1]
                        )
                        if self._stopping or self._draining:
                            return
                    previous = self._children[index].pid
                    current = await self._spawn(index, self._slot_sizes()[index])
                    self._children[index] = current
                    try:
                        await self._await_ready(current)
                    except _BootError as e:
                        failures += 1
                        metrics.WORKER_RESTARTS.labels(self.queue, "boot_failure").inc()
                        log.error("%s; retrying", e, extra={
                            "event": "worker.boot_failed", "queue": self.queue})  # fmt: skip
                        if failures >= CRASH_LOOP_LIMIT and self.failed is None:
                            self.failed = f"{failures} worker starts failed in a row: {e}"
                            log.error(
                                "queue %s failed: %s", self.queue, self.failed,
                                extra={"event": "queue.failed", "queue": self.queue},
                            )  # fmt: skip
                        current = None
                        continue
                    if self.failed is not None:
                        log.info(
                            "queue %s recovered", self.queue,
                            extra={"event": "queue.recovered", "queue": self.queue},
                        )  # fmt: skip
                        self.failed = None
                    log.info(
                        "queue %s: worker process %d replaced by %d",
                        self.queue, previous, current.pid,
                        extra={"event": "worker.replaced", "queue": self.queue},
                    )  # fmt: skip
            finally:
                self._slot_ended[index].set()

    async def _sleep_unless_stopping(self, delay_s: float) -> None:
        with anyio.move_on_after(delay_s):
            while not (self._stopping or self._draining):
                await self._changed_event().wait()

    async def _serve(self, child: _Child) -> None:
        """Turn the child's Done frames into outcomes until it exits; then settle up."""
        try:
            await self._watch(child)
            returncode = await self._kill_and_reap(child)
            if self._stopping:
                return  # what it still holds is the caller's to give back
            metrics.WORKER_RESTARTS.labels(self.queue, restart_reason(child, returncode)).inc()
            await self._report_death(child, returncode)
        finally:
            child.served.set()

    async def _watch(self, child: _Child) -> None:
        """Read the child's frames until it exits. Its exit is what counts: its output
        may stay open after it (a descendant holding the pipe), or end before it."""
        either = anyio.Event()
        output_ended = anyio.Event()

        async def read() -> None:
            try:
                await self._read_frames(child)
            finally:
                output_ended.set()
                either.set()

        async def wait_exit() -> None:
            await child.process.wait()
            either.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            tg.start_soon(wait_exit)
            await either.wait()
            child.ready = False
            self._notify_changed()
            if child.process.returncode is None:
                with anyio.move_on_after(self.grace_s):
                    await child.process.wait()  # its output ended: it is exiting
            else:
                with anyio.move_on_after(READ_AFTER_EXIT_S):
                    await output_ended.wait()  # the frames it wrote before it exited
            # Stop reading, but let an outcome being handed over arrive. (Polled: this
            # path is rare, and an Event per outcome would cost the hot path.)
            while child.handing_over and not output_ended.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    async def _read_frames(self, child: _Child) -> None:
        try:
            while True:
                message: ToParent | None = await child.channel.receive()
                # What a worker wrote in one turn of its loop arrives in one read: the
                # rest of its frames are taken here without a coroutine per message.
                while message is not None:
                    if isinstance(message, Done):
                        if not self._finish_now(child, message):
                            child.handing_over = True
                            try:
                                await self._finish(child, message)
                            finally:
                                child.handing_over = False
                    elif isinstance(message, ResultsWanted) and self._tg is not None:
                        self._tg.start_soon(self._give_results, child, message)
                    else:
                        log.warning("worker %d sent an unexpected %s", child.pid,
                                    type(message).__name__)  # fmt: skip
                    message = child.channel.receive_buffered()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        except ProtocolError as e:
            log.error("worker %d: %s; killing it", child.pid, e,
                      extra={"event": "worker.protocol_error", "queue": self.queue})  # fmt: skip
            self._kill(child, f"killed after a protocol error: {e}")

    def _finish_now(self, child: _Child, done: Done) -> bool:
        """Hand the outcome `done` reports over to the completer and free its slot, without
        waiting; False, with nothing done but the note of its end, when the completer's
        stream is full (then _finish, which waits for room)."""
        key = (done.job_id, done.fence)
        held = child.held.get(key)
        if held is None:
            log.warning("worker %d reported job %d, which it does not hold", child.pid,
                        done.job_id)  # fmt: skip
            return True
        if self.own_ends is not None:
            self.own_ends.fences.add(done.fence)  # before the completer can have recorded it
        try:
            # Without the two event-loop turns send() takes even when there is room.
            self.outcomes.send_nowait(done.outcome(held.job))
        except anyio.WouldBlock:
            return False
        self._free_slot(child, key)
        return True

    async def _finish(self, child: _Child, done: Done) -> None:
        """_finish_now's hand-over once the completer's stream has room."""
        key = (done.job_id, done.fence)
        held = child.held.get(key)
        if held is None:
            return
        await self.outcomes.send(done.outcome(held.job))  # bounded: a slow completer slows us
        self._free_slot(child, key)

    def _free_slot(self, child: _Child, key: JobKey) -> None:
        """The outcome of the job `key` is handed over: only now is its slot free (until
        then the job is held)."""
        if child.held.pop(key, None) is None:
            return  # given back meanwhile (at a drain deadline)
        if child.suspect == key:
            child.suspect = None
        child.jobs_done += 1
        limit = self.config.max_jobs_per_process
        if limit and child.jobs_done >= limit:
            self._recycle(child, f"ran {child.jobs_done} jobs (max_jobs_per_process)")
        self._notify_changed()
        if self.own_ends is not None:
            self.own_ends.wakeup.set()  # its place is free, even under a fleet-wide limit

    def _recycle(self, child: _Child, why: str) -> None:
        """Take no more work to the child; it finishes what it holds, exits, and is
        replaced (see _keep_slot)."""
        if child.recycled is not None or child.kill_reason is not None:
            return
        child.recycled = why
        child.retiring = True
        log.info(
            "queue %s: recycling worker process %d: %s", self.queue, child.pid, why,
            extra={"event": "worker.recycled", "queue": self.queue, "pid": child.pid},
        )  # fmt: skip
        if self._tg is not None:
            self._tg.start_soon(self._send_quietly, child, Stop())

    async def _watch_memory(self) -> None:
        """Recycle a worker whose resident memory grew past max_rss."""
        limit = self.config.max_rss_bytes
        if not limit:
            return
        while True:
            await anyio.sleep(RSS_CHECK_S)
            for child in list(self._children.values()):
                rss = resident_bytes(child.pid)
                if rss is not None and rss > limit and child.ready:
                    self._recycle(child, f"resident memory {rss >> 20} MiB > max_rss")

    async def _report_death(self, child: _Child, returncode: int | None) -> None:
        if child.recycled is not None and not child.held and returncode == 0:
            return  # it finished its work and left as asked
        if child.kill_reason is not None:
            reason = child.kill_reason
        elif returncode == -signal.SIGKILL:  # not ours: _kill sets kill_reason
            reason = f"worker process exited: signal {signal.SIGKILL.value} {OOM_HINT}"
        else:
            reason = f"worker process exited: {describe_exit(returncode)}"
        level = logging.ERROR if child.held else logging.WARNING
        log.log(
            level, "queue %s: worker process %d: %s; %d jobs lost with it",
            self.queue, child.pid, reason, len(child.held),
            extra={"event": "worker.died", "queue": self.queue, "pid": child.pid,
                   "jobs": sorted(job_id for job_id, _ in child.held)},
        )  # fmt: skip
        now = anyio.current_time()
        child.crashed_jobs = len(child.held)
        for key, held in list(child.held.items()):
            message = reason
            if child.overdue_job is not None and key != child.overdue_job:
                message = f"{reason} (job {child.overdue_job[0]} in the same process)"
            if child.held.pop(key, None) is None:
                continue  # given back meanwhile
            await self.outcomes.send(
                Outcome(
                    held.job, "crashed", duration_s=now - held.sent_at,
                    error_class="WorkerCrashed", error_message=message,
                )
            )  # fmt: skip
            self._notify_changed()

    async def _watchdog(self) -> None:
        """SIGKILL a child that holds a job past its deadline."""
        while True:
            self._deadlines_changed = anyio.Event()
            changed = self._deadlines_changed
            now = anyio.current_time()
            nearest = math.inf
            for child in list(self._children.values()):
                if child.kill_reason is not None:
                    continue
                for key, held in child.held.items():
                    if held.deadline <= now:
                        child.overdue_job = key
                        self._kill(
                            child,
                            f"killed after the job ran past its timeout of "
                            f"{held.timeout_s:g}s + {self.grace_s:g}s grace",
                        )
                        break
                    nearest = min(nearest, held.deadline)
            self._watchdog_wakes_at = nearest
            with anyio.move_on_after(nearest - now):
                await changed.wait()
            self._watchdog_wakes_at = -math.inf

    def _kill(self, child: _Child, reason: str) -> None:
        if child.kill_reason is None:
            child.kill_reason = reason
        child.retiring = True
        self._notify_changed()
        if child.process.returncode is None:
            log.warning("queue %s: worker process %d %s", self.queue, child.pid, reason,
                        extra={"event": "worker.killed", "queue": self.queue})  # fmt: skip
            kill_group(child.process)

    async def _kill_and_reap(self, child: _Child) -> int | None:
        """SIGKILL the child's process group (the child too, if it still runs: and in
        any case what a handler left behind in its group), wait for the child, close its
        pipes; its status."""
        kill_group(child.process)
        with anyio.CancelScope(shield=True):
            await child.process.aclose()  # closes stdin and stdout, waits for the exit
        _tree.worker_pids.discard(child.pid)
        return child.process.returncode

    async def _give_results(self, child: _Child, wanted: ResultsWanted) -> None:
        """Answer a handler's ctx.results(): what its job waited for, from history."""
        held = child.held.get((wanted.job_id, wanted.fence))
        if held is None:
            return  # it ended (or was given back) meanwhile
        answer = Results(wanted.job_id, wanted.fence)
        ids = [*held.job.depends_on, *held.job.after]
        if not ids:
            answer = Results(wanted.job_id, wanted.fence, results=b"{}")
        elif self.results_source is None:
            answer = Results(wanted.job_id, wanted.fence, error="no database to read them from")
        else:
            try:
                text = await self.results_source(ids)
            except Exception as e:  # the handler gets the error; the job is retried
                answer = Results(wanted.job_id, wanted.fence, error=f"{type(e).__name__}: {e}")
            else:
                if text is not None and len(text) > MAX_FRAME - 4096:
                    answer = Results(wanted.job_id, wanted.fence,
                                     error=f"the results are {len(text)} bytes of JSON, "
                                     f"more than a frame carries ({MAX_FRAME})")  # fmt: skip
                else:
                    answer = Results(wanted.job_id, wanted.fence, results=text or b"{}")
        await self._send_quietly(child, answer)

    async def _send_quietly(self, child: _Child, message: ToChild) -> None:
        # A child that is gone cannot take it: its reaping reports what it held.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await child.channel.send(message)

    async def _shutdown(self) -> None:
        """Stop every child: Stop, up to grace_s to finish, then SIGKILL."""
        self._stopping = True
        self._notify_changed()
        for child in self._children.values():
            child.retiring = True
            if child.process.returncode is None:
                await self._send_quietly(child, Stop())
        ended = list(self._slot_ended.values())
        with anyio.move_on_after(self.grace_s):
            for event in ended:
                await event.wait()
        for child in self._children.values():
            if child.process.returncode is None:
                if child.held:
                    log.warning(
                        "queue %s: worker process %d still holds %d jobs after %gs: killing it",
                        self.queue, child.pid, len(child.held), self.grace_s,
                        extra={"event": "worker.stop_timeout", "queue": self.queue},
                    )  # fmt: skip
                kill_group(child.process)
        with anyio.move_on_after(2.0):
            for event in ended:
                await event.wait()
        for scope in self._slot_scopes.values():
            scope.cancel()  # e.g. stuck sending to an outcomes stream nobody reads

    # -- events ----------------------------------------------------------------------

    def _changed_event(self) -> anyio.Event:
        if self._changed is None:
            self._changed = anyio.Event()
        return self._changed

    def _notify_changed(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None  # the next waiter makes the next one

    def _notify_deadlines(self) -> None:
        if self._deadlines_changed is not None:
            self._deadlines_changed.set()


class _ProcessTree:
    """The worker processes of every QueueWorkers in this process, for kill_strays to spare."""

    def __init__(self) -> None:
        self.worker_pids: set[int] = set()
        self.spawning = 0  # being started: their pids are not known yet
        self.strays_seen: set[int] = set()  # killed, not reaped yet: logged once


_tree = _ProcessTree()


def kill_group(process: Process) -> None:
    """SIGKILL a child's process group (it leads one: started in a session of its own).
    Called while the child is unreaped, or right after: its group id cannot have been
    reused while any process of the group lives."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux): descendants orphaned by their parent
    (a handler's double fork, a worker's death) become its children, for kill_strays to
    end. False where the platform does not have it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc's
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def children(pid: int | None = None) -> set[int]:
    """The pids of a process's children (Linux /proc), zombies included."""
    pid = os.getpid() if pid is None else pid
    found: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", "rb") as listing:
                found.update(int(p) for p in listing.read().split())
        return found
    except FileNotFoundError:
        pass  # no such process or task (or a kernel without the children file)
    except OSError:
        return found
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                found.add(int(entry))
    return found


def kill_strays(*, spare_workers: bool = True) -> list[int]:
    """SIGKILL every child of this process that is not a worker process (with its
    process group, if it leads one other than ours) and reap the ones that have ended.
    Such children are descendants a handler started that outlived their parents and
    were reparented here (see become_subreaper). Returns the pids found."""
    if spare_workers and _tree.spawning:
        return []  # a new worker's pid is not known yet: look again later
    own_group = os.getpgrp()
    strays = sorted(children() - (_tree.worker_pids if spare_workers else set()))
    for pid in strays:
        with contextlib.suppress(OSError):
            group = os.getpgid(pid)
            if group == pid and group != own_group:
                os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    reaped: set[int] = set()
    for pid in strays:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped.add(pid)
    new = [pid for pid in strays if pid not in _tree.strays_seen]
    _tree.strays_seen.update(strays)
    _tree.strays_seen.difference_update(reaped)
    if new:
        log.warning(
            "killed %d processes left behind by handlers: pids %s",
            len(new), ", ".join(map(str, new[:20])),
            extra={"event": "worker.strays_killed", "pids": new[:100]},
        )  # fmt: skip
    return strays


def restart_reason(child: _Child, returncode: int | None) -> str:
    """Why a child that served is being replaced, for pgjobd_worker_restarts_total."""
    if child.kill_reason is not None:
        return "timeout_kill" if child.overdue_job is not None else "protocol_error"
    if child.recycled is not None and returncode == 0:
        return "recycled"
    return "crash"


def resident_bytes(pid: int) -> int | None:
    """A process's resident set size (Linux /proc), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def describe_exit(returncode: int | None) -> str:
    """'exit status 1', 'signal 9 (SIGKILL)'."""
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
    return f"signal {-returncode} ({name})"


__all__ = ["QueueWorkers", "become_subreaper", "describe_exit", "kill_strays"]
