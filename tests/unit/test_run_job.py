"""pgjobd.testing.run_job: one attempt inline, with the worker's conversion and outcome
rules (pgjobd.execution) and the database's end rule, without a database."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import msgspec
import pytest

from pgjobd import Discard, JobContext, Retry, Snooze, job
from pgjobd.testing import run_job

pytestmark = pytest.mark.anyio


class Welcome(msgspec.Struct):
    user_id: int
    locale: str = "en"


@job(max_attempts=3)
async def send_welcome(args: Welcome, ctx: JobContext) -> dict[str, Any]:
    if args.user_id == 0:
        raise Discard("no such user")
    if args.user_id < 0:
        raise ValueError("negative user id")
    if args.locale == "later":
        raise Snooze("5m")
    if args.locale == "retry":
        raise Retry(after="10s")
    return {"user_id": args.user_id, "attempt": ctx.attempt, "locale": args.locale}


@job(discard_on=(KeyError,))
def lookup(args: dict[str, Any]) -> str:
    return str({"a": 1}[args["key"]])


async def test_a_completed_attempt_keeps_its_json_result() -> None:
    outcome = await run_job(send_welcome, Welcome(user_id=7))
    assert outcome.state == "completed"
    assert outcome.result == {"user_id": 7, "attempt": 1, "locale": "en"}
    assert (outcome.reason, outcome.error, outcome.after) == (None, None, None)


async def test_args_are_converted_as_a_worker_converts_them() -> None:
    assert (await run_job(send_welcome, {"user_id": 7})).result["locale"] == "en"
    invalid = await run_job(send_welcome, {"user_id": "7"})  # strict: no "7" -> 7
    assert (invalid.state, invalid.reason) == ("dead", "invalid_args")
    assert invalid.error is not None and "Welcome" in invalid.error
    with pytest.raises(TypeError, match="JSON object"):
        await run_job(send_welcome, [1, 2])


async def test_retry_snooze_and_discard() -> None:
    retry = await run_job(send_welcome, Welcome(user_id=7, locale="retry"))
    assert (retry.state, retry.after) == ("retryable", timedelta(seconds=10))
    snoozed = await run_job(send_welcome, Welcome(user_id=7, locale="later"))
    assert (snoozed.state, snoozed.after) == ("snoozed", timedelta(minutes=5))
    discarded = await run_job(send_welcome, Welcome(user_id=0))
    assert (discarded.state, discarded.reason) == ("dead", "discarded")
    assert discarded.error == "pgjobd.Discard: no such user"


async def test_failures_retry_until_the_last_attempt() -> None:
    first = await run_job(send_welcome, Welcome(user_id=-1))
    assert (first.state, first.error) == ("retryable", "ValueError: negative user id")
    assert first.traceback is not None and "negative user id" in first.traceback
    last = await run_job(send_welcome, Welcome(user_id=-1), attempt=3)  # @job(max_attempts=3)
    assert (last.state, last.reason) == ("dead", "attempts_exhausted")
    longer = await run_job(send_welcome, Welcome(user_id=-1), attempt=3, max_attempts=4)
    assert longer.state == "retryable"
    # Retry counts an attempt too.
    spent = await run_job(send_welcome, Welcome(user_id=7, locale="retry"), attempt=3)
    assert (spent.state, spent.reason) == ("dead", "attempts_exhausted")


async def test_thread_handlers_and_discard_on() -> None:
    assert (await run_job(lookup, {"key": "a"})).result == "1"
    missing = await run_job(lookup, {"key": "b"})
    assert (missing.state, missing.reason, missing.error_class) == ("dead", "discarded", "KeyError")


async def test_middleware_wraps_the_handler_and_sees_its_outcome() -> None:
    seen: list[tuple[str, Any]] = []

    async def outer(ctx: JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        seen.append(("outer", ctx.kind))
        try:
            value = await call_next()
        except Exception as e:
            seen.append(("outer saw", type(e).__name__))
            raise
        return {**value, "wrapped": True}

    async def inner(ctx: JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        seen.append(("inner", ctx.attempt))
        return await call_next()

    outcome = await run_job(send_welcome, Welcome(user_id=7), middleware=[outer, inner])
    assert outcome.result == {"user_id": 7, "attempt": 1, "locale": "en", "wrapped": True}
    assert seen == [("outer", "send_welcome"), ("inner", 1)]
    seen.clear()
    snoozed = await run_job(send_welcome, Welcome(user_id=7, locale="later"), middleware=[outer])
    assert snoozed.state == "snoozed" and seen[-1] == ("outer saw", "Snooze")

    async def failing(ctx: JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        raise RuntimeError("middleware broke")

    broken = await run_job(send_welcome, Welcome(user_id=7), middleware=[failing])
    assert (broken.state, broken.error) == ("retryable", "RuntimeError: middleware broke")


async def test_not_a_handler() -> None:
    async def plain(args: dict[str, Any]) -> None: ...

    with pytest.raises(TypeError, match="decorated with @job"):
        await run_job(plain, {})
