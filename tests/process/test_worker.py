"""The worker process on its own, driven over its pipes as the supervisor would."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
import pytest
from anyio.abc import Process

from pgjobd.channel import Channel
from pgjobd.protocol import (
    EXIT_BOOT,
    Done,
    Ready,
    ResultsWanted,
    Run,
    Stop,
    ToParent,
    encode_frame,
)

from .handlers_source import SOURCE
from .test_supervisor import WAIT_S, handler_dir, make_job

pytestmark = pytest.mark.anyio


async def start_worker(
    tmp_path: Path, *options: str, launcher: Sequence[str] = ()
) -> tuple[Process, Channel[ToParent], Ready]:
    directory = handler_dir(tmp_path, {"jobs.py": SOURCE})
    command = [*launcher, sys.executable, "-m", "pgjobd.worker", "--queue", "default",
               "--handler-dir", str(directory), "--slots", "2", *options]  # fmt: skip
    process = await anyio.open_process(command, stderr=None)
    assert process.stdin is not None and process.stdout is not None
    channel: Channel[ToParent] = Channel(process.stdin, process.stdout, ToParent)
    with anyio.fail_after(WAIT_S):
        ready = await channel.receive()
    assert isinstance(ready, Ready) and ready.pid == process.pid
    return process, channel, ready


async def test_orphaned_worker_finishes_its_job_then_exits_0(tmp_path: Path) -> None:
    process, channel, _ = await start_worker(tmp_path)
    flag = tmp_path / "go"
    job = make_job("wait_file", {"path": str(flag)})
    async with process:
        await channel.send(Run(job=job, timeout_s=30))
        assert process.stdin is not None
        await process.stdin.aclose()  # the supervisor is gone
        flag.touch()
        with anyio.fail_after(WAIT_S):
            done = await channel.receive()
            assert isinstance(done, Done)
            assert (done.job_id, done.fence, done.verdict) == (job.id, job.fence, "completed")
            assert await process.wait() == 0


async def test_an_orphaned_worker_answers_a_wait_for_results_at_once(tmp_path: Path) -> None:
    # Found by a flaky leak check: a job waiting for ctx.results() when its member was
    # killed waited for an answer until its timeout, holding the orphan alive that long.
    process, channel, _ = await start_worker(tmp_path)
    job = msgspec.structs.replace(make_job("asks_results"), depends_on=(1,))
    async with process:
        await channel.send(Run(job=job, timeout_s=300))
        with anyio.fail_after(WAIT_S):
            asked = await channel.receive()
        assert isinstance(asked, ResultsWanted) and asked.job_id == job.id
        assert process.stdin is not None
        await process.stdin.aclose()  # the supervisor is gone before it answers
        with anyio.fail_after(WAIT_S):
            done = await channel.receive()
            assert isinstance(done, Done)
            assert (done.verdict, done.error_class) == ("failed", "pgjobd.ResultsUnavailable")
            assert await process.wait() == 0


async def test_stop_finishes_what_it_holds_then_exits_0(tmp_path: Path) -> None:
    process, channel, _ = await start_worker(tmp_path)
    job = make_job("printer")
    async with process:
        await channel.send(Run(job=job, timeout_s=30))
        await channel.send(Stop())
        with anyio.fail_after(WAIT_S):
            done = await channel.receive()
            assert isinstance(done, Done) and done.result == b'"printed"'
            with pytest.raises(anyio.EndOfStream):
                await channel.receive()
            assert await process.wait() == 0


@pytest.mark.parametrize("entry", [["-m", "pgjobd.worker"], ["-m", "pgjobd", "worker"]])
async def test_import_failure_exits_3(tmp_path: Path, entry: list[str]) -> None:
    """Also through `pgjobd worker`, the hidden alias of `python -m pgjobd.worker`."""
    directory = handler_dir(tmp_path, {"bad.py": "import no_such_module_here\n"})
    command = [sys.executable, *entry, "--queue", "default",
               "--handler-dir", str(directory), "--slots", "1"]  # fmt: skip
    with anyio.fail_after(WAIT_S):
        result = await anyio.run_process(command, check=False)
    assert result.returncode == EXIT_BOOT == 3
    assert b"bad.py" in result.stderr and b"no_such_module_here" in result.stderr


async def test_sigterm_and_sigint_are_ignored(tmp_path: Path) -> None:
    """The parent drives shutdown: a signal sent to every process (a cgroup's, a
    process group's) must not stop a worker behind its back."""
    process, channel, _ = await start_worker(tmp_path)
    flag, started = tmp_path / "go", tmp_path / "started"
    job = make_job("wait_file", {"path": str(flag), "started": str(started)})
    async with process:
        await channel.send(Run(job=job, timeout_s=30))
        with anyio.fail_after(WAIT_S):
            while not started.exists():  # noqa: ASYNC110 - polled under a deadline
                await anyio.sleep(0.01)
        process.send_signal(signal.SIGINT)
        process.send_signal(signal.SIGTERM)
        flag.touch()
        with anyio.fail_after(WAIT_S):
            done = await channel.receive()
            assert isinstance(done, Done) and done.verdict == "completed"
        later = make_job("add", {"a": 1, "b": 2})  # still taking work
        await channel.send(Run(job=later, timeout_s=30))
        with anyio.fail_after(WAIT_S):
            done = await channel.receive()
            assert isinstance(done, Done) and (done.job_id, done.verdict) == (later.id, "completed")
        await channel.send(Stop())
        with anyio.fail_after(WAIT_S):
            assert await process.wait() == 0


# What a worker process must never load: the database driver, anyio, the daemon's and the
# client's modules, and OpenTelemetry unless a handler imports it (pgjobd.tracing). Its
# handlers here do `import pgjobd` and `from pgjobd import job, ...`.
NOT_IN_A_WORKER = ("asyncpg", "anyio", "opentelemetry", "pgjobd.client", "pgjobd.channel",
                   "pgjobd.config", "pgjobd.supervisor", "pgjobd.daemon", "pgjobd.cli",
                   "pgjobd.db")  # fmt: skip


async def test_a_worker_imports_only_what_it_needs(tmp_path: Path) -> None:
    """Every module a booted worker imported (-X importtime lists each on stderr)."""
    directory = handler_dir(tmp_path, {"jobs.py": SOURCE})
    assert "from pgjobd import" in SOURCE
    command = [sys.executable, "-X", "importtime", "-m", "pgjobd.worker", "--queue",
               "default", "--handler-dir", str(directory), "--slots", "1"]  # fmt: skip
    with anyio.fail_after(WAIT_S):
        result = await anyio.run_process(command, input=encode_frame(Stop()), check=False)
    assert result.returncode == 0, result.stderr.decode()
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.decode().splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert {"pgjobd.protocol", "pgjobd.handler_api", "pgjobd.handler_loader", "msgspec"} <= imported
    loaded = sorted(
        name for name in imported
        if any(name == top or name.startswith(top + ".") for top in NOT_IN_A_WORKER)
    )  # fmt: skip
    assert loaded == []


async def run_cpu_policy(process: Process, channel: Channel[ToParent]) -> list[int]:
    """What the cpu_policy handler saw: its thread's policy, and its child process's."""
    async with process:
        await channel.send(Run(job=make_job("cpu_policy"), timeout_s=30))
        await channel.send(Stop())
        with anyio.fail_after(WAIT_S):
            done = await channel.receive()
            assert isinstance(done, Done) and done.verdict == "completed", done
            assert await process.wait() == 0
    assert done.result is not None
    seen: list[int] = msgspec.json.decode(done.result)
    return seen


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
@pytest.mark.skipif(shutil.which("chrt") is None, reason="util-linux's chrt")
@pytest.mark.parametrize(
    ("launcher", "policy", "expected"),
    [
        ((), "batch", "SCHED_BATCH"),
        ((), "other", "SCHED_OTHER"),
        # The policy is set, not only added to: a worker of a service that runs as
        # batch work (systemd's CPUSchedulingPolicy=batch) can still be "other".
        (("chrt", "--batch", "0"), "other", "SCHED_OTHER"),
        (("chrt", "--batch", "0"), None, "SCHED_BATCH"),  # no option: as inherited
        ((), None, "SCHED_OTHER"),
    ],
)
async def test_a_worker_runs_under_its_queues_cpu_scheduling_and_so_do_its_threads_and_children(
    tmp_path: Path, launcher: tuple[str, ...], policy: str | None, expected: str
) -> None:
    options = () if policy is None else ("--cpu-scheduling", policy)
    process, channel, _ = await start_worker(tmp_path, *options, launcher=launcher)
    assert os.sched_getscheduler(process.pid) == getattr(os, expected)
    # The cpu_policy handler is a `def` one: it runs in a thread the worker started.
    assert await run_cpu_policy(process, channel) == [getattr(os, expected)] * 2
