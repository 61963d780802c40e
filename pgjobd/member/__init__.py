"""The member's services: what one `pgjobd run` process does besides running jobs.

Each service is a module with a name and a `run` loop that serves until its scope is
cancelled, in the shape of the leader's roles (`pgjobd.roles`):

  presence      the member's row: joins, heartbeats (rejoins if the row went), leaves
  lease_keeper  renews the leases of the jobs held; cancels those whose lease was lost
  promoter      makes due scheduled and retryable jobs claimable
  strays        kills what handlers left behind (the member is a child subreaper)
  signals       turns SIGTERM/SIGINT/SIGHUP into Control messages for the member
  reload        consumes Reload messages: a new generation of workers on a new config

`pgjobd.daemon.Member` is the supervisor: it opens the scopes, starts the services in
them, and runs the drain. `generations` holds the queue workers (and their producers) of
each version of the config.

Services share a `MemberContext`. Its `config` is a `LiveConfig`: read by everyone,
written only by the reload coordinator; its `vitals` are written by the services that
observe them (presence: the database; the supervisor: a task that died) and read by
/healthz, /readyz and the metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import anyio
import asyncpg
from anyio.abc import TaskStatus

from pgjobd.config import Config, QueueConfig
from pgjobd.model import ClaimedJob
from pgjobd.queries import Queries
from pgjobd.supervisor import JobKey, QueueWorkers

log = logging.getLogger("pgjobd.daemon")

HeldJobs = dict[JobKey, tuple[QueueWorkers, ClaimedJob]]


class LiveConfig:
    """The member's configuration as of its latest reload."""

    def __init__(self, config: Config) -> None:
        self._current = config
        self._queues = dict(config.queues)

    @property
    def current(self) -> Config:
        return self._current

    @property
    def queues(self) -> dict[str, QueueConfig]:
        """Every queue of every config this member has run, as of its latest config: an
        older generation's jobs may still be finishing in a queue a reload removed.
        Readers must not change it."""
        return self._queues

    def publish(self, config: Config) -> None:
        """A reload took effect (the reload coordinator is the only caller)."""
        self._current = config
        self._queues.update(config.queues)


@dataclass
class Vitals:
    """What /healthz and /readyz report about the member's own tasks and database."""

    dead_task: str | None = None
    db_ok_at: float | None = None  # monotonic time of the last good round trip
    db_error: str | None = None


@dataclass(frozen=True)
class MemberContext:
    pool: asyncpg.Pool
    queries: Queries
    member_id: str
    config: LiveConfig
    vitals: Vitals
    # every job in flight on this member, with the queue workers holding it
    held: Callable[[], HeldJobs]

    def job_fields(self, job: ClaimedJob) -> dict[str, object]:
        return job_fields(job, self.member_id)


def job_fields(job: ClaimedJob, member_id: str) -> dict[str, object]:
    """The fields every log line about a job carries."""
    return {"job_id": job.id, "kind": job.kind, "queue": job.queue,
            "attempt": job.attempt, "member": member_id}  # fmt: skip


class MemberService(Protocol):
    name: ClassVar[str]

    async def run(self, ctx: MemberContext) -> None:
        """Serve until cancelled (a service started with `TaskGroup.start` also takes
        task_status, and reports when it serves)."""


async def watched(
    ctx: MemberContext, name: str, run: Callable[..., Awaitable[None]], *args: Any,
    task_status: TaskStatus[Any] = anyio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Run a core task; if it dies, say so (/healthz, /readyz) while the member goes
    down with it."""
    try:
        if task_status is anyio.TASK_STATUS_IGNORED:
            await run(*args)
        else:
            await run(*args, task_status=task_status)
    except Exception as e:
        ctx.vitals.dead_task = f"{name}: {e!r}"
        log.critical(
            "core task %s died: %r", name, e,
            extra={"event": "member.task_died", "task": name, "member": ctx.member_id},
        )  # fmt: skip
        raise
