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
- A handler module that fails to import: the error goes to stderr and, as BootFailed, to
  the parent; the process exits with status 3 (protocol.EXIT_BOOT), which the parent
  treats as a boot failure rather than a crash.
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
import contextvars
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import uvloop

from pgjobd import log as pgjobd_log
from pgjobd import redact
from pgjobd.errors import ConfigError
from pgjobd.fingerprint import fingerprint
from pgjobd.handler_api import (
    VERSION_KEY,
    ArgsError,
    BatchCounts,
    Discard,
    HandlerSpec,
    JobContext,
    NewerArgs,
    ResultsUnavailable,
    Retry,
    Snooze,
    upgraded,
    validate_args,
)
from pgjobd.handler_loader import PACKAGE_ROOT, Registry, load_directories
from pgjobd.model import ClaimedJob, KindInfo
from pgjobd.outcome import MAX_MESSAGE_CHARS, MAX_RESULT_BYTES, MAX_TRACEBACK_CHARS, storable
from pgjobd.protocol import (
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
# A job whose args are newer than its handler comes back this much later (for a member
# that knows them: a rolling deploy), with no attempt charged.
GIVE_BACK_S = 1.0

log = logging.getLogger("pgjobd.worker")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pgjobd.worker")
    parser.add_argument("--queue", required=True)
    parser.add_argument(
        "--handler-dir", dest="handler_dirs", action="append", required=True, type=Path
    )
    parser.add_argument("--slots", type=int, required=True)
    return parser.parse_args(argv)


def command(args: argparse.Namespace) -> int:
    """`python -m pgjobd.worker` (and `pgjobd worker`). Never returns: it ends the process."""
    code = main(args.queue, args.handler_dirs, args.slots)
    # Skip interpreter teardown: a daemon thread still inside a handler could stall it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(queue: str, handler_dirs: Sequence[Path], slots: int) -> int:
    frames_in, frames_out = _take_standard_streams()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads are the supervisor's business
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if not logging.getLogger().handlers:
        pgjobd_log.setup_worker(os.environ, queue, os.getpid())
    try:
        registry = load_directories(handler_dirs)
    except ConfigError as e:
        log.error("pgjobd worker: %s", e, extra={"event": "worker.boot_failed"})
        with contextlib.suppress(OSError):
            os.write(frames_out, encode_frame(BootFailed(str(e))))
        return EXIT_BOOT
    worker = Worker(queue, registry, slots)
    code: int = uvloop.run(worker.serve(frames_in, frames_out))
    return code


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
    )


class _TimedOut(Exception):
    pass


