"""Handlers with every outcome, for the daemon's end-to-end tests."""

import os
import time
from pathlib import Path

import anyio
import msgspec

from pgjobd import Discard, JobContext, Retry, Snooze, job


@job
async def echo(args: dict[str, object]) -> dict[str, object]:
    return {"echo": args}


@job(queue="other", priority=2, max_attempts=7)
def declared_elsewhere(args: dict[str, object]) -> None:
    return None


@job(max_attempts=3)
async def always_fails(args: dict[str, object]) -> None:
    raise ValueError(f"boom on {args}")


@job(max_attempts=3)
async def retries_then_succeeds(args: dict[str, object], ctx: JobContext) -> int:
    if ctx.attempt < 3:
        raise Retry(after="10ms")
    return ctx.attempt


class Marker(msgspec.Struct):
    path: str


@job(max_attempts=1)
def snoozes_once(args: Marker) -> str:
    marker = Path(args.path)
    if not marker.exists():
        marker.write_text("snoozed")
        raise Snooze("10ms")
    return "woke up"


@job
async def discards(args: dict[str, object]) -> None:
    raise Discard("not worth retrying")


@job(discard_on=(KeyError,))
async def discards_on_key_error(args: dict[str, object]) -> None:
    raise KeyError("missing")


class Typed(msgspec.Struct):
    n: int


@job
async def typed(args: Typed) -> int:
    return args.n * 2


class Ledger(msgspec.Struct):
    path: str
    hold_s: float = 0.0


@job
def record(args: Ledger, ctx: JobContext) -> None:
    """Appends "job attempt start end pid" to a ledger file: who ran what, when."""
    start = time.time()
    time.sleep(args.hold_s)
    with open(args.path, "a") as ledger:
        ledger.write(f"{ctx.id} {ctx.attempt} {start} {time.time()} {os.getpid()}\n")


class Gate(msgspec.Struct):
    started: str
    release: str


@job(timeout="60s")
async def waits_for_gate(args: Gate) -> str:
    """Says it started, then waits until the test opens the gate (a file appears)."""
    await anyio.Path(args.started).write_text("started")
    while not await anyio.Path(args.release).exists():  # noqa: ASYNC110 (another process)
        await anyio.sleep(0.01)
    return "released"


class Watch(msgspec.Struct):
    started: str
    saw_cancel: str


@job(timeout="60s")
async def runs_until_cancelled(args: Watch, ctx: JobContext) -> str:
    """Runs until ctx.cancelled is set (the job was cancelled or its lease lost)."""
    await anyio.Path(args.started).write_text("started")
    while not ctx.cancelled.is_set():  # noqa: ASYNC110 (a threading.Event)
        await anyio.sleep(0.01)
    await anyio.Path(args.saw_cancel).write_text("cancelled")
    return "stopped"


@job(timeout="60s")
async def gives_up_when_cancelled(args: Watch, ctx: JobContext) -> str:
    """Raises once ctx.cancelled is set: the attempt fails, so the job ends cancelled."""
    await anyio.Path(args.started).write_text("started")
    while not ctx.cancelled.is_set():  # noqa: ASYNC110 (a threading.Event)
        await anyio.sleep(0.01)
    raise RuntimeError("cancelled: stopping")
