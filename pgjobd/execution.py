"""One attempt of one job: convert its args, call its handler through the middleware,
and turn what happened into a Done. The code every attempt runs, wherever it runs: the
worker process (pgjobd.worker) and the testing kit (pgjobd.testing.run_job).

Plain asyncio and the handler API only: it is imported by the worker process, which
never loads anyio, asyncpg or the daemon's modules.

- Args arrive as JSON text and are converted with the handler's args type
  (validate_args); a job whose args do not convert ends invalid_args.
- The middleware (outermost first) each get the job's context and a `call_next` that
  runs the rest of the chain and returns the handler's value or raises what it raised;
  whatever the outermost one returns or raises is the attempt's outcome, exactly as if
  the handler had returned or raised it.
- async handlers (and their middleware) are cancelled at their timeout (failed,
  TimeoutError). `def` handlers run in daemon threads (reused: pgjobd.handler_threads),
  which cannot be interrupted: see pgjobd.worker for what the parent does about one that
  never returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from pgjobd import log as pgjobd_log
from pgjobd import redact, tracing
from pgjobd.fingerprint import fingerprint
from pgjobd.handler_api import (
    VERSION_KEY,
    ArgsError,
    BatchCounts,
    Discard,
    HandlerSpec,
    JobContext,
    NewerArgs,
    Retry,
    Snooze,
    upgraded,
    validate_args,
)
from pgjobd.handler_loader import PACKAGE_ROOT, Registry
from pgjobd.handler_threads import HandlerThreads
from pgjobd.middleware import Middleware
from pgjobd.model import ClaimedJob
from pgjobd.outcome import MAX_MESSAGE_CHARS, MAX_RESULT_BYTES, MAX_TRACEBACK_CHARS
from pgjobd.protocol import Done

log = logging.getLogger("pgjobd.worker")
_JOB_LOGGER = logging.getLogger("pgjobd.job")  # ctx.logger's, the same for every job
_THREADS = HandlerThreads()  # where `def` handlers run
_JSON_OBJECT = dict[str, Any]  # the args type of a handler whose args are not typed

# A job whose args are newer than its handler comes back this much later (for a member
# that knows them: a rolling deploy), with no attempt charged.
GIVE_BACK_S = 1.0
# ctx.results(): reads the results of the jobs this one waited for.
ResultsReader = Callable[[], Awaitable[dict[int, Any]]]


class _TimedOut(Exception):
    pass


class Cancellation:
    """An attempt's `ctx.cancelled`, made only when the attempt's context is: a
    threading.Event costs more than a no-op job, and a handler that takes no context (with
    no middleware) cannot see one. Used on the event loop's thread only; the handler's
    thread sees the Event itself."""

    __slots__ = ("_event", "_requested")

    def __init__(self) -> None:
        self._event: threading.Event | None = None
        self._requested = False

    def set(self) -> None:
        self._requested = True
        if self._event is not None:
            self._event.set()

    def event(self) -> threading.Event:
        if self._event is None:
            self._event = threading.Event()
            if self._requested:
                self._event.set()
        return self._event


async def execute(
    registry: Registry,
    job: ClaimedJob,
    timeout_s: float,
    *,
    where: str,
    cancelled: Cancellation | None = None,
    middleware: Sequence[Middleware] = (),
    results: ResultsReader | None = None,
) -> Done:
    """Run one attempt of `job` with its handler in `registry`; `where` names the place
    for the message of an unknown kind ("this worker of queue 'q'"). The handler's
    redact fields are kept out of what it logs and of its errors."""
    spec = registry.get(job.kind)
    hidden = _secrets(job.args, spec.redact) if spec is not None else ()
    pgjobd_log.job_secrets.set(hidden)
    if not tracing.in_use():
        done = await _execute(registry, spec, job, timeout_s, where=where, cancelled=cancelled,
                              middleware=middleware, results=results)  # fmt: skip
    else:
        async with tracing.run_span(
            job.kind, job.id, job.queue, job.attempt, job.trace_context
        ) as outcome:
            done = await _execute(registry, spec, job, timeout_s, where=where,
                                  cancelled=cancelled, middleware=middleware,
                                  results=results)  # fmt: skip
            outcome(done.verdict, redact.redact_text(done.error_message, hidden))
    if hidden and (done.error_message or done.traceback):
        done = msgspec.structs.replace(
            done,
            error_message=redact.redact_text(done.error_message, hidden),
            traceback=redact.redact_text(done.traceback, hidden),
        )
    return done


def _secrets(args_json: bytes | str, fields: tuple[str, ...]) -> tuple[str, ...]:
    if not fields:
        return ()
    try:
        return redact.secrets(msgspec.json.decode(args_json), fields)
    except (msgspec.DecodeError, RecursionError):
        return ()  # args that do not decode are discarded unread


async def _execute(
    registry: Registry,
    spec: HandlerSpec | None,
    job: ClaimedJob,
    timeout_s: float,
    *,
    where: str,
    cancelled: Cancellation | None,
    middleware: Sequence[Middleware],
    results: ResultsReader | None,
) -> Done:
    if spec is None:
        known = ", ".join(registry.kinds()) or "none"
        return Done(
            job.id, job.fence, "unknown_kind", 0.0, error_class="pgjobd.UnknownKind",
            error_message=f"no handler for kind {job.kind!r} in {where}; known kinds: {known}",
        )  # fmt: skip
    return await run_attempt(
        spec, job, timeout_s, cancelled=cancelled, middleware=middleware, results=results
    )


async def run_attempt(
    spec: HandlerSpec,
    job: ClaimedJob,
    timeout_s: float,
    *,
    cancelled: Cancellation | None = None,
    middleware: Sequence[Middleware] = (),
    results: ResultsReader | None = None,
) -> Done:
    """Run one attempt of `job` with its handler `spec`, to the Done that reports it."""
    started = time.monotonic()

    def done(verdict: Any, **fields: Any) -> Done:
        return Done(job.id, job.fence, verdict, time.monotonic() - started, **fields)

    try:
        decoded = msgspec.json.decode(job.args)
        if isinstance(decoded, dict) and (VERSION_KEY in decoded or spec.args_version > 1):
            args = validate_args(spec, upgraded(spec, decoded))
        elif type(decoded) is dict and spec.args_type == _JSON_OBJECT:
            args = decoded  # what a JSON object decodes to: nothing to convert (or copy)
        else:
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

    # Every line logged while the job runs (any logger, print in JSON mode) names it.
    pgjobd_log.job_fields.set(
        {"job_id": job.id, "kind": job.kind, "queue": job.queue, "attempt": job.attempt}
    )
    ctx: JobContext | None = None
    if spec.takes_ctx or middleware:
        ctx = job_context(job, (cancelled or Cancellation()).event(), results)
    call_args: tuple[Any, ...] = (args, ctx) if spec.takes_ctx else (args,)
    try:
        if spec.is_async:
            call: Callable[..., Any] = spec.function
            if ctx is not None and middleware:
                call, call_args = _chain(middleware, ctx, spec.function, call_args), ()
            value = await _call_async(call, call_args, timeout_s)
        else:
            handler = functools.partial(_call_in_thread, spec.function, call_args, job.id)
            if ctx is not None and middleware:
                value = await _chain(middleware, ctx, handler, ())()
            else:
                value = await handler()
            if time.monotonic() - started > timeout_s:
                raise _TimedOut(
                    f"ran {time.monotonic() - started:.1f}s, past its timeout of "
                    f"{timeout_s:g}s (its result is dropped)"
                )
    except _TimedOut as e:
        return done("failed", error_class="TimeoutError", error_message=f"job {e}", traceback=None)
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
    if value is None:  # (no result to encode: the common case, without done()'s **fields)
        return Done(job.id, job.fence, "completed", time.monotonic() - started)
    return done("completed", result=_encode_result(value))


def _chain(
    middleware: Sequence[Middleware],
    ctx: JobContext,
    handler: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
) -> Callable[[], Awaitable[Any]]:
    """A zero-argument coroutine function that runs the middleware, outermost first,
    around handler(*args)."""

    async def innermost() -> Any:
        return await handler(*args)

    call_next: Callable[[], Awaitable[Any]] = innermost
    for layer in reversed(middleware):
        call_next = functools.partial(layer, ctx, call_next)
    return call_next


def job_context(
    job: ClaimedJob, cancelled: threading.Event, results: ResultsReader | None = None
) -> JobContext:
    return JobContext(
        dependencies=job.depends_on + job.after,
        results=results if (job.depends_on or job.after) and results is not None else {},
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
        logger=_JOB_LOGGER,
    )


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _call_async(function: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
    """Run the handler in this task (no task of its own per job), cancelled at its
    timeout. A handler that ignores the cancellation keeps the job held until the
    parent's deadline kills the process; whatever it ends with after its timeout (a
    value, an error of its own) is reported as the timeout. As asyncio.timeout does, but
    with one timer handle and no context manager (a third of its cost per job)."""
    task = asyncio.current_task()
    assert task is not None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        value = await function(*args)
    except BaseException as e:
        timer.cancel()
        if expired:
            task.uncancel()  # ours; one from outside stays counted
            if not (isinstance(e, asyncio.CancelledError) and _being_cancelled()):
                message = f"ran past its timeout of {timeout_s:g}s and was cancelled"
                raise _TimedOut(message) from None
        raise
    timer.cancel()
    if expired:
        task.uncancel()
        log.warning("a handler returned after its timeout was cancelled; result dropped")
        raise _TimedOut(f"ran past its timeout of {timeout_s:g}s and was cancelled")
    return value


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

    # (In the task's context: the job's log fields go with it.)
    context = contextvars.copy_context()
    _THREADS.run(functools.partial(context.run, target), f"pgjobd-job-{job_id}")
    return await future


def _encode_result(value: Any) -> bytes | None:
    """The handler's value as JSON, or None (said in the job's log) when it cannot be kept."""
    if value is None:
        return None
    try:
        encoded = msgspec.json.encode(value)
    except (TypeError, ValueError, msgspec.EncodeError) as e:
        _JOB_LOGGER.warning("return value is not JSON-able, so no result is kept: %s", e)
        return None
    if len(encoded) > MAX_RESULT_BYTES:
        _JOB_LOGGER.warning(
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
