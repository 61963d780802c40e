"""Runs the roles for as long as each leadership term lasts."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import anyio
import asyncpg
from anyio.streams.memory import MemoryObjectReceiveStream

from pgjobd import backoff, metrics
from pgjobd.config import Config
from pgjobd.errors import TRANSIENT
from pgjobd.leader import Leadership
from pgjobd.member import LiveConfig
from pgjobd.queries import Queries
from pgjobd.roles import Deposed, Role, RoleContext

log = logging.getLogger(__name__)


class RoleRunner:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        queries: Queries,
        config: Config | LiveConfig,
        member_id: str,
        roles: Sequence[Role],
        changes: MemoryObjectReceiveStream[Leadership],
    ) -> None:
        self.pool = pool
        self.q = queries
        # A member's LiveConfig: a SIGHUP reload publishes its new config there.
        self.live = config if isinstance(config, LiveConfig) else LiveConfig(config)
        self.member_id = member_id
        self.roles = roles
        self.changes = changes
        self.leading = False
        self.term = 0
        self.ticks: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    @property
    def config(self) -> Config:
        return self.live.current

    async def run(self) -> None:
        try:
            await self._follow()
        finally:
            metrics.set_leader(False, self.term)  # stopped (a drain): no longer leading

    async def _follow(self) -> None:
        async with self.changes, anyio.create_task_group() as tg:
            term_scope: anyio.CancelScope | None = None
            async for change in self.changes:
                if term_scope is not None:
                    # Roles stop before anything else happens; the term's task says
                    # when they have (roles_stopped), and only then is the lock freed.
                    term_scope.cancel()
                    term_scope = None
                elif not change.is_leader:
                    change.roles_stopped.set()  # no roles of that term run here
                self.leading, self.term = change.is_leader, change.term
                metrics.set_leader(change.is_leader, change.term)
                if change.is_leader:
                    ctx = RoleContext(self.pool, self.q, self.config, self.member_id, change.term)
                    term_scope = anyio.CancelScope()
                    tg.start_soon(self._run_term, term_scope, ctx, change.roles_stopped)

    async def _run_term(
        self, scope: anyio.CancelScope, ctx: RoleContext, stopped: anyio.Event
    ) -> None:
        try:
            with scope:
                async with anyio.create_task_group() as tg:
                    for role in self.roles:
                        tg.start_soon(self._run_role, role, ctx)
        finally:
            stopped.set()  # the elector frees the lock only now

    async def _run_role(self, role: Role, ctx: RoleContext) -> None:
        while True:
            started = time.perf_counter()
            interval_s = role.interval_s(self.config)
            try:
                # The config as of this tick: a SIGHUP reload may have changed it.
                await role.tick(dataclasses.replace(ctx, config=self.config))
                self.ticks[role.name] = self.ticks.get(role.name, 0) + 1
            except Deposed as e:
                log.info(
                    "role %s: %s; what it had begun to write was rolled back", role.name, e,
                    extra={"event": "role.deposed", "role": role.name, "term": ctx.term},
                )  # fmt: skip
            except TRANSIENT as e:
                # The database went away (a restart, a terminated session): the next tick
                # runs on a fresh connection. Not a fault of the role.
                self._count_error(role)
                interval_s = role.interval_s(self.config)
                log.warning(
                    "role %s: the database is unreachable (%s: %s); retrying in %.1f s",
                    role.name, type(e).__name__, e, interval_s,
                    extra={"event": "role.retrying", "role": role.name, "term": ctx.term,
                           "retry_in_s": round(interval_s, 3)},
                )  # fmt: skip
            except Exception:  # a role's failure never takes the member down
                self._count_error(role)
                interval_s = role.interval_s(self.config)
                log.exception(
                    "role %s failed; it runs again in %.1f s", role.name, interval_s,
                    extra={"event": "role.failed", "role": role.name, "term": ctx.term},
                )  # fmt: skip
            else:
                interval_s = role.interval_s(self.config)
            finally:
                metrics.ROLE_TICK.labels(role.name).observe(time.perf_counter() - started)
            await anyio.sleep(backoff.jittered(interval_s, 0.1))

    def _count_error(self, role: Role) -> None:
        self.errors[role.name] = self.errors.get(role.name, 0) + 1
        metrics.ROLE_ERRORS.labels(role.name).inc()
