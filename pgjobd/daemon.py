"""`pgjobd run`: one member of the fleet.

Task layout, outermost first (each layer outlives the ones inside it, so that work in
flight can always be recorded):

  services   completer, LISTEN session, presence heartbeat, lease keeper
  workers    one WorkerPool per queue (the subprocesses)
  intake     one producer per queue, the promoter of due jobs, and the leader elector
             with the roles it runs while this member leads

SIGTERM/SIGINT drains: intake stops at once; jobs in flight get until drain_timeout;
what is still running then is given back (available again, attempt not charged); the
member leaves the fleet and the process exits 0. A second signal gives back at once.
Leadership is released as the drain starts, so another member takes over at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskGroup, TaskStatus

from pgjobd import __version__, backoff, db, health, metrics, migrate, systemd
from pgjobd import log as pgjobd_log
from pgjobd.client import skip_session_reset
from pgjobd.completer import Completer
from pgjobd.config import DEFAULT_QUEUE, Config, QueueConfig
from pgjobd.errors import TRANSIENT, ConfigError, PgjobdError, SchemaError
from pgjobd.leader import Elector, Leadership
from pgjobd.model import ClaimedJob, KindInfo, Outcome
from pgjobd.notifier import Notifier
from pgjobd.producer import Producer
from pgjobd.queries import Queries, for_schema
from pgjobd.roles import Role
from pgjobd.roles.cron import CronTicker
from pgjobd.roles.horizon import HorizonWatchdog
from pgjobd.roles.partitions import PartitionRotator
from pgjobd.roles.queue_stats import QueueStats
from pgjobd.roles.reaper import Reaper
from pgjobd.roles.reindexer import Reindexer
from pgjobd.roles.runner import RoleRunner
from pgjobd.supervisor import WorkerPool

log = logging.getLogger(__name__)

OUTCOME_BUFFER = 10_000
HEARTBEAT_S = 5.0
PROMOTE_BATCH = 1000
PROMOTE_MAX_SLEEP_S = 1.0


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
    ]


def new_member_id() -> str:
    """Unique per process: several members may share a host (and a hostname)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(eq=False)
