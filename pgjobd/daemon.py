"""`pgjobd run`: one member of the fleet.

Task layout, outermost first (each layer outlives the ones inside it, so that work in
flight can always be recorded):

  services   completer, LISTEN session, presence heartbeat, lease keeper, stray
             sweeper, signal watcher (and the member acting on its messages)
  workers    one QueueWorkers per queue (the subprocesses), per generation
  intake     one producer per queue, the promoter of due jobs, the reload
             coordinator, and the leader elector with the roles it runs while this
             member leads

SIGTERM/SIGINT drains: intake stops at once (a claim in flight still hands its jobs
over); jobs in flight get until drain_timeout; the workers still running jobs then are
killed, and only then are their jobs given back (available again, attempt not charged);
the member leaves the fleet and the process exits 0. A second signal does the same at
once. Leadership is released as the drain starts, so another member takes over at once.

The member is a child subreaper: whatever a handler starts and leaves behind ends up
its child and is killed (see supervisor.kill_strays), during the run and at exit.

Member is the supervisor: the services it starts in these scopes (presence, lease
keeper, promoter, signal watcher, reload coordinator, stray sweeper) each have a module
in pgjobd/member/, the worker generations too (pgjobd/member/generations.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import anyio
import asyncpg
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pgjobd import db, errors, health, metrics, migrate, systemd
from pgjobd.client import skip_session_reset
from pgjobd.completer import FINAL_FLUSH_S, Completer
from pgjobd.config import Config
from pgjobd.leader import Elector, Leadership
from pgjobd.member import HeldJobs, LiveConfig, MemberContext, Vitals, job_fields, watched
from pgjobd.member.generations import Generation, Generations, most_telling
from pgjobd.member.lease_keeper import LeaseKeeper
from pgjobd.member.presence import Presence
from pgjobd.member.promoter import Promoter
from pgjobd.member.reload import ReloadCoordinator
from pgjobd.member.signals import Control, Drain, Reload, SignalWatcher, StopNow
from pgjobd.member.strays import StraySweeper, end_strays
from pgjobd.model import Outcome
from pgjobd.notifier import Notifier
from pgjobd.queries import Queries, for_schema
from pgjobd.roles import Role
from pgjobd.roles.breaker import BreakerKeeper
from pgjobd.roles.cron import CronTicker
from pgjobd.roles.depth_counter import DepthCounter
from pgjobd.roles.horizon import HorizonWatchdog
from pgjobd.roles.partitions import PartitionRotator
from pgjobd.roles.priority_ager import PriorityAger
from pgjobd.roles.queue_stats import QueueStats
from pgjobd.roles.reaper import Reaper
from pgjobd.roles.reindexer import Reindexer
from pgjobd.roles.runner import RoleRunner
from pgjobd.roles.samples import QueueSampler
from pgjobd.supervisor import QueueWorkers, become_subreaper

__all__ = ["Member", "leader_roles", "most_telling", "new_member_id"]

T = TypeVar("T")
# A starting member's tries to reach the database: 0.2 s apart, doubling up to 2 s.
START_RETRY_FIRST_S = 0.2
START_RETRY_MAX_S = 2.0

log = logging.getLogger(__name__)

OUTCOME_BUFFER = 10_000
# After a second SIGTERM, how long a claim in flight may take to hand its jobs over.
STOP_NOW_CLAIM_S = 2.0


def leader_roles() -> list[Role]:
    """The leader's roles: one instance each per member, kept across terms (some keep
    state: cooldowns, alarms, the latest readings)."""
    return [
        Reaper(),
        PartitionRotator(),
        CronTicker(),
        Reindexer(),
        HorizonWatchdog(),
        QueueStats(),
        DepthCounter(),
        QueueSampler(),
        PriorityAger(),
        BreakerKeeper(),
    ]


def new_member_id() -> str:
    """Unique per process: several members may share a host (and a hostname)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def job_path_warmer(q: Queries) -> db.ConnectionHook:
    """What prepares each connection of the member's pool for the job path: the claim
    path's read, the claim, the look behind the claim cursor and the completion, each run
    once with arguments that match nothing. So the first claims and completions on a
    connection are not also their statements' parse, generic plan and asyncpg's look-up
    of their types, milliseconds each that a starting member's first jobs waited for
    (docs/decisions.md, issue 17, target 4)."""

    async def warm(conn: asyncpg.Connection) -> None:
        await q.queue_claim_path_get(conn, "")
        await q.job_claim(conn, "", 0, "", timedelta(0))
        await q.job_available_behind(conn, "", 0, datetime.fromtimestamp(0, UTC), 0)
        await q.job_complete_many(conn, [])

    return warm


