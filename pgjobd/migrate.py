"""Forward-only schema migrations: versioned SQL files applied in order.

Each migration runs in its own transaction and is recorded in ``<schema>.migration``;
the whole run holds an advisory lock derived from the schema name, so `pgjobd migrate`
may run from several hosts at once and leaves one correct schema.

Before it writes anything, `migrate` compares the schema with what the migrations
already recorded in it would have built, and refuses (SchemaError, naming each object)
when something of pgjobd's is missing or altered, or when the schema holds objects that
pgjobd did not create. The expected catalog comes from the migration files themselves:
they are applied to a scratch schema in a transaction that is rolled back (see `verify`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from importlib import resources

import asyncpg

from pgjobd import sql_text
from pgjobd.errors import SchemaError
from pgjobd.lock_keys import MIGRATE, lock_key

log = logging.getLogger(__name__)

_FILE_NAME = re.compile(r"(\d{4})_(\w+)\.sql")
# Daily history/attempt partitions that exist ahead of time after every migrate.
PARTITION_DAYS_AHEAD = 7
# ... and behind: yesterday's, for rows whose transaction began before midnight (UTC)
# and for back-dated rows; partitions_ensure itself starts at today.
PARTITION_DAYS_BACK = 1
PARTITIONED = ("job_history", "job_attempt")
# The statement_timeout of migrate's own statements (see `migrate`).
MIGRATE_TIMEOUT = "1h"
# The group roles `migrate --roles` creates, as <schema>_<suffix> (sql/roles.sql).
ROLE_SUFFIXES = ("producer", "readonly", "admin", "worker", "maintainer")

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


def dry_run_sql(
    schema: str, migrations: list[Migration], *, roles: bool = False, rls: bool = False
) -> str:
    """The SQL `migrate` would run for these pending migrations, as one script."""
    parts = [f"-- bootstrap\n{sql_text.render(_BOOTSTRAP, schema).strip()}"]
    for m in migrations:
        # The printed script: `schema` passed schema_name_problem (render), the rest is
        # the migration's own text.
        parts.append(
            f"-- migration {m.version:04d}_{m.name}\nBEGIN;\n"  # nosec B608
            f"{sql_text.render(m.sql, schema).strip()}\n"
            f"INSERT INTO {schema}.migration (version, name, checksum) "
            f"VALUES ({m.version}, '{m.name}', '{m.checksum}');\nCOMMIT;"
        )
    parts.append(f"SELECT {schema}.partitions_ensure({PARTITION_DAYS_AHEAD});")
    parts.append(
        f"-- and the partitions of the {PARTITION_DAYS_BACK} day(s) before today (UTC):\n"
        + "\n".join(
            _partition_ddl(schema, parent, day)
            for day in _days_back(datetime.now(UTC).date())
            for parent in PARTITIONED
        )
    )
    if roles or rls:
        parts.append(sql_text.render(sql_text.read("roles.sql"), schema).strip())
    if rls:
        parts.append(sql_text.render(sql_text.read("rls.sql"), schema).strip())
    return "\n\n".join(parts) + "\n"


async def migrate(
    conn: asyncpg.Connection, schema: str, *, roles: bool = False, rls: bool = False
) -> list[int]:
    """Apply every pending migration to `schema`; returns the versions applied.

    Refuses with SchemaError, before writing anything, a schema whose objects differ
    from what its recorded migrations built (see `verify`). With `roles`, also create
    the schema's least-privilege group roles (sql/roles.sql); their grants are renewed
    by every migrate once they exist. With `rls` (which implies `roles`), also turn on
    row-level security by tenant (sql/rls.sql), renewed likewise once it is on.
    """
    key = lock_key(MIGRATE, schema)
    # A migration may rewrite or scan a large table, and may wait for another host's
    # migrate to finish: longer than a session's usual statement_timeout (the CLI's is
    # database.statement_timeout), but not for ever. Restored when done.
    previous = await conn.fetchval("SELECT current_setting('statement_timeout')")
    await conn.execute("SELECT set_config('statement_timeout', $1, false)", MIGRATE_TIMEOUT)
    await conn.execute("SELECT pg_advisory_lock($1, $2)", *key)
    try:
        todo = await pending(conn, schema)
        found = await verify(conn, schema)
        found.raise_for_migrate()
        if found.skipped:
            log.warning("schema %s: objects not compared with the migrations: %s", schema,
                        found.skipped, extra={"event": "schema.check_skipped"})  # fmt: skip
        await conn.execute(sql_text.render(_BOOTSTRAP, schema))
        done = []
        for m in todo:
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
        await ensure_past_partitions(conn, schema)
        if (
            roles
            or rls
            or await conn.fetchval(
                "SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)", f"{schema}_producer"
            )
        ):
            async with conn.transaction():
                await conn.execute(sql_text.render(sql_text.read("roles.sql"), schema))
        if rls or await rls_enabled(conn, schema):
            async with conn.transaction():
                await conn.execute(sql_text.render(sql_text.read("rls.sql"), schema))
        return done
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1, $2)", *key)
        await conn.execute("SELECT set_config('statement_timeout', $1, false)", previous)


async def rls_enabled(conn: asyncpg.Connection, schema: str) -> bool:
    """Has `migrate --rls` turned row-level security on for this schema's jobs?"""
    enabled: bool | None = await conn.fetchval(
        "SELECT c.relrowsecurity FROM pg_class AS c WHERE c.oid = to_regclass($1)",
        f"{schema}.job",
    )
    return bool(enabled)


