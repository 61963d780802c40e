"""Leader election on a PostgreSQL advisory lock held by a dedicated session.

States: candidate (no lock; tries again every ELECT_INTERVAL_S, jittered) → leader
(lock held; a database-issued term in the `leader` table, which fences every role
write: see sql/leader.sql) → candidate again as soon as it cannot prove, every
PING_INTERVAL_S within PING_TIMEOUT_S, that its session still holds the lock and its
term is open. Roles learn of every change in order through `changes`; a change to "not
leader" is sent before anything else happens, and the lock is freed only once the
term's roles have stopped.

The session is never from a pool: asyncpg's pool release unlocks advisory locks. Behind
a transaction-pooling proxy, point `database.leader_dsn` straight at PostgreSQL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import anyio
import asyncpg
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from pgjobd import backoff
from pgjobd.config import Config
from pgjobd.db import connect_session
from pgjobd.errors import TRANSIENT
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.queries import Queries

log = logging.getLogger(__name__)

ELECT_INTERVAL_S = 1.0
PING_INTERVAL_S = 1.0
PING_TIMEOUT_S = 1.0
# How long a resigning leader waits for its roles' statements in flight to return.
ROLES_STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Leadership:
    """A change of this member's leadership. While leading, `term` fences every role
    write. The role runner sets `roles_stopped` once the roles of a term that ended
    have all returned: the elector waits for it before it frees the lock."""

    is_leader: bool
    term: int = 0
    roles_stopped: anyio.Event = field(default_factory=anyio.Event, compare=False)


def unsigned(key: tuple[int, int]) -> tuple[int, int]:
    """The lock key as pg_locks shows it (classid, objid are unsigned oids)."""
    return key[0] & 0xFFFFFFFF, key[1] & 0xFFFFFFFF


class Elector:
    def __init__(
        self,
        config: Config,
        queries: Queries,
        member_id: str,
        changes: MemoryObjectSendStream[Leadership],
    ) -> None:
        self.config = config
        self.q = queries
        self.member_id = member_id
        self.changes = changes
        self.key = lock_key(LEADER, config.database.schema)
        self.term = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.changes:
            while True:
                try:
                    conn = await connect_session(self.config, "pgjobd leader")
                except TRANSIENT as e:
                    log.warning("leader session: cannot connect: %s", e)
                    await anyio.sleep(backoff.jittered(ELECT_INTERVAL_S * 2))
                    continue
                try:
                    await self._campaign(conn)
                except (*TRANSIENT, asyncpg.PostgresError) as e:
                    log.warning(
                        "leader session lost: %s", e, extra={"event": "leader.session_lost"}
                    )
                finally:
                    with anyio.move_on_after(2, shield=True):
                        await conn.close()  # closing the session frees the lock
                await anyio.sleep(backoff.jittered(ELECT_INTERVAL_S))

    async def _campaign(self, conn: asyncpg.Connection) -> None:
        resigned = anyio.Event()

        def on_resign(*_: object) -> None:
            resigned.set()

        # A leader that shuts down gracefully says so: take over at once, not next try.
        await conn.add_listener(f"{self.config.database.schema}.leader", on_resign)
        while True:  # a candidate: try, and keep the session warm meanwhile
            if await self.q.leader_try_lock(conn, *self.key):
                break
            with anyio.move_on_after(backoff.jittered(ELECT_INTERVAL_S)):
                await resigned.wait()
            resigned = anyio.Event()
        self.term = await self.q.leader_term_begin(conn, self.member_id)
        log.info(
            "leader for term %d", self.term,
            extra={"event": "leader.gained", "term": self.term, "member": self.member_id},
        )  # fmt: skip
        ended = Leadership(False, self.term)
        await self.changes.send(Leadership(True, self.term, ended.roles_stopped))
        try:
            while True:
                await anyio.sleep(PING_INTERVAL_S)
                with anyio.fail_after(PING_TIMEOUT_S):
                    holds = await self.q.leader_still_holds(conn, *unsigned(self.key), self.term)
                if not holds:
                    raise asyncpg.InterfaceError(
                        "the advisory lock is no longer held, or the term was ended"
                    )
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.changes.send(ended)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    ended.roles_stopped.set()  # the runner has ended, its roles first
                log.info(
                    "no longer leader (term %d)", self.term,
                    extra={"event": "leader.lost", "term": self.term},
                )  # fmt: skip
                # Free the lock only once no role statement of this term is in flight.
                with anyio.move_on_after(ROLES_STOP_TIMEOUT_S) as waited:
                    await ended.roles_stopped.wait()
                if waited.cancelled_caught:
                    log.warning(
                        "the roles of term %d did not stop within %.0f s; resigning anyway "
                        "(their writes are fenced on the term)", self.term,
                        ROLES_STOP_TIMEOUT_S, extra={"event": "leader.roles_slow_to_stop"},
                    )  # fmt: skip
                with anyio.move_on_after(2):
                    try:
                        await self.q.leader_resign(conn, self.term, *self.key)
                    except (*TRANSIENT, asyncpg.PostgresError):
                        pass  # the session is gone, and the lock with it
