"""The leader's singleton roles: each a module with a name, an interval and an
idempotent, fenced `tick`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import asyncpg

from pgjobd.config import Config
from pgjobd.queries import Queries


@dataclass(frozen=True)
class RoleContext:
    """What a role's tick needs; `fence` goes into every role statement."""

    pool: asyncpg.Pool
    queries: Queries
    config: Config
    member_id: str
    term: int
    fence: tuple[int, int, int]  # lock key (unsigned classid, objid), leader backend pid


class Role(Protocol):
    name: ClassVar[str]

    def interval_s(self, config: Config) -> float: ...

    async def tick(self, ctx: RoleContext) -> None:
        """One unit of work; safe to repeat, and to run while a deposed leader's last
        statement is still in flight (its writes are fenced)."""
