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
from pgjobd.leader import Leadership, unsigned
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.queries import Queries
from pgjobd.roles import Role, RoleContext

log = logging.getLogger(__name__)


class RoleRunner:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        queries: Queries,
        config: Config,
        member_id: str,
        roles: Sequence[Role],
        changes: MemoryObjectReceiveStream[Leadership],
    ) -> None:
        self.pool = pool
        self.q = queries
        self.config = config
        self.member_id = member_id
        self.roles = roles
        self.changes = changes
        self.leading = False
        self.term = 0
        self.ticks: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    async def run(self) -> None:
        key = unsigned(lock_key(LEADER, self.config.database.schema))
        try:
            await self._follow(key)
        finally:
            metrics.set_leader(False, self.term)  # stopped (a drain): no longer leading

    async def _follow(self, key: tuple[int, int]) -> None:
        async with self.changes, anyio.create_task_group() as tg:
            term_scope: anyio.CancelScope | None = None
            async for change in self.changes:
                if term_scope is not None:
                    term_scope.cancel()  # roles stop before anything else happens
                    term_scope = None
                self.leading, self.term = change.is_leader, change.term
                metrics.set_leader(change.is_leader, change.term)
                if change.is_leader:
                    ctx = RoleContext(
                        self.pool, self.q, self.config, self.member_id, change.term,
                        (*key, change.backend_pid),
                    )  # fmt: skip
                    term_scope = anyio.CancelScope()
                    tg.start_soon(self._run_term, term_scope, ctx)

    async def _run_term(self, scope: anyio.CancelScope, ctx: RoleContext) -> None:
        with scope:
            async with anyio.create_task_group() as tg:
                for role in self.roles:
                    tg.start_soon(self._run_role, role, ctx)

    async def _run_role(self, role: Role, ctx: RoleContext) -> None:
        while True:
            started = time.perf_counter()
            try:
                # The config as of this tick: a SIGHUP reload may have changed it.
                await role.tick(dataclasses.replace(ctx, config=self.config))
                self.ticks[role.name] = self.ticks.get(role.name, 0) + 1
            except Exception:  # a role's failure never takes the member down
                self.errors[role.name] = self.errors.get(role.name, 0) + 1
                metrics.ROLE_ERRORS.labels(role.name).inc()
                log.exception(
                    "role %s failed; it runs again next tick", role.name,
                    extra={"event": "role.failed", "role": role.name, "term": ctx.term},
                )  # fmt: skip
            finally:
                metrics.ROLE_TICK.labels(role.name).observe(time.perf_counter() - started)
            await anyio.sleep(backoff.jittered(role.interval_s(self.config), 0.1))
