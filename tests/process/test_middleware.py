"""Middleware in a real worker process: `--middleware module:callable`, outermost first,
around async and thread handlers; it sees the context and the outcome (Retry, Snooze
and Discard raised inside included), and one that raises fails the attempt."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest

from pgjobd.channel import Channel
from pgjobd.protocol import EXIT_BOOT, BootFailed, Done, Ready, Run, Stop, ToParent

from .test_supervisor import WAIT_S, handler_dir, make_job

pytestmark = pytest.mark.anyio

HANDLERS = """
from pgjobd import Discard, Retry, Snooze, job


@job
async def echo(args: dict) -> dict:
    if args.get("raise") == "retry":
        raise Retry(after="7s")
    if args.get("raise") == "snooze":
        raise Snooze("1m")
    if args.get("raise") == "discard":
        raise Discard("no")
    return {"echo": args}


@job
def echo_sync(args: dict) -> dict:
    return {"echo": args}
"""

MIDDLEWARE = """
import json
import os


def _note(line):
    with open(os.environ["MW_TRAIL"], "a") as f:
        f.write(json.dumps(line) + "\\n")


async def outer(ctx, call_next):
    _note(["outer", ctx.kind, ctx.attempt, ctx.id])
    try:
        value = await call_next()
    except Exception as e:
        _note(["outer saw", type(e).__name__])
        raise
    if '"raise": "middleware"' in json.dumps(value):
        raise RuntimeError("the middleware refused")
    return {"outer": value}


async def inner(ctx, call_next):
    _note(["inner", ctx.kind])
    return {"inner": await call_next()}


not_async = print
"""


async def run_jobs(
    tmp_path: Path, middleware: list[str], jobs: list[tuple[str, dict]]
) -> tuple[list[Done], list[list[object]]]:
    directory = handler_dir(tmp_path, {"jobs.py": HANDLERS})
    (tmp_path / "mw").mkdir()
    (tmp_path / "mw" / "trail_mw.py").write_text(MIDDLEWARE)
    trail = tmp_path / "trail.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "mw"), "MW_TRAIL": str(trail)}
    command = [sys.executable, "-m", "pgjobd.worker", "--queue", "default",
               "--handler-dir", str(directory), "--slots", "1"]  # fmt: skip
    for name in middleware:
        command += ["--middleware", name]
    process = await anyio.open_process(command, stderr=None, env=env)
    assert process.stdin is not None and process.stdout is not None
    channel: Channel[ToParent] = Channel(process.stdin, process.stdout, ToParent)
    done: list[Done] = []
    async with process:
        with anyio.fail_after(WAIT_S):
            assert isinstance(await channel.receive(), Ready)
            for kind, args in jobs:  # one at a time: the trail stays in order
                await channel.send(Run(job=make_job(kind, args), timeout_s=30))
                message = await channel.receive()
                assert isinstance(message, Done)
                done.append(message)
            await channel.send(Stop())
            assert await process.wait() == 0
    lines = trail.read_text().splitlines() if trail.exists() else []
    return done, [json.loads(line) for line in lines]


async def test_middleware_wraps_handlers_outermost_first(tmp_path: Path) -> None:
    done, trail = await run_jobs(
        tmp_path, ["trail_mw:outer", "trail_mw:inner"],
        [("echo", {"a": 1}), ("echo_sync", {"b": 2})],
    )  # fmt: skip
    assert [d.verdict for d in done] == ["completed", "completed"]
    assert json.loads(done[0].result or b"") == {"outer": {"inner": {"echo": {"a": 1}}}}
    assert json.loads(done[1].result or b"") == {"outer": {"inner": {"echo": {"b": 2}}}}
    assert [line[:2] for line in trail] == [
        ["outer", "echo"], ["inner", "echo"], ["outer", "echo_sync"], ["inner", "echo_sync"],
    ]  # fmt: skip
    assert trail[0][2:] == [1, done[0].job_id]  # the context: attempt and id


async def test_middleware_sees_outcomes_and_its_own_errors_fail_the_attempt(
    tmp_path: Path,
) -> None:
    done, trail = await run_jobs(
        tmp_path, ["trail_mw:outer"],
        [("echo", {"raise": "retry"}), ("echo", {"raise": "snooze"}),
         ("echo", {"raise": "discard"}), ("echo", {"raise": "middleware"})],
    )  # fmt: skip
    assert [(d.verdict, d.after_s) for d in done] == [
        ("retry", 7.0), ("snoozed", 60.0), ("discarded", None), ("failed", None),
    ]  # fmt: skip
    assert [line for line in trail if line[0] == "outer saw"] == [
        ["outer saw", "Retry"], ["outer saw", "Snooze"], ["outer saw", "Discard"],
    ]  # fmt: skip
    failed = done[3]
    assert (failed.error_class, failed.error_message) == ("RuntimeError", "the middleware refused")
    assert failed.traceback is not None and "trail_mw.py" in failed.traceback


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("no_such_module:mw", "cannot import module 'no_such_module'"),
        ("trail_mw:missing", "has no attribute 'missing'"),
        ("trail_mw:not_async", "must be an async function"),
    ],
)
async def test_a_middleware_that_does_not_load_is_a_boot_failure(
    tmp_path: Path, name: str, expected: str
) -> None:
    directory = handler_dir(tmp_path, {"jobs.py": HANDLERS})
    (tmp_path / "mw").mkdir()
    (tmp_path / "mw" / "trail_mw.py").write_text(MIDDLEWARE)
    command = [sys.executable, "-m", "pgjobd.worker", "--queue", "default", "--handler-dir",
               str(directory), "--slots", "1", "--middleware", name]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "mw")}
    process = await anyio.open_process(command, stderr=None, env=env)
    assert process.stdout is not None and process.stdin is not None
    channel: Channel[ToParent] = Channel(process.stdin, process.stdout, ToParent)
    async with process:
        with anyio.fail_after(WAIT_S):
            message = await channel.receive()
            assert await process.wait() == EXIT_BOOT
    assert isinstance(message, BootFailed)
    assert name in message.message and expected in message.message
