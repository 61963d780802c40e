"""Handlers that misbehave at the OS level, against a QueueWorkers with real processes.

Each handler leaves a process behind or breaks its worker's pipes; the supervisor must notice
the worker's death from the process itself, end its whole process group with it, and
report the job sensibly. (Descendants that leave the group are the daemon's, as a
subreaper: see tests/e2e/test_drain_hardening.py.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from pgjobd.config import QueueConfig
from pgjobd.duration import Duration
from pgjobd.errors import ConfigError
from pgjobd.model import ClaimedJob, Outcome
from pgjobd.protocol import Run, encode_frame
from pgjobd.supervisor import QueueWorkers

from .handlers_source import SOURCE
from .test_supervisor import WAIT_S, Harness, handler_dir, make_job

pytestmark = pytest.mark.anyio

HOSTILE = '''
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pgjobd import job


def _write_pid(path: str, pid: int) -> None:
    Path(path + ".tmp").write_text(str(pid))
    os.replace(path + ".tmp", path)


def _linger() -> None:
    """In a forked child: outlive the handler, holding every inherited descriptor."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(3600)
    os._exit(0)


@job
def forks_and_dies(args: dict) -> None:
    """Forks a child that keeps the worker's pipes open, then kills its worker."""
    pid = os.fork()
    if pid == 0:
        _linger()
    _write_pid(args["pidfile"], pid)
    os._exit(7)


@job
def forks_and_returns(args: dict) -> str:
    """Forks a child that keeps the worker's pipes open, and completes."""
    pid = os.fork()
    if pid == 0:
        _linger()
    _write_pid(args["pidfile"], pid)
    return "forked"


@job
def spawns_sigterm_ignorer(args: dict) -> str:
    """Starts a program that ignores SIGTERM, and completes."""
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"])
    _write_pid(args["pidfile"], child.pid)
    return "spawned"


def _frame_fds() -> list[int]:
    """The worker's pipe descriptors to its parent: pipes of which this process holds
    only one end (the event loop's own wake-up pipes have both ends here)."""
    pipes: dict[str, list[int]] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("pipe:") and int(name) > 2:
            pipes.setdefault(target, []).append(int(name))
    return [fds[0] for fds in pipes.values() if len(fds) == 1]


@job
async def closes_the_pipes(args: dict) -> str:
    for fd in _frame_fds():
        os.close(fd)
    return "closed"


@job
async def writes_garbage(args: dict) -> str:
    for fd in _frame_fds():
        try:
            os.write(fd, b"\\xff\\xff\\xff\\xffnot a frame")
        except OSError:
            pass  # the read end
    return "garbage"