@dataclass(frozen=True)
class MigrationState:
    """One migration as `migrate --status` lists it."""

    version: int
    name: str
    applied_at: datetime | None  # None: pending


async def status(conn: asyncpg.Connection, schema: str) -> list[MigrationState]:
    """Every migration this pgjobd knows, applied (with when) or pending, in order;
    SchemaError if the schema is newer than this code or an applied one was edited."""
    applied = await applied_versions(conn, schema)
    _refuse_newer(schema, applied)
    _refuse_edited(schema, applied)
    when: dict[int, datetime] = {}
    if applied:
        rows = await conn.fetch(
            sql_text.render("SELECT version, applied_at FROM {{schema}}.migration", schema)
        )
        when = {row["version"]: row["applied_at"] for row in rows}
    return [MigrationState(m.version, m.name, when.get(m.version)) for m in available()]


def describe_pending(migrations: Iterable[Migration]) -> str:
    return ", ".join(f"{m.version:04d}_{m.name}" for m in migrations)


# A migration that older code cannot run against (the contract step of an
# expand/contract change) is named contract_<topic>: the only newer migrations that
# members and clients refuse. Every other newer migration is an expansion they run on.
CONTRACT_PREFIX = "contract_"


async def _newer_names(conn: asyncpg.Connection, schema: str) -> dict[int, str]:
    rows = await conn.fetch(
        sql_text.render(
            "SELECT version, name FROM {{schema}}.migration WHERE version > $1", schema
        ),
        code_version(),
    )
    return {row["version"]: row["name"] for row in rows}


async def check_schema(conn: asyncpg.Connection, schema: str, *, deep: bool = False) -> int:
    """The schema's version, if this code can use it; SchemaError otherwise.

    A schema newer than this code is used, with a warning, unless one of the newer
    migrations is a contract step (CONTRACT_PREFIX): releases are expand/contract, so
    a member or client keeps working while the next release's `migrate` runs.
    With `deep` (a member's start), also compare the schema's objects with what the
    migrations build: a missing or altered object is a SchemaError, an object pgjobd
    did not create only a warning (a member works around it; migrate refuses it).
    A role without the right to create the scratch schema skips the comparison, and so
    does a newer schema (this code cannot know what its migrations built).
    """
    applied = await applied_versions(conn, schema)
    current = max(applied, default=0)
    if current > code_version():
        newer = await _newer_names(conn, schema)
        contract = [f"{v:04d}_{n}" for v, n in sorted(newer.items())
                    if n.startswith(CONTRACT_PREFIX)]  # fmt: skip
        if contract:
            raise SchemaError(
                f"schema {schema!r} is at version {current}, newer than this pgjobd, which "
                f"knows versions up to {code_version()}, and {', '.join(contract)} removed "
                "what this version uses: upgrade pgjobd before using this database"
            )
        log.warning(
            "schema %s is at version %d, newer than this pgjobd (%d): running on it, as "
            "expand/contract releases allow; upgrade pgjobd soon", schema, current,
            code_version(), extra={"event": "schema.newer", "version": current},
        )  # fmt: skip
        return current
    if current < code_version():
        state = "does not exist" if not applied else f"is at version {current}"
        todo = describe_pending(m for m in available() if m.version not in applied)
        raise SchemaError(
            f"schema {schema!r} {state}; this pgjobd needs version {code_version()}, "
            f"pending migrations: {todo}: run `pgjobd migrate`"
        )
    if deep:
        found = await verify(conn, schema)
        found.raise_for_run()
        if found.foreign:
            log.warning(
                "schema %s holds objects pgjobd did not create: %s", schema,
                "; ".join(found.foreign),
                extra={"event": "schema.foreign_objects", "objects": found.foreign},
            )  # fmt: skip
        if found.skipped:
            log.warning(
                "schema %s: objects not compared with the migrations: %s", schema,
                found.skipped, extra={"event": "schema.check_skipped"},
            )  # fmt: skip
    return current


