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
from collections.abc import Iterable, Mapping

import anyio
import asyncpg
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from pgjobd import __version__, backoff, db, migrate, systemd
from pgjobd.completer import Completer
from pgjobd.config import DEFAULT_QUEUE, Config, QueueConfig
from pgjobd.errors import TRANSIENT, ConfigError, PgjobdError, SchemaError
from pgjobd.leader import Elector, Leadership
from pgjobd.model import KindInfo, Outcome
from pgjobd.notifier import Notifier
from pgjobd.producer import Producer
from pgjobd.queries import Queries, for_schema
from pgjobd.roles.partitions import PartitionRotator
from pgjobd.roles.reaper import Reaper
from pgjobd.roles.runner import RoleRunner
from pgjobd.supervisor import WorkerPool

log = logging.getLogger(__name__)

OUTCOME_BUFFER = 10_000
HEARTBEAT_S = 5.0
PROMOTE_BATCH = 1000
PROMOTE_MAX_SLEEP_S = 1.0


def new_member_id() -> str:
    """Unique per process: several members may share a host (and a hostname)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Member:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.id = new_member_id()
        self.q: Queries = for_schema(config.database.schema)
        self.ready = anyio.Event()
        self.roles: RoleRunner | None = None
        self.draining = False
        self._stop_now = anyio.Event()

    async def run(self) -> None:
        """Serve until drained. Raises ConfigError (a handler that cannot be imported),
        SchemaError, or a database error at start-up."""
        pool = await db.create_pool(self.config)
        try:
            async with pool.acquire() as conn:
                await migrate.check_schema(conn, self.config.database.schema)
            await self._serve(pool)
        finally:
            with anyio.move_on_after(5, shield=True):
                await pool.close()

    async def _serve(self, pool: asyncpg.Pool) -> None:
        send, receive = anyio.create_memory_object_stream[Outcome](OUTCOME_BUFFER)
        senders = {name: send.clone() for name in self.config.queues}
        send.close()
        workers = {
            name: WorkerPool(name, queue, self.config.daemon.handlers, senders[name])
            for name, queue in self.config.queues.items()
        }
        completer = Completer(pool, self.q, self.id, self.config.queues, receive)
        notifier = Notifier(self.config, self.config.queues)
        async with anyio.create_task_group() as services:
            services.start_soon(completer.run)
            services.start_soon(systemd.keep_watchdog_fed)  # also while draining
            await services.start(notifier.run)
            async with anyio.create_task_group() as pools:
                kinds: list[KindInfo] = []
                for worker_pool in workers.values():
                    # Every pool loads the same handler directories: same kinds.
                    kinds = await pools.start(worker_pool.run)
                await self._declare(pool, kinds)
                await self._join(pool)
                services.start_soon(self._heartbeat, pool)
                services.start_soon(self._keep_leases, pool, workers, completer)
                async with anyio.create_task_group() as intake:
                    for name, worker_pool in workers.items():
                        producer = Producer(
                            name, pool=pool, queries=self.q, workers=worker_pool,
                            wakeup=notifier.wakeups[name], completer=completer,
                            member_id=self.id, lease=self.config.daemon.lease,
                        )  # fmt: skip
                        intake.start_soon(producer.run)
                    intake.start_soon(self._promote_due, pool)
                    changes, heard = anyio.create_memory_object_stream[Leadership](16)
                    self.roles = RoleRunner(
                        pool, queries=self.q, config=self.config, member_id=self.id,
                        roles=[Reaper(), PartitionRotator()], changes=heard,
                    )  # fmt: skip
                    intake.start_soon(self.roles.run)
                    intake.start_soon(Elector(self.config, self.q, self.id, changes).run)
                    intake.start_soon(self._watch_signals, intake)
                    self.ready.set()
                    systemd.notify("READY=1", f"STATUS=serving queues {', '.join(workers)}")
                    log.info(
                        "member %s ready: queues %s", self.id, ", ".join(workers),
                        extra={"event": "member.ready", "member": self.id},
                    )  # fmt: skip
                await self._drain(workers, senders, completer)
                pools.cancel_scope.cancel()
            for sender in senders.values():
                sender.close()  # the completer records what is left, then ends
            await self._leave(pool)
            services.cancel_scope.cancel()

    async def _watch_signals(self, intake: TaskGroup) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not self.draining:
                    self.draining = True
                    systemd.notify("STOPPING=1")
                    log.info(
                        "%s: draining", signal.Signals(signum).name,
                        extra={"event": "member.draining", "member": self.id},
                    )  # fmt: skip
                    intake.cancel_scope.cancel()  # also ends this task: see _drain
                else:
                    self._stop_now.set()

    async def _drain(
        self,
        workers: Mapping[str, WorkerPool],
        senders: Mapping[str, MemoryObjectSendStream[Outcome]],
        completer: Completer,
    ) -> None:
        """Let jobs in flight finish until drain_timeout; give back the rest."""
        deadline_s = self.config.daemon.drain_timeout.total_seconds()
        async with anyio.create_task_group() as tg:

            async def second_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        self._stop_now.set()

            tg.start_soon(second_signal)
            with anyio.move_on_after(deadline_s):
                while any(pool.held() for pool in workers.values()):
                    with anyio.move_on_after(0.05):
                        await self._stop_now.wait()
                    if self._stop_now.is_set():
                        break
            tg.cancel_scope.cancel()
        for name, pool in workers.items():
            for job in pool.held().values():
                completer.given_back.add(job.id)
                await senders[name].send(Outcome(job, "given_back"))

    async def _declare(self, pool: asyncpg.Pool, kinds: Iterable[KindInfo]) -> None:
        """Record each kind's effective defaults, for enqueues that name only the kind."""
        rows = []
        for info in kinds:
            queue = info.queue or DEFAULT_QUEUE
            queue_config: QueueConfig = self.config.queues.get(
                queue, self.config.queues[DEFAULT_QUEUE]
            )
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

    async def _keep_leases(
        self, pool: asyncpg.Pool, workers: Mapping[str, WorkerPool], completer: Completer
    ) -> None:
        """Renew every held lease in one statement per interval; cancel lost jobs."""
        lease = self.config.daemon.lease
        interval_s = lease.total_seconds() / 3
        while True:
            await anyio.sleep(interval_s)
            held = {job.id: (name, job) for name, p in workers.items() for job in p.held().values()}
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
            for job_id in held.keys() - {row["id"] for row in rows} - completer.given_back:
                name, _ = held[job_id]
                if job_id in workers[name].held():  # not finished meanwhile
                    log.warning(
                        "lease of job %d lost; cancelling it", job_id,
                        extra={"event": "lease.lost", "job_id": job_id, "queue": name},
                    )  # fmt: skip
                    workers[name].cancel(job_id)

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
