"""Login roles for the least-privilege tests: DSNs that log in as them, clean-up, and
work for the leader's DDL to do as one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from pgjobd import migrate

LOGIN_GROUPS = ("producer", "readonly", "admin", "worker")


def login_dsn(dsn: str, user: str) -> str:
    """`dsn` with another user (the test servers trust every local login)."""
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


async def create_logins(conn: asyncpg.Connection, schema: str) -> dict[str, str]:
    """One login role per group role of `schema` (made by `migrate --roles`), holding
    only that group: {"producer": <login>, "readonly": ..., "admin": ..., "worker": ...}."""
    made = {group: f"{schema}_{group}_login" for group in LOGIN_GROUPS}
    for group, login in made.items():
        await conn.execute(f"CREATE ROLE {login} LOGIN")
        await conn.execute(f"GRANT {schema}_{group} TO {login}")
    return made


async def drop_roles(conn: asyncpg.Connection, schema: str) -> None:
    """Drop the schema, then the logins of `create_logins` and the group roles."""
    await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    logins = (f"{schema}_{group}_login" for group in LOGIN_GROUPS)
    for role in (*logins, *(f"{schema}_{r}" for r in migrate.ROLE_SUFFIXES)):
        await conn.execute(f"DROP ROLE IF EXISTS {role}")


LEFTOVER_INDEX = "job_claim_idx_ccnew"


async def make_maintenance_work(conn: asyncpg.Connection, schema: str) -> list[str]:
    """What the leader's DDL has to do as the worker: expired history and attempt
    partitions (returned, by name), and the invalid copy an interrupted REINDEX
    CONCURRENTLY leaves (LEFTOVER_INDEX). Renews the roles, which re-owns the new
    partitions as `migrate --roles` would."""
    old_day = (datetime.now(UTC) - timedelta(days=40)).date()
    expired = [f"{parent}_p{old_day:%Y%m%d}" for parent in ("job_history", "job_attempt")]
    for name in expired:
        await conn.execute(
            f"CREATE TABLE {schema}.{name} PARTITION OF {schema}.{name.rsplit('_p', 1)[0]} "
            f"FOR VALUES FROM ('{old_day} 00:00+00') TO ('{old_day + timedelta(days=1)} 00:00+00')"
        )
    await migrate.migrate(conn, schema)
    await conn.execute(
        f"CREATE INDEX {LEFTOVER_INDEX} ON {schema}.job (queue) WHERE state = 'available'"
    )
    await mark_invalid(conn, schema, LEFTOVER_INDEX)
    return expired


async def mark_invalid(conn: asyncpg.Connection, schema: str, index: str) -> None:
    await conn.execute(
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = $1::regclass",
        f"{schema}.{index}",
    )