# -- partitions --------------------------------------------------------------------------


def _days_back(today: date) -> list[date]:
    return [today - timedelta(days=n) for n in range(PARTITION_DAYS_BACK, 0, -1)]


def _partition_ddl(schema: str, parent: str, day: date) -> str:
    name = f"{parent}_p{day:%Y%m%d}"
    return (
        f"CREATE TABLE IF NOT EXISTS {schema}.{name} PARTITION OF {schema}.{parent} "
        f"FOR VALUES FROM ('{day.isoformat()} 00:00+00') "
        f"TO ('{(day + timedelta(days=1)).isoformat()} 00:00+00');"
    )


async def ensure_past_partitions(
    conn: asyncpg.Connection, schema: str, *, today: date | None = None
) -> int:
    """Create the PARTITION_DAYS_BACK days' partitions before `today` (the server's UTC
    date by default) that are missing; returns how many it created.

    A final record's time is when it is written (finished_at, failed_at default to the
    writing transaction's now()), so a late completion of an old job lands in today's
    partition; but a transaction that began just before midnight writes yesterday's
    date after it, and a fresh schema has no partition for it. Retention drops these
    like any other day.
    """
    if today is None:
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    created = 0
    for day in _days_back(today):
        for parent in PARTITIONED:
            exists = await conn.fetchval(
                "SELECT to_regclass($1) IS NOT NULL", f"{schema}.{parent}_p{day:%Y%m%d}"
            )
            if exists:
                continue
            try:
                await conn.execute(_partition_ddl(schema, parent, day))
            except asyncpg.DuplicateTableError:
                continue  # another session created it first
            created += 1
    return created


# -- comparing the schema with what the migrations build ---------------------------------

_CATALOG_QUERIES = (
    "catalog_relations",
    "catalog_columns",
    "catalog_indexes",
    "catalog_constraints",
    "catalog_triggers",
    "catalog_functions",
    "catalog_types",
)
_RELATION_KINDS = {
    "r": "table",
    "p": "table",
    "v": "view",
    "m": "materialized view",
    "S": "sequence",
    "f": "foreign table",
}
_TYPE_KINDS = {"e": "enum type", "d": "domain", "c": "composite type", "r": "range type",
               "m": "multirange type"}  # fmt: skip


@dataclass(frozen=True)
class CatalogObject:
    """One object of a schema: what it is, its name (`table.column` for parts of a
    relation), the relation it belongs to, and its definition as attribute → text."""

    label: str
    name: str
    relation: str | None
    attributes: Mapping[str, str]


Catalog = dict[tuple[str, str], CatalogObject]


async def read_catalog(conn: asyncpg.Connection, schema: str) -> Catalog:
    """The objects of `schema` as the catalog queries see them (partitions left out)."""
    blocks = sql_text.named_blocks("catalog.sql")
    rows: dict[str, list[asyncpg.Record]] = {}
    async with conn.transaction():
        await conn.execute("SET LOCAL search_path = pg_catalog")
        # Catalog statistics go stale where schemas come and go (a test database): the
        # planner's estimates then make JIT compile these small queries, for 0.3 s each.
        await conn.execute("SET LOCAL jit = off")
        for name in _CATALOG_QUERIES:
            rows[name] = await conn.fetch(blocks[name], schema)
    return _build_catalog(rows)


