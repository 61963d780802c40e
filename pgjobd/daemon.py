"""`pgjobd run`: one member of the fleet.

Task layout, outermost first (each layer outlives the ones inside it, so that work in
flight can always be recorded):

  services   completer, LISTEN session, presence heartbeat, lease keeper
  workers    one WorkerPool per queue (the subprocesses)
  intake     one producer per queue, the promoter of due jobs, and the leader elector
             with the roles it runs while this member leads

SIGTERM/SIGINT drains: intake stops at once (a claim in flight still hands its jobs
over); jobs in flight get until drain_timeout; the workers still running jobs then are
killed, and only then are their jobs given back (available again, attempt not charged);
the member leaves the fleet and the process exits 0. A second signal does the same at
once. Leadership is released as the drain starts, so another member takes over at once.

The member is a child subreaper: whatever a handler starts and leaves behind ends up
its child and is killed (see supervisor.kill_strays), during the run and at exit.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskGroup, TaskStatus

from pgjobd import __version__, backoff, db, health, metrics, migrate, systemd
from pgjobd import log as pgjobd_log
from pgjobd.client import skip_session_reset
from pgjobd.completer import FINAL_FLUSH_S, Completer
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
from pgjobd.supervisor import JobKey, WorkerPool, become_subreaper, kill_strays

log = logging.getLogger(__name__)

OUTCOME_BUFFER = 10_000
HEARTBEAT_S = 5.0
PROMOTE_BATCH = 1000
PROMOTE_MAX_SLEEP_S = 1.0
STRAY_SWEEP_S = 1.0
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
    claimers: list[Producer] = field(default_factory=list)
    # Set when its producers have ended: no claim of theirs is in flight any more.
    producers_done: anyio.Event = field(default_factory=anyio.Event)

    def stop_claiming(self, within_s: float) -> None:
        """No more claims for these workers; one in flight still hands its jobs over
        (they are given back, as the pools take no more), within `within_s`."""
        for claimer in self.claimers:
            claimer.stop(within_s)
        self.producers.cancel()
        for worker_pool in self.workers.values():
            worker_pool.drain()


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
        self._drain_deadline: float | None = None
        self._subreaper = False
        self._reloading = anyio.Lock()
        # For /healthz, /readyz and the metrics read at scrape time.
        self.dead_task: str | None = None
        self.db_ok_at: float | None = None  # monotonic time of the last good round trip
        self.db_error: str | None = None
        self.loop_monitor = health.LoopMonitor()
        self.http_port: int | None = None  # bound by the metrics/health server

    def held(self) -> dict[JobKey, tuple[WorkerPool, ClaimedJob]]:
        """Every job in flight on this member by (id, fence), with the pool holding it."""
        return {
            key: (pool, job)
            for generation in self.generations
            for pool in generation.workers.values()
            for key, job in pool.held().items()
        }

    def cancel_job(self, job_id: int) -> None:
        """An admin cancelled this job: set ctx.cancelled in the worker holding it (the
        attempt's end then records it as cancelled, unless it completes)."""
        for key, (worker_pool, job) in self.held().items():
            if key[0] == job_id:
                fields = {"event": "job.cancel_requested", **self.job_fields(job)}
                log.info("job %d cancelled by an admin", job_id, extra=fields)
                worker_pool.cancel(key)

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
        self._subreaper = become_subreaper()
        pool = await db.create_pool(self.config, reset=skip_session_reset)
        try:
            async with db.acquire(pool) as conn:
                await migrate.check_schema(conn, self.config.database.schema, deep=True)
            self.db_ok_at = anyio.current_time()
            await self._serve(pool)
        finally:
            if self._subreaper:  # the workers have ended (or never started)
                await self._end_strays()
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
            if self._subreaper:
                services.start_soon(self._sweep_strays)
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
            self.completer.give_up_after(FINAL_FLUSH_S)
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
        try:
            with generation.producers:
                async with anyio.create_task_group() as tg:
                    for name, worker_pool in generation.workers.items():
                        producer = Producer(
                            name, pool=pool, queries=self.q, workers=worker_pool,
                            wakeup=self.notifier.wakeup(name), completer=self.completer,
                            member_id=self.id, lease=generation.config.daemon.lease,
                        )  # fmt: skip
                        generation.claimers.append(producer)
                        tg.start_soon(producer.run)
        finally:
            generation.producers_done.set()

    async def _watch_signals(
        self, pool: asyncpg.Pool, intake: TaskGroup, *, task_status: TaskStatus[None]
    ) -> None:
        signals_wanted = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        try:
            with anyio.open_signal_receiver(*signals_wanted) as signals:
                task_status.started()
                await self._handle_signals(signals, pool, intake)
        finally:
            if self.draining:
                # The receiver is gone but the shutdown goes on (the member leaves, the
                # pool closes): a late SIGTERM must not end it by the default action.
                for signum in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(signum, signal.SIG_IGN)

    async def _handle_signals(
        self, signals: AsyncIterator[signal.Signals], pool: asyncpg.Pool, intake: TaskGroup
    ) -> None:
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
                drain_s = self.config.daemon.drain_timeout.total_seconds()
                self._drain_deadline = anyio.current_time() + drain_s
                for generation in self.generations:
                    generation.stop_claiming(drain_s)
                intake.cancel_scope.cancel()
            else:
                for generation in self.generations:
                    generation.stop_claiming(STOP_NOW_CLAIM_S)
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
            # Claim no more into the old workers: a claim in flight hands its jobs over
            # (and they give them back), so none is stranded.
            generation.stop_claiming(self.config.daemon.lease.total_seconds())
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
        await generation.producers_done.wait()  # no claim for it in flight
        for worker_pool in generation.workers.values():
            await worker_pool.wait_idle()
        generation.pools.cancel()

    async def _drain(self) -> None:
        """Let jobs in flight finish until drain_timeout; then kill the workers still
        holding jobs, and give their jobs back."""
        deadline = self._drain_deadline
        if deadline is None:  # not drained by a signal (intake ended on its own)
            deadline = anyio.current_time() + self.config.daemon.drain_timeout.total_seconds()
        with anyio.move_on_after(deadline - anyio.current_time()):
            while self.held() and not self._stop_now.is_set():
                with anyio.move_on_after(0.05):
                    await self._stop_now.wait()
        why = "stopped at once (second signal)" if self._stop_now.is_set() else (
            "still running at the end of drain_timeout"
        )  # fmt: skip
        async with anyio.create_task_group() as tg:
            for generation in self.generations:
                for worker_pool in generation.workers.values():
                    if worker_pool.held():
                        tg.start_soon(worker_pool.give_back_all, why)

    async def _sweep_strays(self) -> None:
        """Kill what handlers left behind (orphans reparented to this subreaper)."""
        while True:
            await anyio.sleep(STRAY_SWEEP_S)
            kill_strays()

    async def _end_strays(self) -> None:
        """At exit, after the workers: nothing a handler started may outlive the member."""
        with anyio.move_on_after(5, shield=True):
            while kill_strays(spare_workers=False):  # noqa: ASYNC110 - /proc has no event
                await anyio.sleep(0.02)

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
            async with db.acquire(pool) as conn:
                await conn.execute(self.q["kind_declare_many"], *columns, self.id)

    async def _join(self, pool: asyncpg.Pool) -> None:
        async with db.acquire(pool) as conn:
            await conn.execute(self.q["partitions_ensure"], migrate.PARTITION_DAYS_AHEAD)
            await conn.execute(
                self.q["member_join"], self.id, socket.gethostname(), os.getpid(),
                __version__, list(self.config.queues),
            )  # fmt: skip
        self.db_ok_at = anyio.current_time()

    async def _leave(self, pool: asyncpg.Pool) -> None:
        with anyio.move_on_after(5, shield=True):
            try:
                async with db.acquire(pool) as conn:
                    await conn.execute(self.q["member_leave"], self.id)
            except TRANSIENT as e:
                log.warning("could not remove the member row: %s", e)

    async def _heartbeat(self, pool: asyncpg.Pool) -> None:
        while True:
            await anyio.sleep(backoff.jittered(HEARTBEAT_S, 0.1))
            try:
                async with db.acquire(pool) as conn:
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
                async with db.acquire(pool) as conn:
                    rows = await conn.fetch(
                        self.q["job_lease_renew"], self.id, [key[0] for key in held],
                        [key[1] for key in held], lease,
                    )  # fmt: skip
            except TRANSIENT as e:
                log.warning("lease renewal failed: %s", e, extra={"event": "lease.renew_failed"})
                continue
            # Rows another transaction had locked were skipped, neither renewed nor lost:
            # one locked row must not hold up the renewal of every other.
            found: set[JobKey] = set()
            for row in rows:
                key = (row["id"], row["fence"])
                found.add(key)
                if row["cancel_requested"] and key in held:  # in case NOTIFY was missed
                    held[key][0].cancel(key)
            for key in held.keys() - found:
                worker_pool, job = held[key]
                if key in worker_pool.held():  # not finished meanwhile
                    log.warning(
                        "lease of job %d lost; cancelling it", key[0],
                        extra={"event": "lease.lost", **self.job_fields(job)},
                    )  # fmt: skip
                    worker_pool.cancel(key)

    async def _promote_due(self, pool: asyncpg.Pool) -> None:
        """Make due scheduled and retryable jobs claimable; sleep until the next is due."""
        while True:
            try:
                async with db.acquire(pool) as conn:
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