'''


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


async def read_pid(path: Path) -> int:
    with anyio.fail_after(WAIT_S):
        while not await anyio.Path(path).exists():  # noqa: ASYNC110 - polled under a deadline
            await anyio.sleep(0.01)
    return int(await anyio.Path(path).read_text())


async def until_dead(pid: int) -> None:
    with anyio.fail_after(WAIT_S):
        while alive(pid):  # noqa: ASYNC110 - /proc has nothing to wait on
            await anyio.sleep(0.02)


@asynccontextmanager
async def hostile_workers(tmp_path: Path, *, concurrency: int = 1) -> AsyncIterator[Harness]:
    send, receive = anyio.create_memory_object_stream[Outcome](100)
    # A long timeout: the supervisor must notice a death long before its watchdog would.
    config = QueueConfig(concurrency=concurrency, processes=1, timeout=Duration(seconds=600))
    directory = handler_dir(tmp_path, {"jobs.py": SOURCE, "hostile.py": HOSTILE})
    workers = QueueWorkers("default", config, [directory], send, grace_s=0.5)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(WAIT_S):
            kinds = await tg.start(workers.run)
        yield Harness(workers, receive, kinds, tmp_path)
        tg.cancel_scope.cancel()


async def test_a_worker_killed_under_a_descendant_holding_its_pipe_is_noticed(
    tmp_path: Path,
) -> None:
    """The worker's exit, not the end of its output (which the forked child keeps
    open), tells the supervisor it died; the child dies with the worker's process group.
    At d1c1ca0 the crash went unnoticed until the job's timeout."""
    pidfile = tmp_path / "grandchild"
    async with hostile_workers(tmp_path) as h:
        outcome = await h.run("forks_and_dies", {"pidfile": str(pidfile)})
        assert outcome.verdict == "crashed"
        assert outcome.error_message is not None and "exit status 7" in outcome.error_message
        await until_dead(await read_pid(pidfile))
        # The slot is served again by a new worker.
        assert (await h.run("add", {"a": 1, "b": 1})).verdict == "completed"


@pytest.mark.parametrize("kind", ["forks_and_returns", "spawns_sigterm_ignorer"])
async def test_what_a_handler_started_ends_with_its_worker(tmp_path: Path, kind: str) -> None:
    pidfile = tmp_path / "descendant"
    async with hostile_workers(tmp_path) as h:
        outcome = await h.run(kind, {"pidfile": str(pidfile)})
        assert outcome.verdict == "completed"
        descendant = await read_pid(pidfile)
        assert alive(descendant)  # the worker lives on, and so may what it started
    await until_dead(descendant)  # the workers stopped: the worker's group went with it


async def test_a_handler_that_closes_the_workers_pipes_costs_one_crashed_job(
    tmp_path: Path,
) -> None:
    """The worker cannot report the outcome: it exits at once (status 4) instead of
    holding the job until its timeout; the job is reported crashed, the slot replaced."""
    async with hostile_workers(tmp_path) as h:
        outcome = await h.run("closes_the_pipes")
        assert outcome.verdict == "crashed"
        assert outcome.error_message is not None and "exit status 4" in outcome.error_message
        assert (await h.run("add", {"a": 1, "b": 1})).verdict == "completed"


async def test_a_handler_that_writes_garbage_to_the_pipe_costs_one_crashed_job(
    tmp_path: Path,
) -> None:
    async with hostile_workers(tmp_path) as h:
        outcome = await h.run("writes_garbage")
        assert outcome.verdict == "crashed"
        assert outcome.error_message is not None and "protocol error" in outcome.error_message
        assert (await h.run("add", {"a": 1, "b": 1})).verdict == "completed"


async def test_two_attempts_of_one_job_are_held_and_cancelled_apart(tmp_path: Path) -> None:
    """Bug 3: a member may hold a job's stale attempt (its lease lost) and a new one
    (claimed again) at once. They are held by (id, fence): cancelling the stale one
    leaves the live one running, and each reports its own outcome. At d1c1ca0 the
    second overwrote the first (held by id)."""
    async with hostile_workers(tmp_path, concurrency=2) as h:
        old = make_job("wait_cancel")
        new = ClaimedJob(**{**_fields(old), "fence": old.fence + 1, "attempt": 2})
        await h.submit(old)
        await h.submit(new)
        keys = {(old.id, old.fence), (new.id, new.fence)}
        assert set(h.workers.held()) == keys
        h.workers.cancel((old.id, old.fence))
        outcome = await h.outcome()
        assert (outcome.job.fence, outcome.verdict) == (old.fence, "completed")
        assert set(h.workers.held()) == {(new.id, new.fence)}
        h.workers.cancel((new.id, new.fence))
        outcome = await h.outcome()
        assert (outcome.job.fence, outcome.verdict) == (new.fence, "completed")
        assert h.workers.held() == {}


def _fields(job: ClaimedJob) -> dict[str, object]:
    return {name: getattr(job, name) for name in job.__struct_fields__}


async def test_give_back_all_kills_before_it_gives_back(tmp_path: Path) -> None:
    """At a drain deadline QueueWorkers kills the workers holding jobs, with what they
    started, and only then reports the jobs given back; no replacement starts."""
    pidfile = tmp_path / "worker"
    async with hostile_workers(tmp_path) as h:
        job = make_job("wait_file", {"path": str(tmp_path / "never"), "started": str(pidfile)})
        await h.submit(job)
        with anyio.fail_after(WAIT_S):
            while not pidfile.exists():  # noqa: ASYNC110 - polled under a deadline
                await anyio.sleep(0.01)
        (worker,) = [c.pid for c in h.workers._children.values()]
        assert await h.workers.give_back_all("drain deadline") == 1
        assert not alive(worker)
        outcome = await h.outcome()
        assert (outcome.job, outcome.verdict) == (job, "given_back")
        assert h.workers.held() == {} and h.workers.free_slots() == 0
        assert h.workers.live_processes() == 0


INTERMEDIATE = """
import os, subprocess, sys
worker = subprocess.Popen(
    [sys.executable, "-m", "pgjobd.worker", "--queue", "default",
     "--handler-dir", sys.argv[1], "--slots", "2"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(sys.argv[3], "wb"),
)
length = int.from_bytes(worker.stdout.read(4), "big")
worker.stdout.read(length)  # Ready
worker.stdin.write(bytes.fromhex(sys.argv[2]))
worker.stdin.flush()
print(worker.pid, flush=True)
os._exit(0)  # the supervisor dies: the worker is an orphan, its pipes broken
"""

MARKER = """
import asyncio
import os
from pathlib import Path

from pgjobd import job


@job
async def marks_its_end(args: dict) -> str:
    while not os.path.exists(args["go"]):
        await asyncio.sleep(0.01)
    Path(args["done"]).write_text("done")
    return "done"
"""


async def test_an_orphaned_worker_finishes_every_job_it_holds(tmp_path: Path) -> None:
    """A broken pipe to a parent that is gone is not a hostile handler: the orphan
    finishes the jobs it holds (whose outcomes are lost either way) and exits."""
    directory = handler_dir(tmp_path, {"marker.py": MARKER})
    jobs = [
        make_job(
            "marks_its_end", {"go": str(tmp_path / f"go{i}"), "done": str(tmp_path / f"done{i}")}
        )
        for i in range(2)
    ]
    frames = b"".join(encode_frame(Run(job=job, timeout_s=60)) for job in jobs)
    result = await anyio.run_process(
        [sys.executable, "-c", INTERMEDIATE, str(directory), frames.hex(), str(tmp_path / "log")]
    )
    worker = int(result.stdout)
    try:
        (tmp_path / "go0").touch()  # its outcome meets the broken pipe
        await file_written(tmp_path / "done0")
        (tmp_path / "go1").touch()
        await file_written(tmp_path / "done1")
        await until_dead(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


async def file_written(path: Path) -> None:
    with anyio.fail_after(WAIT_S):
        while not await anyio.Path(path).exists():  # noqa: ASYNC110 - polled under a deadline
            await anyio.sleep(0.01)


DIES_AT_IMPORT = """
import os
import signal
import time
from pathlib import Path

pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(3600)  # holds the worker's pipes open
    os._exit(0)
Path(os.environ["PGJOBD_TEST_PIDFILE"]).write_text(str(pid))
os._exit(5)
"""


async def test_a_worker_dying_at_boot_under_a_descendant_holding_its_pipe_is_noticed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The boot fails at once with the worker's exit status, not at the boot timeout
    (the forked child keeps the pipe open); the child ends with the worker's group."""
    pidfile = tmp_path / "forked"
    monkeypatch.setenv("PGJOBD_TEST_PIDFILE", str(pidfile))
    send, _ = anyio.create_memory_object_stream[Outcome](10)
    config = QueueConfig(concurrency=1, processes=1, timeout=Duration(seconds=600))
    directory = handler_dir(tmp_path, {"dies.py": DIES_AT_IMPORT})
    workers = QueueWorkers("default", config, [directory], send, grace_s=0.5, boot_timeout_s=600)
    with anyio.fail_after(WAIT_S), pytest.raises(ConfigError, match="exit status 5"):
        await workers.run()
    await until_dead(await read_pid(pidfile))