def _build_catalog(rows: Mapping[str, list[asyncpg.Record]]) -> Catalog:
    catalog: Catalog = {}
    relations = rows["catalog_relations"]
    parents = {r["name"] for r in relations if r["kind"] == "p"}
    # A partition left behind detached (a rotator stopped between DETACH and DROP).
    dropped = {
        r["name"] for r in relations if re.fullmatch(r"(\w+)_p\d{8}", r["name"])
        and r["name"].rsplit("_p", 1)[0] in parents
    }  # fmt: skip

    def add(what: str, label: str, name: str, relation: str | None, **attrs: object) -> None:
        if relation in dropped:
            return
        catalog[(what, name)] = CatalogObject(label, name, relation, {
            k: ("yes" if v else "no") if isinstance(v, bool) else str(v) for k, v in attrs.items()
        })  # fmt: skip

    for r in relations:
        if r["name"] in dropped:
            continue
        add("relation", _RELATION_KINDS[r["kind"]], r["name"], r["name"],
            kind=_RELATION_KINDS[r["kind"]], persistence=r["persistence"],
            storage_options=r["options"], partition_key=r["partition_key"],
            view_definition=r["view_def"], sequence=r["sequence"])  # fmt: skip
    for r in rows["catalog_columns"]:
        add("column", "column", f"{r['relation']}.{r['name']}", r["relation"], type=r["type"],
            not_null=r["not_null"], default=r["default_expr"], identity=r["identity"],
            generated=r["generated"])  # fmt: skip
    for r in rows["catalog_indexes"]:  # index names are unique in a schema
        add("index", "index", r["name"], r["relation"], definition=r["definition"])
    for kind in ("constraint", "trigger"):
        for r in rows[f"catalog_{kind}s"]:
            add(kind, kind, f"{r['relation']}.{r['name']}", r["relation"],
                definition=r["definition"])  # fmt: skip
    for r in rows["catalog_functions"]:
        label = "procedure" if r["kind"] == "p" else "function"
        add("function", label, r["name"], None, kind=r["kind"], arguments=r["arguments"],
            result=r["result"], language=r["language"],
            security_definer=r["security_definer"], volatility=r["volatility"],
            strict=r["strict"], settings=r["config"], body=r["body"])  # fmt: skip
    for r in rows["catalog_types"]:
        add("type", _TYPE_KINDS[r["kind"]], r["name"], None, definition=r["definition"])
    return catalog


def _renamed(catalog: Catalog, old: str, new: str) -> Catalog:
    """The catalog with every mention of schema `old` (a scratch name) made `new`."""
    return {
        key: CatalogObject(
            obj.label,
            obj.name,
            obj.relation,
            {k: v.replace(old, new) for k, v in obj.attributes.items()},
        )
        for key, obj in catalog.items()
    }


async def expected_catalogs(
    conn: asyncpg.Connection, schema: str, versions: Iterable[int]
) -> dict[int, Catalog]:
    """The catalog each of `versions` of the schema should have (0: the bootstrap only),
    by applying the migrations to a scratch schema in a transaction rolled back."""
    wanted = set(versions)
    scratch = f"pgjobd_verify_{secrets.token_hex(8)}"
    found: dict[int, Catalog] = {}
    transaction = conn.transaction()
    await transaction.start()
    try:
        await conn.execute(sql_text.render(_BOOTSTRAP, scratch))
        for migration in [Migration(0, "bootstrap", ""), *available()]:
            if migration.version > max(wanted, default=0):
                break
            if migration.sql:
                await conn.execute(sql_text.render(migration.sql, scratch))
            if migration.version in wanted:
                # read_catalog's own transaction is a savepoint of this one
                found[migration.version] = _renamed(
                    await read_catalog(conn, scratch), scratch, schema
                )
    finally:
        await transaction.rollback()
    return found


