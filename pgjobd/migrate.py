"""Forward-only schema migrations: versioned SQL files applied in order.

Each migration runs in its own transaction and is recorded in ``<schema>.migration``;
the whole run holds an advisory lock derived from the schema name, so `pgjobd migrate`
may run from several hosts at once and leaves one correct schema.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

from pgjobd import sql_text
from pgjobd.errors import SchemaError
from pgjobd.lock_keys import MIGRATE, lock_key

_FILE_NAME = re.compile(r"(\d{4})_(\w+)\.sql")
# Daily history/attempt partitions that exist ahead of time after every migrate.
PARTITION_DAYS_AHEAD = 7

_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS {{schema}};
CREATE TABLE IF NOT EXISTS {{schema}}.migration (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    checksum    text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str  # with the schema token unrendered

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]


def available() -> list[Migration]:
    """The migrations shipped with this package, in version order."""
    found = []
    for entry in resources.files("pgjobd").joinpath("sql", "migrations").iterdir():
        match = _FILE_NAME.fullmatch(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migration files are not numbered 1..n: {versions}")
    return found


def code_version() -> int:
    return available()[-1].version


async def applied_versions(conn: asyncpg.Connection, schema: str) -> dict[int, str]:
    """Version → checksum of each applied migration; empty if the schema is new."""
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{schema}.migration")
    if not exists:
        return {}
    rows = await conn.fetch(
        sql_text.render("SELECT version, checksum FROM {{schema}}.migration", schema)
    )
    return {row["version"]: row["checksum"] for row in rows}


def _refuse_newer(schema: str, applied: dict[int, str]) -> None:
    newest = max(applied, default=0)
    if newest > code_version():
        raise SchemaError(
            f"schema {schema!r} is at version {newest}, newer than this pgjobd, which knows "
            f"versions up to {code_version()}: upgrade pgjobd before using this database"
        )


def _refuse_edited(schema: str, applied: dict[int, str]) -> None:
    for migration in available():
        recorded = applied.get(migration.version)
        if recorded is not None and recorded != migration.checksum:
            raise SchemaError(
                f"migration {migration.version:04d}_{migration.name} was changed after it "
                f"was applied to schema {schema!r} (checksum {recorded} in the database, "
                f"{migration.checksum} in this pgjobd)"
            )


async def pending(conn: asyncpg.Connection, schema: str) -> list[Migration]:
    applied = await applied_versions(conn, schema)
    _refuse_newer(schema, applied)
    _refuse_edited(schema, applied)
    return [m for m in available() if m.version not in applied]


def dry_run_sql(schema: str, migrations: list[Migration], *, roles: bool = False) -> str:
    """The SQL `migrate` would run for these pending migrations, as one script."""
    parts = [f"-- bootstrap\n{sql_text.render(_BOOTSTRAP, schema).strip()}"]
    for m in migrations:
        parts.append(
            f"-- migration {m.version:04d}_{m.name}\nBEGIN;\n"
            f"{sql_text.render(m.sql, schema).strip()}\n"
            f"INSERT INTO {schema}.migration (version, name, checksum) "
            f"VALUES ({m.version}, '{m.name}', '{m.checksum}');\nCOMMIT;"
        )
    parts.append(f"SELECT {schema}.partitions_ensure({PARTITION_DAYS_AHEAD});")
    if roles:
        parts.append(sql_text.render(sql_text.read("roles.sql"), schema).strip())
    return "\n\n".join(parts) + "\n"


async def migrate(conn: asyncpg.Connection, schema: str, *, roles: bool = False) -> list[int]:
    """Apply every pending migration to `schema`; returns the versions applied.

    With `roles`, also create the schema's least-privilege group roles (sql/roles.sql);
    their grants are renewed by every migrate once they exist.
    """
    key = lock_key(MIGRATE, schema)
    await conn.execute("SELECT pg_advisory_lock($1, $2)", *key)
    try:
        await conn.execute(sql_text.render(_BOOTSTRAP, schema))
        done = []
        for m in await pending(conn, schema):
            async with conn.transaction():
                await conn.execute(sql_text.render(m.sql, schema))
                await conn.execute(
                    sql_text.render(
                        "INSERT INTO {{schema}}.migration (version, name, checksum) "
                        "VALUES ($1, $2, $3)",
                        schema,
                    ),
                    m.version,
                    m.name,
                    m.checksum,
                )
            done.append(m.version)
        await conn.execute(
            sql_text.render("SELECT {{schema}}.partitions_ensure($1)", schema),
            PARTITION_DAYS_AHEAD,
        )
        if roles or await conn.fetchval(
            "SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)", f"{schema}_producer"
        ):
            await conn.execute(sql_text.render(sql_text.read("roles.sql"), schema))
        return done
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1, $2)", *key)


async def check_schema(conn: asyncpg.Connection, schema: str) -> int:
    """The schema's version, if this code can use it; SchemaError otherwise."""
    applied = await applied_versions(conn, schema)
    _refuse_newer(schema, applied)
    current = max(applied, default=0)
    if current < code_version():
        state = "does not exist" if not applied else f"is at version {current}"
        raise SchemaError(
            f"schema {schema!r} {state}; this pgjobd needs version {code_version()}: "
            "run `pgjobd migrate`"
        )
    return current
