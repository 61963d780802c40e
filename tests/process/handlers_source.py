"""The handler module the process tests load into their worker processes (as text)."""

SOURCE = '''
import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

from pgjobd import Discard, JobContext, Retry, Snooze, job


class Add(msgspec.Struct):
    a: int
    b: int


@job
async def add(args: Add) -> int:
    return args.a + args.b


@job
def add_sync(args: Add, ctx: JobContext) -> dict:
    thread = threading.current_thread().name
    return {"sum": args.a + args.b, "attempt": ctx.attempt, "thread": thread}


@job
async def retry_later(args: dict) -> None:
    raise Retry(after="10s")


@job
async def snooze(args: dict) -> None:
    raise Snooze("5m")


@job
async def discard(args: dict) -> None:
    raise Discard("no such user")


@job(discard_on=(KeyError,))
async def discard_on_key_error(args: dict) -> None:
    raise KeyError("missing")


def _inner() -> None:
    raise ValueError("boom")


@job
def boom(args: dict) -> None:
    _inner()


class PaymentDeclined(Exception):
    pass


@job
async def declined(args: dict) -> None:
    raise PaymentDeclined("card 42")


@job(timeout="0.3s")
async def slow_async(args: dict) -> None:
    await asyncio.sleep(60)


@job(timeout="0.3s")
def hang_sync(args: dict) -> None:
    threading.Event().wait()


@job
def exit_hard(args: dict) -> None:
    os._exit(1)


@job
async def pid(args: dict) -> int:
    return os.getpid()


@job
def cpu_policy(args: dict) -> list:
    """The Linux scheduling policy of this handler's thread and of a process it starts."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
        capture_output=True, text=True, check=True,
    )
    return [os.sched_getscheduler(0), int(child.stdout)]


@job
async def wait_file(args: dict) -> int:
    """Returns this process's pid once the file args["path"] exists."""
    if "started" in args:
        Path(args["started"]).touch()
    path = Path(args["path"])
    while not path.exists():
        await asyncio.sleep(0.01)
    return os.getpid()


@job
async def rendezvous(args: dict) -> int:
    """Marks its start in args["dir"], then waits until args["n"] jobs have started."""
    directory = Path(args["dir"])
    (directory / f"started-{args['i']}").touch()
    deadline = time.monotonic() + 10
    while len(list(directory.glob("started-*"))) < args["n"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the other jobs did not start")
        await asyncio.sleep(0.01)
    return os.getpid()


@job
async def wait_cancel(args: dict, ctx: JobContext) -> str:
    while not ctx.cancelled.is_set():
        await asyncio.sleep(0.01)
    return "cancelled"


@job
def printer(args: dict) -> str:
    print("hello from a handler, on stdout")
    return "printed"


@job
async def not_json(args: dict) -> object:
    return object()


@job
async def asks_results(args: dict, ctx: JobContext) -> dict:
    return await ctx.results()
'''