class Worker:
    """Runs the jobs of one channel concurrently until told to stop or orphaned."""

    def __init__(self, queue: str, registry: Registry, slots: int) -> None:
        self.queue = queue
        self.registry = registry
        self.slots = slots
        # Each held job's ctx.cancelled, made when its Run arrives: a Cancel may follow
        # before the job's task has started. By (id, fence): a job may be held twice,
        # when its lease ran out and this member claimed it again.
        self._cancelled: dict[tuple[int, int], threading.Event] = {}
        self._deadlines: dict[tuple[int, int], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._parent = os.getppid()
        self._broken_logged = False
        self._channel: ChildChannel | None = None
        self._results_asked: dict[tuple[int, int], asyncio.Future[Results]] = {}

    def _results_reader(self, job: ClaimedJob) -> Callable[[], Awaitable[dict[int, Any]]]:
        """ctx.results() in this process: asks the supervisor, which reads them."""

        async def read() -> dict[int, Any]:
            if self._channel is None:
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
                    self._cancelled[key] = threading.Event()
                    task = asyncio.create_task(self._run(channel, message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
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
        return await self._finish(orphaned)

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
            await asyncio.wait(set(self._tasks))
            return EXIT_OK
        latest = max(self._deadlines.values(), default=time.monotonic())
        limit = max(0.0, latest - time.monotonic()) + ORPHAN_GRACE_S
        _, pending = await asyncio.wait(set(self._tasks), timeout=limit)
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

    async def execute(self, run: Run) -> Done:
        """Run one job to its Done: convert the args, call the handler, map the result;
        with the handler's redact fields kept out of what it logs and of its errors."""
        spec = self.registry.get(run.job.kind)
        hidden = _secrets(run.job.args, spec.redact) if spec is not None else ()
        pgjobd_log.job_secrets.set(hidden)
        finished = await self._execute(run)
        if hidden and (finished.error_message or finished.traceback):
            finished = msgspec.structs.replace(
                finished,
                error_message=redact.redact_text(finished.error_message, hidden),
                traceback=redact.redact_text(finished.traceback, hidden),
            )
        return finished

    async def _execute(self, run: Run) -> Done:
        job = run.job
        started = time.monotonic()

        def done(verdict: Any, **fields: Any) -> Done:
            return Done(job.id, job.fence, verdict, time.monotonic() - started, **fields)

        spec = self.registry.get(job.kind)
        if spec is None:
            known = ", ".join(self.registry.kinds()) or "none"
            return done(
                "unknown_kind",
                error_class="pgjobd.UnknownKind",
                error_message=f"no handler for kind {job.kind!r} in this worker of queue "
                f"{self.queue!r}; known kinds: {known}",
            )
        try:
            decoded = msgspec.json.decode(job.args)
            if isinstance(decoded, dict) and (VERSION_KEY in decoded or spec.args_version > 1):
                decoded = upgraded(spec, decoded)
            args = validate_args(spec, decoded)
        except NewerArgs as e:
            # Not this handler's to run: back in GIVE_BACK_S, no attempt charged.
            return done("snoozed", after_s=GIVE_BACK_S, error_class="pgjobd.NewerArgs",
                        error_message=str(e))  # fmt: skip
        except (msgspec.DecodeError, RecursionError) as e:
            # RecursionError: nested deeper than Python can convert (a direct INSERT can
            # store what enqueue refuses): as unusable as invalid JSON, never retried.
            message = f"args for kind {job.kind!r} are not valid JSON: {e}"
            return done("invalid_args", error_class="pgjobd.ArgsError", error_message=message)
        except ArgsError as e:
            return done("invalid_args", error_class="pgjobd.ArgsError", error_message=str(e))
        except Exception as e:  # an upgrader failed: a failed attempt, retried
            return done("failed", **_error_fields(e))

        ctx = _context(job, self._cancelled.setdefault((job.id, job.fence), threading.Event()),
                       self._results_reader(job))  # fmt: skip
        # Every line logged while the job runs (any logger, print in JSON mode) names it.
        pgjobd_log.job_fields.set(
            {"job_id": job.id, "kind": job.kind, "queue": job.queue, "attempt": job.attempt}
        )

        call_args = (args, ctx) if spec.takes_ctx else (args,)
        try:
            if spec.is_async:
                value = await _call_async(spec.function, call_args, run.timeout_s)
            else:
                value = await _call_in_thread(spec.function, call_args, job.id)
                if time.monotonic() - started > run.timeout_s:
                    raise _TimedOut(
                        f"ran {time.monotonic() - started:.1f}s, past its timeout of "
                        f"{run.timeout_s:g}s (its result is dropped)"
                    )
        except _TimedOut as e:
            return done(
                "failed", error_class="TimeoutError", error_message=f"job {e}", traceback=None
            )
        except Retry as e:
            return done("retry", after_s=e.after_s, **_cause_fields(e))
        except Snooze as e:
            return done("snoozed", after_s=e.after_s, **_cause_fields(e))
        except Discard as e:
            fields = _cause_fields(e)
            fields["error_message"] = e.reason or "discarded by the handler"
            return done("discarded", **fields)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and _being_cancelled():
                raise
            verdict = "discarded" if isinstance(e, spec.discard_on) else "failed"
            return done(verdict, **_error_fields(e))
        return done("completed", result=_encode_result(value, ctx))


def _secrets(args_json: bytes | str, fields: tuple[str, ...]) -> tuple[str, ...]:
    if not fields:
        return ()
    try:
        return redact.secrets(msgspec.json.decode(args_json), fields)
    except (msgspec.DecodeError, RecursionError):
        return ()  # args that do not decode are discarded unread


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _context(
    job: ClaimedJob,
    cancelled: threading.Event,
    results: Callable[[], Awaitable[dict[int, Any]]] | None,
) -> JobContext:
    return JobContext(
        dependencies=job.depends_on + job.after,
        results=results if job.depends_on or job.after else {},
        batch=BatchCounts(len(job.after) - job.after_failed, job.after_failed)
        if job.after
        else None,
        id=job.id,
        kind=job.kind,
        queue=job.queue,
        attempt=job.attempt,
        max_attempts=job.max_attempts,
        tenant=job.tenant,
        enqueued_at=job.enqueued_at,
        scheduled_at=job.scheduled_at,
        cancelled=cancelled,
        logger=logging.getLogger("pgjobd.job"),
    )


async def _call_async(function: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
    task = asyncio.ensure_future(function(*args))
    try:
        finished, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not finished:
        task.cancel()
        # Wait for the handler to unwind; one that ignores cancellation keeps the job
        # held until the parent's deadline kills the process.
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is None:
            log.warning("a handler returned after its timeout was cancelled; result dropped")
        raise _TimedOut(f"ran past its timeout of {timeout_s:g}s and was cancelled")
    return task.result()


async def _call_in_thread(function: Callable[..., Any], args: tuple[Any, ...], job_id: int) -> Any:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(error: BaseException | None, value: Any) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        try:
            value = function(*args)
        except BaseException as e:
            outcome: tuple[BaseException | None, Any] = (e, None)
        else:
            outcome = (None, value)
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are exiting
            loop.call_soon_threadsafe(settle, *outcome)

    # A daemon thread of its own, not an executor: one stuck forever must not keep the
    # process from exiting.
    # (In the task's context: the job's log fields go with it.)
    context = contextvars.copy_context()
    threading.Thread(
        target=context.run, args=(target,), name=f"pgjobd-job-{job_id}", daemon=True
    ).start()
    return await future


def _encode_result(value: Any, ctx: JobContext) -> bytes | None:
    if value is None:
        return None
    try:
        encoded = msgspec.json.encode(value)
    except (TypeError, ValueError, msgspec.EncodeError) as e:
        ctx.logger.warning("return value is not JSON-able, so no result is kept: %s", e)
        return None
    if len(encoded) > MAX_RESULT_BYTES:
        ctx.logger.warning(
            "return value is %d bytes of JSON, over the %d-byte limit: no result is kept",
            len(encoded),
            MAX_RESULT_BYTES,
        )
        return None
    return encoded


def class_name(error_type: type[BaseException]) -> str:
    """A qualified class name; builtins bare, handler modules without their synthetic package."""
    module = error_type.__module__
    if module == "builtins":
        return error_type.__qualname__
    if module.startswith(PACKAGE_ROOT + "."):
        module = module.split(".", 2)[2] if module.count(".") >= 2 else module
    if module.startswith("pgjobd."):
        module = "pgjobd"
    return f"{module}.{error_type.__qualname__}"


def _error_fields(error: BaseException) -> dict[str, Any]:
    text = "".join(traceback.format_exception(error))
    if len(text) > MAX_TRACEBACK_CHARS:
        text = "...(truncated)\n" + text[-MAX_TRACEBACK_CHARS:]
    message = str(error)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "...(truncated)"
    error_class = class_name(type(error))
    return {"error_class": error_class, "error_message": message, "traceback": text,
            "fingerprint": fingerprint(error_class, message, handler_frame(error))}  # fmt: skip


def handler_frame(error: BaseException) -> str | None:
    """The innermost frame of the handlers' code the error passed through, as
    "module:function" (the module without its synthetic package), or None."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if isinstance(module, str) and module.startswith(PACKAGE_ROOT + "."):
            found = f"{module.split('.', 2)[-1]}:{tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return found


def _cause_fields(outcome: BaseException) -> dict[str, Any]:
    """For Retry/Snooze/Discard: the exception that led to it, if any, else its own text."""
    cause = outcome.__cause__ or outcome.__context__
    if cause is not None:
        return _error_fields(cause)
    error_class = class_name(type(outcome))
    return {"error_class": error_class, "error_message": str(outcome) or None,
            "fingerprint": fingerprint(error_class, str(outcome))}  # fmt: skip


if __name__ == "__main__":
    command(parse_args(sys.argv[1:]))
