"""An async handler runs in the attempt's own task under its timeout (pgjobd.execution):
what it ends with after the timeout fired is reported as the timeout, what it ends with
before is its own, and a cancellation from outside stays a cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from typing import Any

import pytest

from pgjobd import job
from pgjobd.execution import Cancellation, run_attempt
from pgjobd.handler_api import HANDLER_ATTRIBUTE, HandlerSpec
from pgjobd.model import ClaimedJob

NOW = datetime(2026, 12, 2, tzinfo=UTC)


def claimed(kind: str) -> ClaimedJob:
    return ClaimedJob(1, 1, kind, "default", 1, 5, 0, 0, None, NOW, NOW, b"{}")


def spec_of(function: Any) -> HandlerSpec:
    spec: HandlerSpec = getattr(function, HANDLER_ATTRIBUTE)
    return spec


@job(kind="swallows_then_raises")
async def swallows_then_raises(args: dict[str, Any]) -> None:
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise ValueError("cleaning up failed") from None


@job(kind="swallows_then_returns")
async def swallows_then_returns(args: dict[str, Any]) -> str:
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(10)
    return "late"


@job(kind="own_timeout")
async def own_timeout(args: dict[str, Any]) -> None:
    raise TimeoutError("the remote API timed out")


@job(kind="quick")
async def quick(args: dict[str, Any]) -> dict[str, int]:
    await asyncio.sleep(0)
    return {"n": 1}


@pytest.mark.parametrize("handler", [swallows_then_raises, swallows_then_returns])
def test_what_a_handler_ends_with_after_its_timeout_is_the_timeout(handler: Any) -> None:
    done = asyncio.run(run_attempt(spec_of(handler), claimed(spec_of(handler).kind), 0.05))
    assert (done.verdict, done.error_class) == ("failed", "TimeoutError")
    assert "past its timeout of 0.05s" in (done.error_message or "")
    assert done.result is None


def test_a_handlers_own_timeout_error_before_its_timeout_is_its_own() -> None:
    done = asyncio.run(run_attempt(spec_of(own_timeout), claimed("own_timeout"), 5.0))
    assert (done.verdict, done.error_class) == ("failed", "TimeoutError")
    assert done.error_message == "the remote API timed out"


def test_a_quick_handler_completes_with_its_result() -> None:
    done = asyncio.run(run_attempt(spec_of(quick), claimed("quick"), 5.0))
    assert (done.verdict, done.result) == ("completed", b'{"n":1}')


STARTED: list[asyncio.Event] = []  # set once the handler waits


@job(kind="raises_when_cancelled")
async def raises_when_cancelled(args: dict[str, Any]) -> None:
    STARTED[-1].set()
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise ValueError("cleaning up failed") from None


def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    async def main() -> None:
        STARTED.append(asyncio.Event())
        task = asyncio.create_task(
            run_attempt(spec_of(raises_when_cancelled), claimed("raises_when_cancelled"), 60.0)
        )
        await STARTED[-1].wait()
        task.cancel()
        # The handler turns the cancellation into ValueError: that is its error, not a
        # timeout (the timeout had not fired).
        done = await task
        assert (done.verdict, done.error_class) == ("failed", "ValueError")

    asyncio.run(main())


CLEANING_UP: list[asyncio.Event] = []  # set as the handler starts cleaning up


@job(kind="cleans_up_slowly")
async def cleans_up_slowly(args: dict[str, Any]) -> None:
    try:
        await asyncio.sleep(10)
    finally:
        CLEANING_UP[-1].set()
        await asyncio.sleep(10)  # cleaning up after the timeout's cancellation


def test_a_cancellation_from_outside_after_the_timeout_fired_stays_a_cancellation() -> None:
    async def main() -> None:
        CLEANING_UP.append(asyncio.Event())
        task = asyncio.create_task(
            run_attempt(spec_of(cleans_up_slowly), claimed("cleans_up_slowly"), 0.05)
        )
        await CLEANING_UP[-1].wait()  # the timeout fired; the handler is cleaning up
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_handler_cancelled_at_its_timeout_leaves_its_task_uncancelled() -> None:
    async def main() -> int:
        done = await run_attempt(
            spec_of(swallows_then_returns), claimed("swallows_then_returns"), 0.05
        )
        assert (done.verdict, done.error_class) == ("failed", "TimeoutError")
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    # The worker's task goes on to report the Done: no cancellation of the timeout's may
    # be left pending on it.
    assert asyncio.run(main()) == 0


def test_a_cancellation_asked_before_the_context_is_made_is_set_in_it() -> None:
    early, late = Cancellation(), Cancellation()
    early.set()
    assert early.event().is_set()
    event = late.event()
    assert not event.is_set()
    late.set()
    assert event.is_set() and late.event() is event
