"""A worker process: imports the handler directories and runs the jobs its parent sends.

Started by the supervisor as `python -m pgjobd.worker --queue Q --handler-dir D --slots N`
(`pgjobd worker ...`, a hidden subcommand, is the same). It has no database access: jobs
come in as Run frames on stdin and leave as Done frames on the original stdout (see
pgjobd.protocol). It imports only what running handlers needs: the protocol, the handler
API, msgspec, uvloop and logging; never anyio, asyncpg or the daemon's modules (a
handler importing `pgjobd` gets its lazy package root). tests/process/test_worker.py
holds it to that.

- Frames go over a private duplicate of fd 1; fd 1 then points at stderr, so a handler's
  print() lands in the daemon's log instead of corrupting the stream. fd 0 becomes
  /dev/null for the same reason.
- Logging follows the daemon's format and level (pgjobd.log.setup_worker, from the
  environment the supervisor sets): every line logged while a job runs carries its id,
  kind, queue and attempt, and in JSON mode print() output becomes JSON lines too.
- Running one job (args conversion, middleware, handler, outcome) is
  pgjobd.execution's, shared with the testing kit. `--middleware module:callable`
  (repeated, outermost first) names the middleware it imports at boot.
- A handler module (or middleware) that fails to import: the error goes to stderr and,
  as BootFailed, to the parent; the process exits with status 3 (protocol.EXIT_BOOT),
  which the parent treats as a boot failure rather than a crash.
- Signals: SIGTERM, SIGINT and SIGHUP are ignored: the parent drives shutdown (it starts
  each worker in a session of its own, but a signal sent to every process of a cgroup,
  as init systems do, must not stop a worker behind the parent's back). Stop or the end
  of input (the parent is gone): take no more work, finish the jobs held, exit 0.
  Without a parent, a job that does not end within its timeout (plus ORPHAN_GRACE_S) is
  abandoned and the process exits 1. A write that finds the pipe to the parent broken
  (a handler closed it) ends the process at once, status 4. SIGUSR1 dumps every
  thread's stack to stderr (faulthandler).
- async handlers run as tasks, cancelled at their timeout (reported as failed,
  TimeoutError). `def` handlers run in daemon threads, which cannot be interrupted: the
  child keeps holding such a job past its timeout, and the parent kills the process when
  it is still running at timeout + grace (reported as crashed). A thread that returns
  after its timeout but before the kill is reported failed, TimeoutError, its result
  dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import uvloop

from pgjobd import log as pgjobd_log
from pgjobd import middleware as pgjobd_middleware
from pgjobd.errors import ConfigError
from pgjobd.execution import Cancellation, execute
from pgjobd.handler_api import HandlerSpec, ResultsUnavailable
from pgjobd.handler_loader import Registry, load_directories
from pgjobd.middleware import Middleware
from pgjobd.model import ClaimedJob, KindInfo
from pgjobd.outcome import storable
from pgjobd.protocol import (
    CPU_POLICIES,
    EXIT_ABANDONED,
    EXIT_BOOT,
    EXIT_CHANNEL_BROKEN,
    EXIT_OK,
    BootFailed,
    Cancel,
    ChildChannel,
    Done,
    ProtocolError,
    Ready,
    Results,
    ResultsWanted,
    Run,
    Stop,
    encode_frame,
)

ORPHAN_GRACE_S = 5.0

log = logging.getLogger("pgjobd.worker")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pgjobd.worker")
    parser.add_argument("--queue", required=True)
    parser.add_argument(
        "--handler-dir", dest="handler_dirs", action="append", required=True, type=Path
    )
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--middleware", action="append", default=[])
    parser.add_argument("--cpu-scheduling", choices=CPU_POLICIES)  # (none: as inherited)
    return parser.parse_args(argv)


def command(args: argparse.Namespace) -> int:
    """`python -m pgjobd.worker` (and `pgjobd worker`). Never returns: it ends the process."""
    code = main(args.queue, args.handler_dirs, args.slots, args.middleware, args.cpu_scheduling)
    # Skip interpreter teardown: a daemon thread still inside a handler could stall it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(
    queue: str,
    handler_dirs: Sequence[Path],
    slots: int,
    middleware: Sequence[str] = (),
    cpu_scheduling: str | None = None,
) -> int:
    frames_in, frames_out = _take_standard_streams()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads are the supervisor's business
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if not logging.getLogger().handlers:
        pgjobd_log.setup_worker(os.environ, queue, os.getpid())
    if cpu_scheduling is not None:
        set_cpu_scheduling(cpu_scheduling)  # before any thread starts: they inherit it
    try:
        registry = load_directories(handler_dirs)
        chain = pgjobd_middleware.load(middleware)
    except ConfigError as e:
        log.error("pgjobd worker: %s", e, extra={"event": "worker.boot_failed"})
        with contextlib.suppress(OSError):
            os.write(frames_out, encode_frame(BootFailed(str(e))))
        return EXIT_BOOT
    worker = Worker(queue, registry, slots, chain)
    code: int = uvloop.run(worker.serve(frames_in, frames_out))
    return code


def set_cpu_scheduling(policy: str) -> None:
    """Put this process under the Linux scheduling policy named by `policy` (a queue's
    cpu_scheduling). Under "batch" (SCHED_BATCH) a worker woken by the frames of a claim
    does not preempt the supervisor, which then hands the rest of the claim to the other
    workers first; the worker starts at once on an idle CPU, else when the task running
    there sleeps or its time slice ends. Only the calling thread's policy is set: call
    it before any thread starts (threads and child processes inherit it). A policy the
    system refuses (a seccomp filter) leaves the one inherited, with a warning: it
    changes speed, not what runs. A platform without policies ignores it."""
    if not hasattr(os, "sched_setscheduler"):
        return
    try:
        os.sched_setscheduler(0, getattr(os, CPU_POLICIES[policy]), os.sched_param(0))
    except OSError as e:
        log.warning(
            "cannot set cpu_scheduling = %r, keeping the policy inherited: %s", policy, e,
            extra={"event": "worker.cpu_scheduling_refused"},
        )  # fmt: skip


def _take_standard_streams() -> tuple[int, int]:
    """Private descriptors for the frames; fd 1 -> stderr and fd 0 -> /dev/null."""
    sys.stdout.flush()
    frames_in = os.dup(0)
    frames_out = os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return frames_in, frames_out


def kind_info(spec: HandlerSpec) -> KindInfo:
    return KindInfo(
        kind=spec.kind,
        queue=spec.queue,
        priority=spec.priority,
        max_attempts=spec.max_attempts,
        timeout_s=spec.timeout_s,
        global_concurrency=spec.global_concurrency,
        rate_limit=None if spec.rate_limit is None else str(spec.rate_limit),
        redact=spec.redact,
        circuit_breaker=None if spec.circuit_breaker is None else str(spec.circuit_breaker),
        breaker_cooldown_s=spec.breaker_cooldown_s,
    )


class Worker:
    """Runs the jobs of one channel concurrently until told to stop or orphaned."""

    def __init__(
        self, queue: str, registry: Registry, slots: int, middleware: Sequence[Middleware] = ()
    ) -> None:
        self.queue = queue
        self.registry = registry
        self.slots = slots
        self.middleware = list(middleware)
        self._where = f"this worker of queue {queue!r}"  # (for an unknown kind's message)
        # Each held job's cancellation (its ctx.cancelled, if it has a context), made when
        # its Run arrives: a Cancel may follow before the job's task has started. By
        # (id, fence): a job may be held twice, when its lease ran out and this member
        # claimed it again.
        self._cancelled: dict[tuple[int, int], Cancellation] = {}
        self._deadlines: dict[tuple[int, int], float] = {}
        # Each held job's task, until its outcome is sent (removed by the task itself: no
        # done callback, and its loop turn, per job).
        self._tasks: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._stopping = False
        self._parent = os.getppid()
        self._broken_logged = False
        self._channel: ChildChannel | None = None
        self._results_asked: dict[tuple[int, int], asyncio.Future[Results]] = {}
        self._orphaned = False  # the input ended: no supervisor to answer

    def _results_reader(self, job: ClaimedJob) -> Callable[[], Awaitable[dict[int, Any]]]:
        """ctx.results() in this process: asks the supervisor, which reads them."""

        async def read() -> dict[int, Any]:
            if self._channel is None or self._orphaned:
                raise ResultsUnavailable("no supervisor to read them from")
            key = (job.id, job.fence)
            answer: asyncio.Future[Results] = asyncio.get_running_loop().create_future()
            self._results_asked[key] = answer
            await self._channel.send(ResultsWanted(job.id, job.fence))
            given = await answer
            if given.error is not None:
                raise ResultsUnavailable(f"the results of jobs {job.id} waited for: {given.error}")
            decoded = msgspec.json.decode(given.results or b"{}")
            return {int(k): v for k, v in decoded.items()}

        return read

    async def serve(self, frames_in: int, frames_out: int) -> int:
        channel = await ChildChannel.open(frames_in, frames_out)
        self._channel = channel
        channel.on_broken = self._channel_broken
        orphaned = False
        await channel.send(
            Ready(pid=os.getpid(), kinds=[kind_info(s) for s in self.registry.values()])
        )
        try:
            while not self._stopping:
                message = await channel.receive()
                if isinstance(message, Run):
                    key = (message.job.id, message.job.fence)
                    self._cancelled[key] = Cancellation()
                    self._tasks[key] = asyncio.create_task(self._run(channel, message))
                elif isinstance(message, Cancel):
                    cancelled = self._cancelled.get((message.job_id, message.fence))
                    if cancelled is not None:
                        cancelled.set()
                elif isinstance(message, Results):
                    answer = self._results_asked.pop((message.job_id, message.fence), None)
                    if answer is not None and not answer.done():
                        answer.set_result(message)
                elif isinstance(message, Stop):
                    self._stopping = True
        except EOFError:
            orphaned = True
            log.warning("input closed: the supervisor is gone; finishing the jobs held")
        except ProtocolError as e:
            orphaned = True
            log.error("unreadable input from the supervisor: %s", e)
        if orphaned:
            self._no_more_answers()
        return await self._finish(orphaned)

    def _no_more_answers(self) -> None:
        """Orphaned: a job waiting for ctx.results() gets ResultsUnavailable now, not
        a wait until its timeout holds the process (and so its job) that long."""
        self._orphaned = True
        for (job_id, fence), answer in self._results_asked.items():
            if not answer.done():
                answer.set_result(Results(job_id, fence, error="the supervisor is gone"))
        self._results_asked.clear()

    def _channel_broken(self) -> None:
        """A write found the pipe to the parent broken. With the parent alive, a handler
        broke it: no outcome can reach the parent, so exit at once. Orphaned, finish the
        jobs held (as on the end of input): their outcomes are lost either way."""
        if os.getppid() != self._parent:
            if not self._broken_logged:
                self._broken_logged = True
                log.warning("the supervisor is gone; outcomes cannot be reported")
            return
        log.error("the pipe to the supervisor is broken (closed by a handler?): exiting")
        logging.shutdown()
        os._exit(EXIT_CHANNEL_BROKEN)

    async def _finish(self, orphaned: bool) -> int:
        """Wait for the jobs held. The parent enforces timeouts; alone, we do."""
        self._stopping = True
        if not self._tasks:
            return EXIT_OK
        if not orphaned:
            await asyncio.wait(set(self._tasks.values()))
            return EXIT_OK
        latest = max(self._deadlines.values(), default=time.monotonic())
        limit = max(0.0, latest - time.monotonic()) + ORPHAN_GRACE_S
        _, pending = await asyncio.wait(set(self._tasks.values()), timeout=limit)
        if pending:
            log.error("abandoning %d jobs still running %.0fs past their timeouts",
                      len(pending), ORPHAN_GRACE_S)  # fmt: skip
            return EXIT_ABANDONED
        return EXIT_OK

    async def _run(self, channel: ChildChannel, run: Run) -> None:
        job = run.job
        key = (job.id, job.fence)
        self._deadlines[key] = time.monotonic() + run.timeout_s
        try:
            try:
                done = await self.execute(run)
            except Exception as e:  # a bug here must not leave the job held forever
                log.exception("job %d: internal error", job.id)
                done = Done(job.id, job.fence, "failed", 0.0, error_class="pgjobd.WorkerError",
                            error_message=f"internal worker error: {e!r}")  # fmt: skip
            finally:
                self._cancelled.pop(key, None)
                self._deadlines.pop(key, None)
            try:
                await channel.send(storable(done))
            except (OSError, RuntimeError) as e:
                log.error("job %d: cannot report its outcome (%s): %s", job.id, done.verdict, e)
                self._channel_broken()
        finally:
            self._tasks.pop(key, None)  # (its outcome is sent: _finish need not wait for it)

    async def execute(self, run: Run) -> Done:
        """Run one job to its Done (pgjobd.execution)."""
        job = run.job
        return await execute(
            self.registry, job, run.timeout_s, where=self._where,
            cancelled=self._cancelled.get((job.id, job.fence)), middleware=self.middleware,
            results=self._results_reader(job) if job.depends_on or job.after else None,
        )  # fmt: skip


if __name__ == "__main__":
    command(parse_args(sys.argv[1:]))
