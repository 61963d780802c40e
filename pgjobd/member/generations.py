"""The member's workers: one generation of queue workers (and their producers) per
version of the config. A reload starts a new generation; the old one stops claiming,
finishes the jobs it holds, and goes."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import anyio
import asyncpg
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from pgjobd import db
from pgjobd import log as pgjobd_log
from pgjobd.completer import Completer
from pgjobd.config import DEFAULT_QUEUE, Config, QueueConfig
from pgjobd.errors import ConfigError, PgjobdError, SchemaError
from pgjobd.flow import BREAKER_COOLDOWN_S, RateLimit, parse_circuit_breaker, parse_rate_limit
from pgjobd.member import HeldJobs, MemberContext, watched
from pgjobd.model import KindInfo, Outcome
from pgjobd.notifier import Notifier
from pgjobd.producer import Producer
from pgjobd.queries import Queries
from pgjobd.statements.member import KindDeclared, QueueLimits
from pgjobd.supervisor import QueueWorkers

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Generation:
    """The queue workers (and their producers) started for one version of the config."""

    number: int
    config: Config
    workers: dict[str, QueueWorkers]
    kinds: list[KindInfo] = field(default_factory=list)
    producers: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    worker_scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    claimers: list[Producer] = field(default_factory=list)
    # Set when its producers have ended: no claim of theirs is in flight any more.
    producers_done: anyio.Event = field(default_factory=anyio.Event)

    def stop_claiming(self, within_s: float) -> None:
        """No more claims for these workers; one in flight still hands its jobs over
        (they are given back, as the queue workers take no more), within `within_s`."""
        for claimer in self.claimers:
            claimer.stop(within_s)
        self.producers.cancel()
        for queue_workers in self.workers.values():
            queue_workers.drain()


class Generations:
    """Every generation still running on this member, oldest first.

    The supervisor hands over the scopes they run in: `workers_tg` (the queue workers,
    which outlive intake) and `intake_tg` (the producers)."""

    def __init__(
        self,
        ctx: MemberContext,
        outcomes: MemoryObjectSendStream[Outcome],
        completer: Completer,
        notifier: Notifier,
    ) -> None:
        self.ctx = ctx
        self.outcomes = outcomes  # each QueueWorkers sends through a clone
        self.completer = completer
        self.notifier = notifier
        self.running: list[Generation] = []
        self.workers_tg: TaskGroup | None = None
        self.intake_tg: TaskGroup | None = None

    def held(self) -> HeldJobs:
        return {
            key: (queue_workers, job)
            for generation in self.running
            for queue_workers in generation.workers.values()
            for key, job in queue_workers.held().items()
        }

    def current_workers(self) -> dict[str, QueueWorkers]:
        """The newest generation's queue workers (older ones only finish what they hold)."""
        return self.running[-1].workers if self.running else {}

    def all_workers(self) -> list[QueueWorkers]:
        return [w for generation in self.running for w in generation.workers.values()]

    def stop_claiming(self, within_s: float) -> None:
        for generation in self.running:
            generation.stop_claiming(within_s)

    async def wait_idle(self) -> None:
        """Return when no job is in flight in any generation."""
        while self.held():
            for queue_workers in self.all_workers():
                await queue_workers.wait_idle()

    async def give_back_all(self, why: str) -> None:
        """Kill the workers holding jobs, then give their jobs back (see QueueWorkers)."""
        async with anyio.create_task_group() as tg:
            for queue_workers in self.all_workers():
                if queue_workers.held():
                    tg.start_soon(queue_workers.give_back_all, why)

    def close_outcomes(self) -> None:
        for queue_workers in self.all_workers():
            queue_workers.outcomes.close()

    async def start(self, config: Config) -> Generation:
        """Boot queue workers for `config`: new processes import the handler code afresh.
        ConfigError if a handler module does not import (the queue workers started are stopped)."""
        assert self.workers_tg is not None, "no scope for the queue workers yet"
        member_id = self.ctx.member_id
        generation = Generation(
            len(self.running) + 1, config,
            {
                name: QueueWorkers(
                    name, queue, config.daemon.handlers, self.outcomes.clone(),
                    env=pgjobd_log.worker_env(
                        config.daemon.log_format, config.daemon.log_level, member_id
                    ),
                    results_source=self._read_results,
                    middleware=config.daemon.middleware,
                )
                for name, queue in config.queues.items()
            },
        )  # fmt: skip
        try:
            generation.kinds = await self.workers_tg.start(self._run_workers, generation)
        except BaseExceptionGroup as group:
            raise most_telling(group) from None
        self.running.append(generation)
        return generation

    async def _read_results(self, ids: list[int]) -> bytes | None:
        """The results of jobs `ids` as JSON text {"id": result} (ctx.results())."""
        async with db.acquire(self.ctx.pool) as conn:
            text = await self.ctx.queries.job_results(conn, ids)
        return None if text is None else text.encode()

    def start_producers(self, generation: Generation) -> None:
        assert self.intake_tg is not None, "no scope for the producers yet"
        self.intake_tg.start_soon(watched, self.ctx, "producers", self._run_producers, generation)

    def retire(self, generation: Generation) -> None:
        """Let an old generation finish the jobs it holds, then stop its workers."""
        assert self.workers_tg is not None
        self.workers_tg.start_soon(self._retire, generation)

    async def declare(self, generation: Generation) -> None:
        """Record each kind's effective defaults and limits (for enqueues that name only
        the kind, and for every claim), and this config's queue limits fleet-wide."""
        await declare_kinds(
            self.ctx.pool, self.ctx.queries, generation.kinds, generation.config.queues,
            self.ctx.member_id,
        )  # fmt: skip
        async with db.acquire(self.ctx.pool) as conn:
            await write_queue_limits(
                conn, self.ctx.queries, generation.config.queues, self.ctx.member_id,
                tenants=generation.config.tenants,
            )  # fmt: skip

    async def _run_workers(
        self, generation: Generation, *, task_status: TaskStatus[list[KindInfo]]
    ) -> None:
        with generation.worker_scope:
            async with anyio.create_task_group() as tg:
                kinds: list[KindInfo] = []
                for queue_workers in generation.workers.values():
                    # Every queue's workers load the same handler directories: the same kinds.
                    kinds = await tg.start(queue_workers.run)
                task_status.started(kinds)
        if generation in self.running:
            self.running.remove(generation)

    async def _run_producers(self, generation: Generation) -> None:
        try:
            with generation.producers:
                async with anyio.create_task_group() as tg:
                    for name, queue_workers in generation.workers.items():
                        producer = Producer(
                            name, pool=self.ctx.pool, queries=self.ctx.queries,
                            workers=queue_workers, wakeup=self.notifier.wakeup(name),
                            completer=self.completer, member_id=self.ctx.member_id,
                            lease=generation.config.daemon.lease,
                        )  # fmt: skip
                        generation.claimers.append(producer)
                        tg.start_soon(producer.run)
        finally:
            generation.producers_done.set()

    async def _retire(self, generation: Generation) -> None:
        await generation.producers_done.wait()  # no claim for it in flight
        for queue_workers in generation.workers.values():
            await queue_workers.wait_idle()
        generation.worker_scope.cancel()