async def create_member_pool(config: Config, *, warm: bool = True) -> asyncpg.Pool:
    """The member's pool: no reset query on release, each statement planned once for any
    parameters, and (unless not `warm`) each connection prepared for the job path."""
    q = for_schema(config.database.schema)
    return await db.create_pool(
        config, reset=skip_session_reset, generic_plans=True,
        warm=job_path_warmer(q) if warm else None,
    )  # fmt: skip


class Member:
    def __init__(self, config: Config, reload_config: Callable[[], Config] | None = None) -> None:
        self.live = LiveConfig(config)
        self.reload_config = reload_config
        self.id = new_member_id()
        self.q: Queries = for_schema(config.database.schema)
        self.ready = anyio.Event()
        self.roles: RoleRunner | None = None
        self.draining = False
        self._stop_now = anyio.Event()
        self._drain_deadline: float | None = None
        self._subreaper = False
        self._generations: Generations | None = None
        self._intake: TaskGroup | None = None
        self.presence = Presence()
        # For /healthz, /readyz and the metrics read at scrape time.
        self.vitals = Vitals()
        self.loop_monitor = health.LoopMonitor()
        self.http_port: int | None = None  # bound by the metrics/health server

    @property
    def config(self) -> Config:
        """The configuration as of the latest reload."""
        return self.live.current

    @property
    def generations(self) -> list[Generation]:
        return [] if self._generations is None else self._generations.running

    def held(self) -> HeldJobs:
        """Every job in flight on this member by (id, fence), with the queue workers holding it."""
        return {} if self._generations is None else self._generations.held()

    def cancel_job(self, job_id: int) -> None:
        """An admin cancelled this job: set ctx.cancelled in the worker holding it (the
        attempt's end then records it as cancelled, unless it completes)."""
        for key, (queue_workers, job) in self.held().items():
            if key[0] == job_id:
                fields = {"event": "job.cancel_requested", **job_fields(job, self.id)}
                log.info("job %d cancelled by an admin", job_id, extra=fields)
                queue_workers.cancel(key)

    async def run(self) -> None:
        """Serve until drained. Raises ConfigError (a handler that cannot be imported),
        SchemaError, or a database error at start-up.

        The metrics and health server runs around everything else: it answers during
        start-up (not ready) and the drain (draining)."""
        metrics.watch_member(self.member_state)
        error: Exception | None = None
        async with anyio.create_task_group() as outer:
            try:
                outer.start_soon(self.loop_monitor.run)
                address = self.config.daemon.metrics_address
                if address is not None:
                    self.http_port = await outer.start(health.serve, *address, self.health_checks)
                await self._run()
            except Exception as e:  # raised as itself, not in a task group's group
                error = e
            finally:
                outer.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _run(self) -> None:
        self._subreaper = become_subreaper()
        pool = await self._open_pool()
        try:
            self.vitals.db_ok_at = anyio.current_time()
            await self._serve(pool)
        finally:
            if self._subreaper:  # the workers have ended (or never started)
                await end_strays()
            with anyio.move_on_after(5, shield=True):
                await pool.close()

    async def _open_pool(self) -> asyncpg.Pool:
        """The member's pool, its schema checked (see _at_start)."""

        async def open_and_check() -> asyncpg.Pool:
            pool = await create_member_pool(self.config)
            try:
                async with db.acquire(pool) as conn:
                    await migrate.check_schema(conn, self.config.database.schema, deep=True)
            except BaseException:
                with anyio.move_on_after(5, shield=True):
                    await pool.close()
                raise
            return pool

        return await self._at_start("opening the pool", open_and_check)

    async def _at_start(self, what: str, step: Callable[[], Awaitable[T]]) -> T:
        """Runs a start-up step against the database; while the database (or the pooler
        in front of it) cannot be reached, tries again, backing off, for up to
        database.start_wait, then raises what it got. Steps are idempotent."""
        deadline = anyio.current_time() + self.config.database.start_wait.total_seconds()
        backoff_s = START_RETRY_FIRST_S
        while True:
            try:
                return await step()
            except Exception as e:
                left_s = deadline - anyio.current_time()
                if not errors.retry_later(e) or left_s <= 0:
                    raise
                self.vitals.db_error = f"{type(e).__name__}: {e}"
                log.warning(
                    "%s: the database cannot be reached (%s: %s); trying again for %.0fs more",
                    what, type(e).__name__, e, left_s,
                    extra={"event": "db.unreachable_at_start", "step": what,
                           "error": type(e).__name__},
                )  # fmt: skip
                await anyio.sleep(min(backoff_s, left_s))
                backoff_s = min(backoff_s * 2, START_RETRY_MAX_S)

    def health_checks(self) -> health.Checks:
        now = anyio.current_time()
        # (completer and notifier exist once the database has been reached)
        notifier: Notifier | None = getattr(self, "notifier", None)
        completer: Completer | None = getattr(self, "completer", None)
        db_ok_at = self.vitals.db_ok_at
        return health.Checks(
            started=self.ready.is_set(),
            draining=self.draining,
            dead_task=self.vitals.dead_task,
            db_ok_age_s=None if db_ok_at is None else now - db_ok_at,
            db_error=self.vitals.db_error,
            listener_healthy=notifier is not None and notifier.healthy,
            recording=completer is None or completer.accepting,
            failed_queues={
                name: queue_workers.failed
                for name, queue_workers in self._current_workers().items()
                if queue_workers.failed is not None
            },
            loop_lag_s=self.loop_monitor.lag_s,
        )

    def member_state(self) -> metrics.MemberState:
        in_flight: dict[str, int] = {}
        for _, job in self.held().values():
            in_flight[job.queue] = in_flight.get(job.queue, 0) + 1
        workers: dict[str, int] = {}
        for generation in self.generations:
            for name, queue_workers in generation.workers.items():
                in_flight.setdefault(name, 0)
                workers[name] = workers.get(name, 0) + queue_workers.live_processes()
        checks = self.health_checks()
        return metrics.MemberState(
            in_flight=in_flight,
            workers=workers,
            failed_queues=set(checks.failed_queues),
            ready=not health.ready_problems(checks),
            draining=self.draining,
            event_loop_lag_s=self.loop_monitor.lag_s,
        )

    def _current_workers(self) -> dict[str, QueueWorkers]:
        return {} if self._generations is None else self._generations.current_workers()

    async def _serve(self, pool: asyncpg.Pool) -> None:
        ctx = MemberContext(pool, self.q, self.id, self.live, self.vitals, self.held)
        send, receive = anyio.create_memory_object_stream[Outcome](OUTCOME_BUFFER)
        # each QueueWorkers sends through a clone; closed when all are done
        self.completer = Completer(pool, self.q, self.id, self.live.queues, receive)
        self.notifier = Notifier(self.config, self.config.queues, self.id)
        self.notifier.on_cancel = self.cancel_job
        generations = self._generations = Generations(ctx, send, self.completer, self.notifier)
        controls, orders = anyio.create_memory_object_stream[Control](math.inf)
        reloads, reload_requests = anyio.create_memory_object_stream[Reload](math.inf)
        async with anyio.create_task_group() as services:
            services.start_soon(watched, ctx, "completer", self.completer.run)
            if self._subreaper:
                services.start_soon(StraySweeper().run, ctx)
            services.start_soon(systemd.keep_watchdog_fed)  # also while draining
            await services.start(watched, ctx, "listener", self.notifier.run)
            async with anyio.create_task_group() as workers_tg:
                generations.workers_tg = workers_tg
                first = await generations.start(self.config)
                await self._at_start("declaring kinds and limits",
                                     lambda: generations.declare(first))  # fmt: skip
                for service in (self.presence, LeaseKeeper()):
                    services.start_soon(watched, ctx, service.name, service.run, ctx)
                async with anyio.create_task_group() as intake:
                    self._intake = generations.intake_tg = intake
                    generations.start_producers(first)
                    promoter = Promoter()
                    intake.start_soon(watched, ctx, promoter.name, promoter.run, ctx)
                    changes, heard = anyio.create_memory_object_stream[Leadership](16)
                    self.roles = RoleRunner(
                        pool, queries=self.q, config=self.live, member_id=self.id,
                        roles=leader_roles(), changes=heard,
                    )  # fmt: skip
                    elector = Elector(self.config, self.q, self.id, changes)
                    intake.start_soon(watched, ctx, "roles", self.roles.run)
                    intake.start_soon(watched, ctx, "elector", elector.run)
                    coordinator = ReloadCoordinator(
                        reload_requests, generations, self.reload_config
                    )
                    intake.start_soon(coordinator.run, ctx)
                    services.start_soon(self._obey, orders, reloads)
                    await services.start(SignalWatcher(controls).run, ctx)
                    # Joined only now: a member in the table handles SIGTERM and SIGHUP.
                    await self._at_start("joining the fleet", lambda: self.presence.join(ctx))
                    self.ready.set()
                    queues = ", ".join(first.workers)
                    systemd.notify("READY=1", f"STATUS=serving queues {queues}")
                    log.info(
                        "member %s ready: queues %s", self.id, queues,
                        extra={"event": "member.ready", "member": self.id},
                    )  # fmt: skip
                await self._drain(generations)
                workers_tg.cancel_scope.cancel()
            generations.close_outcomes()
            self.completer.give_up_after(FINAL_FLUSH_S)
            send.close()  # the completer records what is left, then ends
            await self.presence.leave(ctx)
            services.cancel_scope.cancel()

    async def _obey(
        self, orders: MemoryObjectReceiveStream[Control], reloads: MemoryObjectSendStream[Reload]
    ) -> None:
        """Act on the signal watcher's messages for as long as it watches."""
        async for order in orders:
            if isinstance(order, Reload):
                if not self.draining:
                    with contextlib.suppress(anyio.BrokenResourceError):
                        reloads.send_nowait(order)  # (unless intake ended)
            elif isinstance(order, Drain):
                self._begin_drain(order)
            else:
                self._stop_at_once(order)

    def _begin_drain(self, order: Drain) -> None:
        self.draining = True
        systemd.notify("STOPPING=1")
        log.info(
            "%s: draining", order.signal_name,
            extra={"event": "member.draining", "member": self.id},
        )  # fmt: skip
        drain_s = self.config.daemon.drain_timeout.total_seconds()
        self._drain_deadline = anyio.current_time() + drain_s
        if self._generations is not None:
            self._generations.stop_claiming(drain_s)
        if self._intake is not None:
            self._intake.cancel_scope.cancel()

    def _stop_at_once(self, order: StopNow) -> None:
        if self._generations is not None:
            self._generations.stop_claiming(STOP_NOW_CLAIM_S)
        self._stop_now.set()

    async def _drain(self, generations: Generations) -> None:
        """Let jobs in flight finish until drain_timeout; then kill the workers still
        holding jobs, and give their jobs back."""
        deadline = self._drain_deadline
        if deadline is None:  # not drained by a signal (intake ended on its own)
            deadline = anyio.current_time() + self.config.daemon.drain_timeout.total_seconds()
        with anyio.move_on_after(deadline - anyio.current_time()):
            await first_of(generations.wait_idle, self._stop_now.wait)
        why = "stopped at once (second signal)" if self._stop_now.is_set() else (
            "still running at the end of drain_timeout"
        )  # fmt: skip
        await generations.give_back_all(why)


async def first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as one of `waits` has returned (the others are cancelled)."""
    async with anyio.create_task_group() as tg:

        async def wait(one: Callable[[], Awaitable[object]]) -> None:
            await one()
            tg.cancel_scope.cancel()

        for one in waits:
            tg.start_soon(wait, one)
