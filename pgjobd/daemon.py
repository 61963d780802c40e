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
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import asyncpg
from anyio.abc import TaskGroup, TaskStatus

from pgjobd import __version__, backoff, db, migrate, systemd
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
    return [Reaper(), PartitionRotator(), CronTicker(), Reindexer(), HorizonWatchdog()]


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
            log.info("job %d cancelled by an admin", job_id,
                     extra={"event": "job.cancel_requested", "job_id": job_id})  # fmt: skip
            held[0].cancel(job_id)

    async def run(self) -> None:
        """Serve until drained. Raises ConfigError (a handler that cannot be imported),
        SchemaError, or a database error at start-up."""
        pool = await db.create_pool(self.config, reset=skip_session_reset)
        try:
            async with pool.acquire() as conn:
                await migrate.check_schema(conn, self.config.database.schema)
            await self._serve(pool)
        finally:
            with anyio.move_on_after(5, shield=True):
                await pool.close()

    async def _serve(self, pool: asyncpg.Pool) -> None:
        send, receive = anyio.create_memory_object_stream[Outcome](OUTCOME_BUFFER)
        self._outcomes = send  # pools send through clones; closed when all are done
        self.completer = Completer(pool, self.q, self.id, dict(self.config.queues), receive)
        self.notifier = Notifier(self.config, self.config.queues)
        self.notifier.on_cancel = self.cancel_job
        async with anyio.create_task_group() as services:
            services.start_soon(self.completer.run)
            services.start_soon(systemd.keep_watchdog_fed)  # also while draining
            await services.start(self.notifier.run)
            async with anyio.create_task_group() as pools:
                self._pools_tg = pools
                first = await self._start_generation(self.config)
                await self._declare(pool, first)
                services.start_soon(self._heartbeat, pool)
                services.start_soon(self._keep_leases, pool)
                async with anyio.create_task_group() as intake:
                    self._intake = intake
                    intake.start_soon(self._run_producers, pool, first)
                    intake.start_soon(self._promote_due, pool)
                    changes, heard = anyio.create_memory_object_stream[Leadership](16)
                    self.roles = RoleRunner(
                        pool, queries=self.q, config=self.config, member_id=self.id,
                        roles=leader_roles(), changes=heard,
                    )  # fmt: skip
                    intake.start_soon(self.roles.run)
                    intake.start_soon(Elector(self.config, self.q, self.id, changes).run)
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
                name: WorkerPool(name, queue, config.daemon.handlers, self._outcomes.clone())
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
        self._intake.start_soon(self._run_producers, pool, new)
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
                log.warning("heartbeat failed: %s", e, extra={"event": "member.heartbeat_failed"})

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
                        extra={"event": "lease.lost", "job_id": job_id, "queue": job.queue},
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