async def write_queue_limits(
    conn: asyncpg.Connection,
    queries: Queries,
    queues: Mapping[str, QueueConfig],
    member_id: str,
    *,
    tenants: Mapping[str, int] | None = None,
) -> None:
    """Write these queues' fleet-wide limits and, when this config has a [tenants] table
    or a fair queue, its tenants' weights (the last member to start or reload wins), log
    where that overrode another member's, and recount a max_depth's estimate."""
    names = sorted(queues)
    rates = [queues[name].rate for name in names]
    limits = [
        QueueLimits(name, queues[name].global_concurrency, rate and rate.starts,
                    rate and rate.window, queues[name].max_depth,
                    queues[name].tenant_concurrency, queues[name].fair)
        for name, rate in zip(names, rates, strict=True)
    ]  # fmt: skip
    async with conn.transaction():
        overridden = await queries.queue_limits_write(conn, limits, member_id)
        weights_overridden = []
        if tenants is not None or any(queues[name].fair for name in names):
            weights = dict(tenants or {})
            weights_overridden = await queries.tenant_weights_write(
                conn, sorted(weights), [weights[t] for t in sorted(weights)], member_id
            )
    for row in overridden:
        name = row.name
        before = _limits_text(
            row.global_concurrency, starts=row.rate_limit, window=row.rate_window,
            max_depth=row.max_depth, tenant_concurrency=row.tenant_concurrency, fair=row.fair,
        )  # fmt: skip
        config = queues[name]
        now = _limits_text(
            config.global_concurrency, starts=config.rate and config.rate.starts,
            window=config.rate and config.rate.window, max_depth=config.max_depth,
            tenant_concurrency=config.tenant_concurrency, fair=config.fair,
        )  # fmt: skip
        log.warning(
            "queue %s: this member's limits (%s) replace those member %s wrote (%s); "
            "the last member to start or reload wins fleet-wide", name, now,
            row.limits_by, before,
            extra={"event": "flow.limits_disagree", "queue": name,
                   "other_member": row.limits_by, "limits": now, "previous": before},
        )  # fmt: skip
    for weight in weights_overridden:
        mine = (tenants or {}).get(weight.tenant)
        now = "unlisted (1)" if mine is None else str(mine)
        log.warning(
            "tenant %r: this member's weight (%s) replaces the weight %s member %s wrote; "
            "the last member to start or reload wins fleet-wide", weight.tenant, now,
            weight.weight, weight.weights_by,
            extra={"event": "flow.weights_disagree", "tenant": weight.tenant,
                   "other_member": weight.weights_by, "weight": mine,
                   "previous": weight.weight},
        )  # fmt: skip
    if any(queues[name].max_depth is not None for name in names):
        await queries.queue_depth_recount(conn, names)