@dataclass
class Differences:
    """How a schema differs from what its migrations built. `skipped` says why nothing
    was compared, when nothing was."""

    schema: str
    missing: list[str] = field(default_factory=list)
    altered: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    skipped: str | None = None

    def raise_for_migrate(self) -> None:
        if self.foreign:
            raise SchemaError(
                f"schema {self.schema!r} holds objects that pgjobd did not create: "
                + "; ".join(self.foreign)
                + ". Nothing was changed. Give pgjobd a schema of its own (database.schema, "
                "--schema), or move those objects out of this one"
                + (f". Also: {'; '.join(self.missing + self.altered)}" if self.broken else "")
            )
        self.raise_for_run()

    def raise_for_run(self) -> None:
        if self.broken:
            raise SchemaError(
                f"schema {self.schema!r} does not match its migrations: "
                + "; ".join(self.missing + self.altered)
                + ". Nothing was changed. Restore these objects as the migrations define "
                "them (`pgjobd migrate --dry-run` against an empty schema prints them), "
                "or migrate a new schema and move the jobs over"
            )

    @property
    def broken(self) -> list[str]:
        return self.missing + self.altered


async def verify(conn: asyncpg.Connection, schema: str) -> Differences:
    """Compare `schema` with what the migrations recorded in it build.

    A schema that does not exist yet, or exists without pgjobd's migration table (made
    ahead by a DBA), may hold nothing at all: any object in it is foreign.
    """
    result = Differences(schema)
    exists = await conn.fetchval("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)",
                                 schema)  # fmt: skip
    if not exists:
        return result
    applied = await applied_versions(conn, schema)
    current = max(applied, default=0)
    try:
        expected = (await expected_catalogs(conn, schema, [current]))[current]
    except asyncpg.InsufficientPrivilegeError as e:
        result.skipped = f"this role may not create the scratch schema to compare with ({e})"
        return result
    except asyncpg.PostgresError as e:
        # All migrations run in one scratch transaction, where the real ones commit each:
        # one that needs its predecessor committed (an enum value added, then used) fails
        # here. Not a reason to stop a deploy: say so and carry on unverified.
        result.skipped = (
            f"the migrations did not build in a scratch schema: {type(e).__name__}: {e}"
        )
        return result
    actual = await read_catalog(conn, schema)
    if not applied:  # nothing of ours yet, except maybe the bootstrap's migration table
        expected = {k: v for k, v in expected.items() if k in actual}
    _compare(result, expected, actual)
    return result


def _compare(result: Differences, expected: Catalog, actual: Catalog) -> None:
    schema = result.schema
    gone = {obj.name for key, obj in expected.items() if key[0] == "relation" and key not in actual}
    extra = {
        obj.name for key, obj in actual.items() if key[0] == "relation" and key not in expected
    }
    for key in sorted(expected.keys() | actual.keys()):
        want, have = expected.get(key), actual.get(key)
        if have is None and want is not None:
            if key[0] == "relation" or want.relation not in gone:
                result.missing.append(f"{want.label} {schema}.{want.name} is missing")
        elif want is None and have is not None:
            if key[0] == "relation" or have.relation not in extra:
                result.foreign.append(f"{have.label} {schema}.{have.name}")
        elif want is not None and have is not None and want.attributes != have.attributes:
            result.altered.append(_describe_change(schema, want, have))


def _describe_change(schema: str, want: CatalogObject, have: CatalogObject) -> str:
    changes = []
    for attr, expected in want.attributes.items():
        actual = have.attributes.get(attr, "")
        if actual == expected:
            continue
        if attr == "body":
            changes.append("has a different body")
        elif attr == "not_null":
            changes.append("is nullable, expected NOT NULL" if expected == "yes"
                           else "is NOT NULL, expected nullable")  # fmt: skip
        else:
            words = attr.replace("_", " ")
            changes.append(f"has {words} {_shown(actual)}, expected {_shown(expected)}")
    return f"{want.label} {schema}.{want.name} " + ", ".join(changes)


def _shown(value: str) -> str:
    if not value:
        return "(none)"
    return value if len(value) <= 200 else value[:199] + "…"
