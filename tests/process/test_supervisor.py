"""QueueWorkers with real worker processes, no database: ClaimedJobs in, Outcomes out."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from pgjobd.completer import OwnEnds
from pgjobd.config import QueueConfig
from pgjobd.duration import Duration
from pgjobd.errors import ConfigError
from pgjobd.model import ClaimedJob, KindInfo, Outcome
from pgjobd.notifier import Wakeup
from pgjobd.supervisor import QueueWorkers

from .handlers_source import SOURCE

pytestmark = pytest.mark.anyio

WAIT_S = 15.0  # generous: a loaded CI machine starts Python slowly
_ids = iter(range(1, 1_000_000))


def make_job(kind: str, args: Any = None, *, raw: bytes | None = None) -> ClaimedJob:
    job_id = next(_ids)
    now = datetime.now(UTC)
    return ClaimedJob(
        id=job_id, fence=job_id * 10, kind=kind, queue="default", attempt=1,
        max_attempts=5, crashes=0, priority=0, tenant=None, enqueued_at=now,
        scheduled_at=now, args=raw if raw is not None else msgspec.json.encode(args or {}),
    )  # fmt: skip


@dataclass
class Harness:
    workers: QueueWorkers
    outcomes: MemoryObjectReceiveStream[Outcome]
    kinds: list[KindInfo]
    tmp: Path

    async def outcome(self) -> Outcome:
        with anyio.fail_after(WAIT_S):
            return await self.outcomes.receive()

    async def run(self, kind: str, args: Any = None, **kw: Any) -> Outcome:
        """Submit one job and return its outcome (the only one expected)."""
        job = make_job(kind, args, **kw)
        await self.submit(job)
        outcome = await self.outcome()
        assert outcome.job == job
        return outcome

    async def submit(self, job: ClaimedJob) -> None:
        with anyio.fail_after(WAIT_S):
            await self.workers.wait_free()
        await self.workers.submit(job)

    async def until(self, condition: Callable[[], bool]) -> None:
        with anyio.fail_after(WAIT_S):
            while not condition():  # noqa: ASYNC110 - a condition polled under a deadline
                await anyio.sleep(0.01)


def handler_dir(tmp_path: Path, files: dict[str, str] | None = None) -> Path:
    directory = tmp_path / "handlers"
    directory.mkdir()
    for name, text in (files or {"jobs.py": SOURCE}).items():
        (directory / name).write_text(text)
    return directory


@asynccontextmanager
async def running_workers(
    tmp_path: Path,
    *,
    concurrency: int = 2,
    processes: int = 1,
    grace_s: float = 0.5,
    outcomes_buffer: int = 100,
) -> AsyncIterator[Harness]:
    send, receive = anyio.create_memory_object_stream[Outcome](outcomes_buffer)
    config = QueueConfig(concurrency=concurrency, processes=processes, timeout=Duration(seconds=30))
    workers = QueueWorkers("default", config, [handler_dir(tmp_path)], send, grace_s=grace_s)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(WAIT_S):
            kinds = await tg.start(workers.run)
        yield Harness(workers, receive, kinds, tmp_path)
        tg.cancel_scope.cancel()


async def test_ready_reports_every_kind_with_declared_defaults(tmp_path: Path) -> None:
    async with running_workers(tmp_path) as h:
        kinds = {info.kind: info for info in h.kinds}
        assert {"add", "add_sync", "slow_async", "hang_sync"} <= set(kinds)
        assert kinds["slow_async"].timeout_s == pytest.approx(0.3)
        assert kinds["add"] == KindInfo("add", None, None, None, None)
        assert h.workers.free_slots() == 2


async def test_async_and_sync_handlers_complete_with_results(tmp_path: Path) -> None:
    async with running_workers(tmp_path) as h:
        outcome = await h.run("add", {"a": 2, "b": 3})
        assert (outcome.verdict, outcome.result, outcome.error_class) == ("completed", b"5", None)
        assert outcome.duration_s >= 0

        outcome = await h.run("add_sync", {"a": 2, "b": 3})
        assert outcome.verdict == "completed"
        assert outcome.result is not None
        result = msgspec.json.decode(outcome.result)
        assert result["sum"] == 5 and result["attempt"] == 1
        assert result["thread"].startswith("pgjobd-job-")

        # print() in a handler goes to stderr, not into the frame stream.
        outcome = await h.run("printer")
        assert (outcome.verdict, outcome.result) == ("completed", b'"printed"')

        outcome = await h.run("not_json")
        assert (outcome.verdict, outcome.result) == ("completed", None)
        assert h.workers.held() == {}


async def test_a_flow_queues_ended_job_is_noted_before_its_outcome_is_handed_over(
    tmp_path: Path,
) -> None:
    """Under flow control the workers add an ended job's fence to OwnEnds before the
    completer can see its outcome (so a claim that follows its freed place leaves it out
    of the fleet-wide count), and set the wake-up a held-back producer waits on."""
    async with running_workers(tmp_path) as h:
        wakeup = Wakeup()
        h.workers.own_ends = OwnEnds(wakeup)
        job = make_job("add", {"a": 1, "b": 2})
        await h.submit(job)
        outcome = await h.outcome()
        assert outcome.job == job
        assert h.workers.own_ends.fences == {job.fence}
        with anyio.fail_after(WAIT_S):
            await wakeup.wait(WAIT_S * 2)  # set as its place was freed
        assert h.workers.free_slots() == 2


async def test_handler_outcomes_map_to_verdicts(tmp_path: Path) -> None:
    async with running_workers(tmp_path) as h:
        retry = await h.run("retry_later")
        assert (retry.verdict, retry.after_s) == ("retry", 10.0)

        snooze = await h.run("snooze")
        assert (snooze.verdict, snooze.after_s) == ("snoozed", 300.0)

        discard = await h.run("discard")
        assert (discard.verdict, discard.error_message) == ("discarded", "no such user")

        listed = await h.run("discard_on_key_error")
        assert (listed.verdict, listed.error_class) == ("discarded", "KeyError")
        assert listed.traceback and "KeyError: 'missing'" in listed.traceback

        failed = await h.run("boom")
        assert (failed.verdict, failed.error_class, failed.error_message) == (
            "failed", "ValueError", "boom",
        )  # fmt: skip
        assert failed.traceback is not None
        assert "in _inner" in failed.traceback and "jobs.py" in failed.traceback

        custom = await h.run("declined")
        assert (custom.verdict, custom.error_class) == ("failed", "jobs.PaymentDeclined")


async def test_invalid_args_and_unknown_kind(tmp_path: Path) -> None:
    async with running_workers(tmp_path) as h:
        wrong = await h.run("add", {"a": "two", "b": 3})
        assert wrong.verdict == "invalid_args"
        assert wrong.error_message and "Expected `int`, got `str`" in wrong.error_message

        not_json = await h.run("add", raw=b"{not json")
        assert not_json.verdict == "invalid_args"
        assert not_json.error_message and "not valid JSON" in not_json.error_message

        # Deeper than Python converts (a direct INSERT can store it): not retried.
        too_deep = await h.run("add", raw=b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert too_deep.verdict == "invalid_args", too_deep

        unknown = await h.run("no_such_kind")
        assert unknown.verdict == "unknown_kind"
        assert unknown.error_message and "no_such_kind" in unknown.error_message
        assert "add_sync" in unknown.error_message  # the known kinds are listed


async def test_async_timeout_is_a_failure(tmp_path: Path) -> None:
    async with running_workers(tmp_path) as h:
        outcome = await h.run("slow_async")
        assert (outcome.verdict, outcome.error_class) == ("failed", "TimeoutError")
        assert outcome.error_message and "timeout of 0.3s" in outcome.error_message
        # It ran until its timeout (the event loop's timers may fire a millisecond early).
        assert outcome.duration_s >= 0.29
        assert (await h.run("add", {"a": 1, "b": 1})).verdict == "completed"  # same process lives


async def test_hung_sync_handler_gets_its_process_killed_and_replaced(tmp_path: Path) -> None:
    async with running_workers(tmp_path, concurrency=1, processes=1, grace_s=0.5) as h:
        first_pid = msgspec.json.decode((await h.run("pid")).result or b"0")
        hung = await h.run("hang_sync")
        assert (hung.verdict, hung.error_class) == ("crashed", "WorkerCrashed")
        assert hung.error_message == (
            "killed after the job ran past its timeout of 0.3s + 0.5s grace"
        )
        assert hung.duration_s >= 0.8
        # The replacement takes the next jobs.
        after = await h.run("pid")
        assert after.verdict == "completed"
        assert msgspec.json.decode(after.result or b"0") != first_pid


async def test_process_exit_is_a_crash_and_spares_other_processes(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    async with running_workers(tmp_path, concurrency=2, processes=2) as h:
        survivor = make_job("wait_file", {"path": str(flag)})
        await h.submit(survivor)  # lands in one process, filling it
        assert h.workers.free_slots() == 1
        await h.submit(doomed := make_job("exit_hard"))  # so this one lands in the other
        crashed = await h.outcome()
        assert crashed.job == doomed
        assert (crashed.verdict, crashed.error_class) == ("crashed", "WorkerCrashed")
        assert crashed.error_message == "worker process exited: exit status 1"
        assert set(h.workers.held()) == {(survivor.id, survivor.fence)}

        flag.touch()
        done = await h.outcome()
        assert (done.job, done.verdict) == (survivor, "completed")

        await h.until(lambda: h.workers.free_slots() == 2)  # replaced
        assert (await h.run("add", {"a": 1, "b": 2})).result == b"3"


async def test_external_sigkill_gets_an_oom_hint(tmp_path: Path) -> None:
    flag = tmp_path / "never"
    async with running_workers(tmp_path, concurrency=1, processes=1) as h:
        pid = msgspec.json.decode((await h.run("pid")).result or b"0")
        await h.submit(job := make_job("wait_file", {"path": str(flag)}))
        os.kill(pid, 9)
        outcome = await h.outcome()
        assert (outcome.job, outcome.verdict) == (job, "crashed")
        assert outcome.error_message == (
            "worker process exited: signal 9 (SIGKILL: possibly the kernel's OOM killer)"
        )
        assert (await h.run("add", {"a": 1, "b": 2})).verdict == "completed"


async def test_handler_module_that_fails_to_import_fails_the_start(tmp_path: Path) -> None:
    directory = handler_dir(tmp_path, {"good.py": SOURCE, "bad.py": "raise RuntimeError('nope')\n"})
    send, _receive = anyio.create_memory_object_stream[Outcome](10)
    workers = QueueWorkers("default", QueueConfig(concurrency=2, processes=2), [directory], send)
    with anyio.fail_after(WAIT_S), pytest.raises(ConfigError) as caught:
        await workers.run()
    message = str(caught.value)
    assert str(directory / "bad.py") in message
    assert "RuntimeError: nope" in message
    assert workers.held() == {} and workers.free_slots() == 0


async def test_concurrency_is_split_across_processes(tmp_path: Path) -> None:
    async with running_workers(tmp_path, concurrency=4, processes=2) as h:
        meet = tmp_path / "meet"
        meet.mkdir()
        jobs = [make_job("rendezvous", {"dir": str(meet), "i": i, "n": 4}) for i in range(4)]
        for job in jobs:
            await h.submit(job)
        assert h.workers.free_slots() == 0
        assert set(h.workers.held()) == {(job.id, job.fence) for job in jobs}
        outcomes = [await h.outcome() for _ in jobs]
        assert {o.verdict for o in outcomes} == {"completed"}
        pids = [msgspec.json.decode(o.result or b"0") for o in outcomes]
        assert sorted(pids.count(p) for p in set(pids)) == [2, 2]  # two jobs per process
        assert h.workers.free_slots() == 4


async def test_one_claim_is_spread_over_the_processes_most_free_slots_first(
    tmp_path: Path,
) -> None:
    async with running_workers(tmp_path, concurrency=6, processes=2) as h:
        meet = tmp_path / "meet"
        meet.mkdir()
        jobs = [make_job("rendezvous", {"dir": str(meet), "i": i, "n": 5}) for i in range(5)]
        await h.submit(jobs[0])  # equal room: the first process
        # One claim: the second process (3 free slots against 2), then each in turn, the
        # first process first when they are even.
        await h.workers.submit_many(jobs[1:])
        assert h.workers.free_slots() == 1
        outcomes = [await h.outcome() for _ in jobs]
        assert {o.verdict for o in outcomes} == {"completed"}
        pid_of = {o.job.id: msgspec.json.decode(o.result or b"0") for o in outcomes}
        first, second = pid_of[jobs[0].id], pid_of[jobs[1].id]
        assert first != second
        assert [pid_of[job.id] for job in jobs] == [first, second, first, second, first]


async def test_a_full_outcome_stream_holds_the_slots_until_the_completer_takes_each_outcome(
    tmp_path: Path,
) -> None:
    """A worker's report of six ends, read at once: the first outcome fits the stream (a
    slot frees), the next waits for room, and so do the rest behind it, their jobs held
    (their slots not free) until the completer has taken each."""
    async with running_workers(tmp_path, concurrency=6, outcomes_buffer=1) as h:
        jobs = [make_job("add", {"a": i, "b": 1}) for i in range(6)]
        await h.workers.submit_many(jobs)
        # The reader waits for room with the second end (and the rest unread behind it):
        # from then on nothing more is freed while the stream stays full.
        await h.until(lambda: any(c.handing_over for c in h.workers._children.values()))
        assert h.workers.free_slots() == 1
        assert len(h.workers.held()) == 5
        outcomes = [await h.outcome() for _ in jobs]
        assert sorted(o.job.id for o in outcomes) == sorted(job.id for job in jobs)
        assert {o.verdict for o in outcomes} == {"completed"}
        await h.until(lambda: h.workers.free_slots() == 6)
        assert not h.workers.held()


async def test_cancel_sets_ctx_cancelled(tmp_path: Path) -> None:
    async with running_workers(tmp_path) as h:
        await h.submit(job := make_job("wait_cancel"))
        h.workers.cancel((job.id, job.fence))
        h.workers.cancel((999_999_999, 1))  # not held: nothing happens
        outcome = await h.outcome()
        assert (outcome.job, outcome.verdict, outcome.result) == (job, "completed", b'"cancelled"')


async def test_stopping_lets_short_jobs_finish_and_leaves_the_rest_held(tmp_path: Path) -> None:
    send, receive = anyio.create_memory_object_stream[Outcome](10)
    config = QueueConfig(concurrency=2, processes=1)
    workers = QueueWorkers("default", config, [handler_dir(tmp_path)], send, grace_s=1.0)
    stuck = make_job("wait_file", {"path": str(tmp_path / "never")})
    quick = make_job("add", {"a": 1, "b": 1})
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            await tg.start(workers.run)
            await workers.submit(stuck)
            await workers.submit(quick)
            tg.cancel_scope.cancel()
    # The quick job's outcome was delivered during the grace period; the stuck one was
    # killed with its process but is not reported: it is the caller's to give back.
    held = {(stuck.id, stuck.fence): stuck}
    assert (receive.receive_nowait().job, workers.held()) == (quick, held)
    with pytest.raises(anyio.WouldBlock):
        receive.receive_nowait()


async def test_a_job_that_crashed_a_worker_before_runs_without_new_neighbours(
    tmp_path: Path,
) -> None:
    async with running_workers(tmp_path, concurrency=4, processes=2) as h:
        gate = tmp_path / "gate"
        suspect = msgspec.structs.replace(make_job("wait_file", {"path": str(gate)}), crashes=1)
        await h.submit(suspect)
        assert h.workers.free_slots() == 2  # its worker takes no one else meanwhile

        others = [make_job("wait_file", {"path": str(gate)}) for _ in range(2)]
        for job in others:
            await h.submit(job)
        assert h.workers.free_slots() == 0
        gate.write_text("go")
        outcomes = [await h.outcome() for _ in range(3)]
        assert {o.verdict for o in outcomes} == {"completed"}
        assert h.workers.free_slots() == 4  # the worker is shared again once it is done


async def test_while_jobs_that_crashed_before_wait_a_claim_takes_one_per_worker_free_for_one(
    tmp_path: Path,
) -> None:
    """The jobs of a member that died have all crashed before, and each runs apart. A
    claim sized by the free slots took more of them than the workers could isolate and
    gave the rest back; then each end freed a worker's slots for a claim that placed one
    and gave back the rest, again and again (the CI log of a killed member's rerun).
    Once one is given back, the free slots count one per worker that has room, until a
    hand-over brings none of them."""
    async with running_workers(tmp_path, concurrency=8, processes=2) as h:
        gate = tmp_path / "gate"
        suspects = [
            msgspec.structs.replace(make_job("wait_file", {"path": str(gate)}), crashes=1)
            for _ in range(4)
        ]
        await h.workers.submit_many(suspects)
        given_back = [await h.outcome() for _ in range(2)]
        assert {o.verdict for o in given_back} == {"given_back"}
        assert all("run it apart" in (o.error_message or "") for o in given_back)
        assert h.workers.free_slots() == 0  # each worker runs one of them, alone
        gate.write_text("go")
        assert {(await h.outcome()).verdict for _ in range(2)} == {"completed"}
        await h.until(lambda: h.workers.running() == 0)
        assert h.workers.free_slots() == 2  # one per worker: no claim to give back again

        await h.workers.submit_many([make_job("add", {"a": 1, "b": 1})])  # none of them
        assert (await h.outcome()).verdict == "completed"
        await h.until(lambda: h.workers.running() == 0)
        assert h.workers.free_slots() == 8