def _limits_text(
    global_concurrency: int | None,
    *,
    starts: int | None,
    window: timedelta | None,
    max_depth: int | None,
    tenant_concurrency: int | None,
    fair: bool,
) -> str:
    rate = None if starts is None or window is None else str(RateLimit(starts, window))
    return (
        f"global_concurrency={global_concurrency}, rate_limit={rate}, max_depth={max_depth}, "
        f"tenant_concurrency={tenant_concurrency}, fair={'true' if fair else 'false'}"
    )


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


async def declare_kinds(
    pool: asyncpg.Pool,
    queries: Queries,
    kinds: Sequence[KindInfo],
    queues: Mapping[str, QueueConfig],
    member_id: str,
) -> None:
    """Record each kind's effective defaults (its own, else its queue's), as a member
    does for its handlers' kinds when its workers start."""
    rows = []
    for info in kinds:
        queue = info.queue or DEFAULT_QUEUE
        queue_config: QueueConfig = queues.get(queue, queues[DEFAULT_QUEUE])
        rate = None if info.rate_limit is None else parse_rate_limit(info.rate_limit)
        breaker, cooldown = None, None
        if info.circuit_breaker is not None:
            breaker = parse_circuit_breaker(info.circuit_breaker)
            cooldown = timedelta(seconds=info.breaker_cooldown_s or BREAKER_COOLDOWN_S)
        rows.append(KindDeclared(
            info.kind, queue, info.priority or 0,
            info.max_attempts or queue_config.max_attempts,
            info.timeout_s or queue_config.timeout.total_seconds(),
            info.global_concurrency, rate and rate.starts, rate and rate.window,
            json.dumps(list(info.redact)),
            breaker and breaker.starts, breaker and breaker.window, cooldown,
        ))  # fmt: skip
    if rows:
        async with db.acquire(pool) as conn:
            await queries.kind_declare_many(conn, rows, member_id)