class Generation:
    """The worker pools (and their producers) started for one version of the config.
    A reload starts a new generation; the old one stops claiming, finishes the jobs it
    holds, and goes."""

    number: int
    config: Config
    workers: dict[str, WorkerPool]
    kinds: list[KindInfo] = field(default_factory=list)
    producers: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    pools: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class Member:
    def __init__(self, config: Config, reload_config: Callable[[], Config] | None = None) -> None:
        self.config = config
        self.reload_config = reload_config
        self.id = new_member_id()
        self.q: Queries = for_schema(config.database.schema)
        self.ready = anyio.Event()
        self.roles: RoleRunner | None = None
        self.draining = False
        self.generations: list[Generation] = []
        self._stop_now = anyio.Event()
        self._reloading = anyio.Lock()
        # For /healthz, /readyz and the metrics read at scrape time.
        self.dead_task: str | None = None
        self.db_ok_at: float | None = None  # monotonic time of the last good round trip
        self.db_error: str | None = None
        self.loop_monitor = health.LoopMonitor()
        self.http_port: int | None = None  # bound by the metrics/health server

    def held(self) -> dict[int, tuple[WorkerPool, ClaimedJob]]:
        """Every job in flight on this member, with the pool that holds it."""
        return {
            job_id: (pool, job)
            for generation in self.generations
            for pool in generation.workers.values()
            for job_id, job in pool.held().items()
        }

    def cancel_job(self, job_id: int) -> None:
        """An admin cancelled this job: set ctx.cancelled in the worker holding it (the
        attempt's end then records it as cancelled, unless it completes)."""
        held = self.held().get(job_id)
        if held is not None:
            fields = {"event": "job.cancel_requested", **self.job_fields(held[1])}
            log.info("job %d cancelled by an admin", job_id, extra=fields)
            held[0].cancel(job_id)

    def job_fields(self, job: ClaimedJob) -> dict[str, object]:
        """The fields every log line about a job carries."""
        return {"job_id": job.id, "kind": job.kind, "queue": job.queue,
                "attempt": job.attempt, "member": self.id}  # fmt: skip

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
        pool = await db.create_pool(self.config, reset=skip_session_reset)
        try:
            async with pool.acquire() as conn:
                await migrate.check_schema(conn, self.config.database.schema, deep=True)
            self.db_ok_at = anyio.current_time()
            await self._serve(pool)
        finally:
            with anyio.move_on_after(5, shield=True):
                await pool.close()

    def health_checks(self) -> health.Checks:
        now = anyio.current_time()
        # (completer and notifier exist once the database has been reached)
        notifier: Notifier | None = getattr(self, "notifier", None)
        completer: Completer | None = getattr(self, "completer", None)
        return health.Checks(
            started=self.ready.is_set(),
            draining=self.draining,
            dead_task=self.dead_task,
            db_ok_age_s=None if self.db_ok_at is None else now - self.db_ok_at,
            db_error=self.db_error,
            listener_healthy=notifier is not None and notifier.healthy,
            recording=completer is None or completer.accepting,
            failed_queues={
                name: worker_pool.failed
                for name, worker_pool in self._current_pools().items()
                if worker_pool.failed is not None
            },
            loop_lag_s=self.loop_monitor.lag_s,
        )

    def member_state(self) -> metrics.MemberState:
        in_flight: dict[str, int] = {}
        for _, job in self.held().values():
            in_flight[job.queue] = in_flight.get(job.queue, 0) + 1
        workers: dict[str, int] = {}
        for generation in self.generations:
            for name, worker_pool in generation.workers.items():
                in_flight.setdefault(name, 0)
                workers[name] = workers.get(name, 0) + worker_pool.live_processes()
        checks = self.health_checks()
        return metrics.MemberState(
            in_flight=in_flight,
            workers=workers,
            failed_queues=set(checks.failed_queues),
            ready=not health.ready_problems(checks),
            draining=self.draining,
            event_loop_lag_s=self.loop_monitor.lag_s,
        )

    def _current_pools(self) -> dict[str, WorkerPool]:
        """The newest generation's pools (older ones only finish what they hold)."""
        return self.generations[-1].workers if self.generations else {}

    async def _watched(
        self, name: str, run: Callable[..., Awaitable[None]], *args: Any,
        task_status: TaskStatus[Any] = anyio.TASK_STATUS_IGNORED,
    ) -> None:  # fmt: skip
        """Run a core task; if it dies, say so (/healthz, /readyz) while the member
        goes down with it."""
        try:
            if task_status is anyio.TASK_STATUS_IGNORED:
                await run(*args)
            else:
                await run(*args, task_status=task_status)
        except Exception as e:
            self.dead_task = f"{name}: {e!r}"
            log.critical(
                "core task %s died: %r", name, e,
                extra={"event": "member.task_died", "task": name, "member": self.id},
            )  # fmt: skip
            raise

    async def _serve(self, pool: asyncpg.Pool) -> None:
        send, receive = anyio.create_memory_object_stream[Outcome](OUTCOME_BUFFER)
        self._outcomes = send  # pools send through clones; closed when all are done
        self.completer = Completer(pool, self.q, self.id, dict(self.config.queues), receive)
        self.notifier = Notifier(self.config, self.config.queues)
        self.notifier.on_cancel = self.cancel_job
        async with anyio.create_task_group() as services:
            services.start_soon(self._watched, "completer", self.completer.run)
            services.start_soon(systemd.keep_watchdog_fed)  # also while draining
            await services.start(self._watched, "listener", self.notifier.run)
            async with anyio.create_task_group() as pools:
                self._pools_tg = pools
                first = await self._start_generation(self.config)
                await self._declare(pool, first)
                services.start_soon(self._watched, "heartbeat", self._heartbeat, pool)
                services.start_soon(self._watched, "lease keeper", self._keep_leases, pool)
                async with anyio.create_task_group() as intake:
                    self._intake = intake
                    intake.start_soon(self._watched, "producers", self._run_producers, pool, first)
                    intake.start_soon(self._watched, "promoter", self._promote_due, pool)
                    changes, heard = anyio.create_memory_object_stream[Leadership](16)
                    self.roles = RoleRunner(
                        pool, queries=self.q, config=self.config, member_id=self.id,
                        roles=leader_roles(), changes=heard,
                    )  # fmt: skip
                    elector = Elector(self.config, self.q, self.id, changes)
                    intake.start_soon(self._watched, "roles", self.roles.run)
                    intake.start_soon(self._watched, "elector", elector.run)
                    await services.start(self._watch_signals, pool, intake)
                    # Joined only now: a member in the table handles SIGTERM and SIGHUP.
                    await self._join(pool)
                    self.ready.set()
                    queues = ", ".join(first.workers)
                    systemd.notify("READY=1", f"STATUS=serving queues {queues}")
                    log.info(
                        "member %s ready: queues %s", self.id, queues,
                        extra={"event": "member.ready", "member": self.id},
                    )  # fmt: skip
                await self._drain()
                pools.cancel_scope.cancel()
            for generation in self.generations:
                for worker_pool in generation.workers.values():
                    worker_pool.outcomes.close()
            send.close()  # the completer records what is left, then ends
            await self._leave(pool)
            services.cancel_scope.cancel()

    async def _start_generation(self, config: Config) -> Generation:
        """Boot worker pools for `config`: new processes import the handler code afresh.
        ConfigError if a handler module does not import (the pools started are stopped)."""
        generation = Generation(
            len(self.generations) + 1, config,
            {
                name: WorkerPool(
                    name, queue, config.daemon.handlers, self._outcomes.clone(),
                    env=pgjobd_log.worker_env(
                        config.daemon.log_format, config.daemon.log_level, self.id
                    ),
                )
                for name, queue in config.queues.items()
            },
        )  # fmt: skip
        try:
            generation.kinds = await self._pools_tg.start(self._run_pools, generation)
        except BaseExceptionGroup as group:
            raise most_telling(group) from None
        self.generations.append(generation)
        return generation

    async def _run_pools(
        self, generation: Generation, *, task_status: TaskStatus[list[KindInfo]]
    ) -> None:
        with generation.pools:
            async with anyio.create_task_group() as tg:
                kinds: list[KindInfo] = []
                for worker_pool in generation.workers.values():
                    # Every pool loads the same handler directories: the same kinds.
                    kinds = await tg.start(worker_pool.run)
                task_status.started(kinds)
        if generation in self.generations:
            self.generations.remove(generation)

    async def _run_producers(self, pool: asyncpg.Pool, generation: Generation) -> None:
        with generation.producers:
            async with anyio.create_task_group() as tg:
                for name, worker_pool in generation.workers.items():
                    producer = Producer(
                        name, pool=pool, queries=self.q, workers=worker_pool,
                        wakeup=self.notifier.wakeup(name), completer=self.completer,
                        member_id=self.id, lease=generation.config.daemon.lease,
                    )  # fmt: skip
                    tg.start_soon(producer.run)

    async def _watch_signals(
        self, pool: asyncpg.Pool, intake: TaskGroup, *, task_status: TaskStatus[None]
    ) -> None:
        signals_wanted = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        with anyio.open_signal_receiver(*signals_wanted) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    if not self.draining:
                        intake.start_soon(self.reload, pool)
                    continue
                elif not self.draining:
                    self.draining = True
                    systemd.notify("STOPPING=1")
                    log.info(
                        "%s: draining", signal.Signals(signum).name,
                        extra={"event": "member.draining", "member": self.id},
                    )  # fmt: skip
                    intake.cancel_scope.cancel()
                else:
                    self._stop_now.set()  # one receiver all along: no gap for a default

    async def reload(self, pool: asyncpg.Pool) -> None:
        """SIGHUP: read the config and handler directories again and start a new
        generation of workers on them; the old one stops claiming, finishes what it
        holds, and exits. A config or handler module that fails keeps the old one."""
        async with self._reloading:
            systemd.notify("RELOADING=1")
            try:
                await self._reload(pool)
            finally:
                systemd.notify("READY=1")

    async def _reload(self, pool: asyncpg.Pool) -> None:
        if self.reload_config is None:
            log.warning("SIGHUP: nothing to reload from")
            return
        try:
            config = self.reload_config()
            if (config.dsn, config.database) != (self.config.dsn, self.config.database):
                raise ConfigError("[database] settings change only with a restart")
            new = await self._start_generation(config)
        except ConfigError as e:
            log.error(
                "SIGHUP: reload rejected, the current configuration keeps running: %s", e,
                extra={"event": "member.reload_rejected"},
            )  # fmt: skip
            return
        old = [g for g in self.generations if g is not new]
        for generation in old:
            generation.producers.cancel()  # claim no more into the old workers
        self.config = config
        self.completer.queues.update(config.queues)
        if self.roles is not None:
            self.roles.config = config
        await self._declare(pool, new)
        self._intake.start_soon(self._watched, "producers", self._run_producers, pool, new)
        for generation in old:
            self._pools_tg.start_soon(self._retire, generation)
        log.info(
            "SIGHUP: reloaded; generation %d serves queues %s", new.number,
            ", ".join(new.workers),
            extra={"event": "member.reloaded", "generation": new.number},
        )  # fmt: skip

    async def _retire(self, generation: Generation) -> None:
        """Let an old generation finish the jobs it holds, then stop its workers."""
        for worker_pool in generation.workers.values():
            await worker_pool.wait_idle()
        generation.pools.cancel()

    async def _drain(self) -> None:
        """Let jobs in flight finish until drain_timeout; give back the rest."""
        deadline_s = self.config.daemon.drain_timeout.total_seconds()
        with anyio.move_on_after(deadline_s):
            while self.held() and not self._stop_now.is_set():
                with anyio.move_on_after(0.05):
                    await self._stop_now.wait()
        for job_id, (worker_pool, job) in self.held().items():
            self.completer.given_back.add(job_id)
            await worker_pool.outcomes.send(Outcome(job, "given_back"))

    async def _declare(self, pool: asyncpg.Pool, generation: Generation) -> None:
        """Record each kind's effective defaults, for enqueues that name only the kind."""
        rows = []
        queues = generation.config.queues
        for info in generation.kinds:
            queue = info.queue or DEFAULT_QUEUE
            queue_config: QueueConfig = queues.get(queue, queues[DEFAULT_QUEUE])
            rows.append((
                info.kind, queue, info.priority or 0,
                info.max_attempts or queue_config.max_attempts,
                info.timeout_s or queue_config.timeout.total_seconds(),
            ))  # fmt: skip
        if rows:
            columns = [list(c) for c in zip(*rows, strict=True)]
            async with pool.acquire() as conn:
                await conn.execute(self.q["kind_declare_many"], *columns, self.id)

    async def _join(self, pool: asyncpg.Pool) -> None:
        async with pool.acquire() as conn:
            await conn.execute(self.q["partitions_ensure"], migrate.PARTITION_DAYS_AHEAD)
            await conn.execute(
                self.q["member_join"], self.id, socket.gethostname(), os.getpid(),
                __version__, list(self.config.queues),
            )  # fmt: skip
        self.db_ok_at = anyio.current_time()

    async def _leave(self, pool: asyncpg.Pool) -> None:
        with anyio.move_on_after(5, shield=True):
            try:
                async with pool.acquire() as conn:
                    await conn.execute(self.q["member_leave"], self.id)
            except TRANSIENT as e:
                log.warning("could not remove the member row: %s", e)

    async def _heartbeat(self, pool: asyncpg.Pool) -> None:
        while True:
            await anyio.sleep(backoff.jittered(HEARTBEAT_S, 0.1))
            try:
                async with pool.acquire() as conn:
                    alive = await conn.fetchval(
                        self.q["member_heartbeat"], self.id, list(self.config.queues)
                    )
                if not alive:
                    await self._join(pool)
            except TRANSIENT as e:
                self.db_error = f"heartbeat failed: {e}"
                log.warning("heartbeat failed: %s", e, extra={"event": "member.heartbeat_failed"})
            else:
                self.db_ok_at, self.db_error = anyio.current_time(), None

    async def _keep_leases(self, pool: asyncpg.Pool) -> None:
        """Renew every held lease in one statement per interval; cancel lost jobs."""
        while True:
            lease = self.config.daemon.lease
            await anyio.sleep(lease.total_seconds() / 3)
            held = self.held()
            if not held:
                continue
            try:
                async with pool.acquire() as conn:
                    rows = await conn.fetch(
                        self.q["job_lease_renew"], self.id, list(held),
                        [job.fence for _, job in held.values()], lease,
                    )  # fmt: skip
            except TRANSIENT as e:
                log.warning("lease renewal failed: %s", e, extra={"event": "lease.renew_failed"})
                continue
            for row in rows:
                if row["cancel_requested"]:  # in case the job_cancel NOTIFY was missed
                    held[row["id"]][0].cancel(row["id"])
            lost = held.keys() - {row["id"] for row in rows} - self.completer.given_back
            for job_id in lost:
                worker_pool, job = held[job_id]
                if job_id in worker_pool.held():  # not finished meanwhile
                    log.warning(
                        "lease of job %d lost; cancelling it", job_id,
                        extra={"event": "lease.lost", **self.job_fields(job)},
                    )  # fmt: skip
                    worker_pool.cancel(job_id)

    async def _promote_due(self, pool: asyncpg.Pool) -> None:
        """Make due scheduled and retryable jobs claimable; sleep until the next is due."""
        while True:
            try:
                async with pool.acquire() as conn:
                    row = await conn.fetchrow(self.q["job_promote_due"], PROMOTE_BATCH)
            except TRANSIENT as e:
                log.warning("promoting due jobs failed: %s", e)
                await anyio.sleep(backoff.jittered(PROMOTE_MAX_SLEEP_S))
                continue
            if row["promoted"] >= PROMOTE_BATCH:
                continue
            next_due_s = row["next_due_in_s"]
            sleep_s = PROMOTE_MAX_SLEEP_S if next_due_s is None else next_due_s
            await anyio.sleep(min(max(sleep_s, 0.005), PROMOTE_MAX_SLEEP_S))


def most_telling(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to report from a task group's failures: a configuration error first
    (it decides the exit status), then the first other one."""
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        else:
            leaves.append(error)

    collect(group)
    for wanted in (ConfigError, SchemaError, PgjobdError):
        for leaf in leaves:
            if isinstance(leaf, wanted):
                return leaf
    return leaves[0]
