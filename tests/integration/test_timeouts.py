"""Every connection pgjobd opens runs with a statement_timeout and an
idle_in_transaction_session_timeout: read back with SHOW through each kind (the
member's pool and dedicated sessions, the client's pool, the CLI's connection and
pool, `pgjobd dev`'s), and the leader's long DDL runs with its own explicit limit."""

from __future__ import annotations

import ast
import json
import sys
from datetime import timedelta
from pathlib import Path

import anyio
import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgjobd
from pgjobd import Client, cli, db, migrate
from pgjobd.config import Config, DatabaseConfig, loads
from pgjobd.duration import Duration
from pgjobd.errors import ConfigError
from pgjobd.roles import RoleContext, as_table_owner

pytestmark = pytest.mark.anyio


def _config(dsn: str, schema: str = "pgjobd") -> Config:
    return Config(
        database=DatabaseConfig(
            schema=schema,
            statement_timeout=Duration(seconds=7),
            idle_in_transaction_session_timeout=Duration(seconds=11),
        ),
        dsn=dsn,
    )


async def _limits(conn: asyncpg.Connection) -> tuple[str, str]:
    return (
        await conn.fetchval("SHOW statement_timeout"),
        await conn.fetchval("SHOW idle_in_transaction_session_timeout"),
    )


async def test_the_members_pool_and_sessions_and_the_clis_carry_the_configured_limits(
    dsn: str,
) -> None:
    config = _config(dsn)
    pool = await db.create_pool(config, max_size=1)
    try:
        async with db.acquire(pool) as conn:
            assert await _limits(conn) == ("7s", "11s")
    finally:
        await pool.close()
    session = await db.connect_session(config, "pgjobd listener")
    try:
        assert await _limits(session) == ("7s", "11s")
    finally:
        await session.close()
    connection = await cli._connect(config)
    try:
        assert await _limits(connection) == ("7s", "11s")
    finally:
        await connection.close()
    cli_pool = await cli._cli_pool(config)
    try:
        async with cli_pool.acquire() as conn:
            assert await _limits(conn) == ("7s", "11s")
    finally:
        await cli_pool.close()


async def test_the_clients_pool_has_limits_by_default_and_as_given(dsn: str, schema: str) -> None:
    async with await Client.connect(dsn, schema=schema) as client, client.pool.acquire() as conn:
        assert await _limits(conn) == ("30s", "1min")
    async with (
        await Client.connect(
            dsn, schema=schema, statement_timeout="2s", idle_in_transaction_timeout="3s"
        ) as client,
        client.pool.acquire() as conn,
    ):
        assert await _limits(conn) == ("2s", "3s")


async def test_a_cli_command_runs_under_the_configured_statement_timeout(
    dsn: str, schema: str, tmp_path: Path
) -> None:
    """The limit reaches the server from the CLI's own process: a command whose
    statement outlives it fails with PostgreSQL's statement timeout."""
    config = tmp_path / "pgjobd.toml"
    config.write_text(f'[database]\nschema = "{schema}"\nstatement_timeout = "1ms"\n')
    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "status", "--config", str(config), "--dsn", dsn],
        check=False,
    )
    assert done.returncode == 1
    assert "statement timeout" in done.stderr.decode()


async def test_the_leaders_owner_ddl_runs_with_its_own_limit_then_the_sessions(
    dsn: str, leading: RoleContext
) -> None:
    async with db.acquire(leading.pool) as conn:
        await conn.execute("SET statement_timeout = '9s'")  # the session's own
        async with as_table_owner(conn, leading, timeout_ms=123_000):
            assert await conn.fetchval("SHOW statement_timeout") == "123s"
        # Back to the session's default (the pool's), not to the 9s: RESET.
        assert await conn.fetchval("SHOW statement_timeout") == "0"


def test_no_module_opens_a_connection_without_the_session_settings() -> None:
    """asyncpg.connect / create_pool are called only where the settings are passed:
    db.py (the member, the CLI), client.py (Client.connect) and embedded.py/dev.py,
    each with server_settings or db.connect_options."""
    package = Path(pgjobd.__file__).parent
    unguarded = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("connect", "create_pool")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "asyncpg"
            ):
                continue
            keywords = {k.arg for k in node.keywords}
            if "server_settings" not in keywords and None not in keywords:  # None: **options
                unguarded.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not unguarded, f"connections opened without the session settings: {unguarded}"


def test_session_settings_render_durations_as_milliseconds() -> None:
    settings = db.session_settings(timedelta(seconds=1.5), timedelta(minutes=2), "x", "acme")
    assert settings["statement_timeout"] == "1500"
    assert settings["idle_in_transaction_session_timeout"] == "120000"
    assert settings["pgjobd.tenant"] == "acme"


async def test_migrate_runs_under_its_own_limit_and_gives_the_session_its_own_back(
    dsn: str, schema_name: str
) -> None:
    session = await cli._connect(_config(dsn, schema_name))
    try:
        await migrate.migrate(session, schema_name)
        assert await _limits(session) == ("7s", "11s")
    finally:
        await session.execute(f"DROP SCHEMA IF EXISTS {schema_name} CASCADE")
        await session.close()


async def test_a_client_whose_limit_cancels_its_schema_check_is_refused_naming_the_limit(
    dsn: str, schema: str
) -> None:
    """Regression: at 789af04 a statement_timeout short enough to cancel Client.connect's
    schema check came out as a bare QueryCanceledError (here forced by a lock that holds
    the check past the limit; in CI a 1ms limit did it on a loaded machine)."""
    blocker = await asyncpg.connect(dsn)
    try:
        async with blocker.transaction():
            await blocker.execute(f"LOCK TABLE {schema}.migration IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(ValueError, match="statement_timeout: PostgreSQL cancelled"):
                await Client.connect(dsn, schema=schema, statement_timeout="200ms")
    finally:
        await blocker.close()


# Durations at the edges: no limit, below a millisecond, PostgreSQL's 2^31 - 1 ms and just
# past it, negative, not finite, past int64, malformed, NUL.
EDGE_DURATIONS = st.one_of(
    st.sampled_from([
        "0s", "0.5ms", "1ms", "2147483647ms", "2147483648ms", "24d", "25d", "-1s", "inf",
        "nan", "", " ", "1x", "\x00", "1s\x00", "9" * 30 + "s", "1e400s", "9223372036854775808ms",
    ]),
    st.builds(lambda n, unit: f"{n}{unit}", st.integers(-(2**70), 2**70),
              st.sampled_from(["ms", "s", "m", "h", "d"])),
)  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.sampled_from(["statement_timeout", "idle_in_transaction_session_timeout"]),
       value=EDGE_DURATIONS)  # fmt: skip
async def test_a_session_timeout_in_the_toml_is_refused_naming_it_or_taken_by_postgresql(
    dsn: str, schema: str, tmp_path: Path, name: str, value: str
) -> None:
    path = tmp_path / "pgjobd.toml"
    text = f'[database]\nschema = "{schema}"\n{name} = {json.dumps(value)}\n'
    try:
        config = loads(text, path)
    except ConfigError as e:
        assert f"database.{name}" in str(e), str(e)
        return
    # Accepted: every session pgjobd opens with it is one PostgreSQL takes.
    conn = await asyncpg.connect(dsn, server_settings=db.server_settings(config))
    try:
        shown = await conn.fetchval(f"SHOW {name}")
    except asyncpg.QueryCanceledError:
        # PostgreSQL took a limit of a few ms and applied it to the SHOW itself (the
        # embedded leg of CI on a loaded box).
        assert name == "statement_timeout", value
        return
    finally:
        await conn.close()
    assert shown not in ("0", "0ms"), (value, shown)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    value=EDGE_DURATIONS,
    which=st.sampled_from(["statement_timeout", "idle_in_transaction_timeout"]),
)
async def test_a_clients_session_timeout_is_refused_naming_it_or_taken_by_postgresql(
    dsn: str, schema: str, value: str, which: str
) -> None:
    try:
        client = await Client.connect(dsn, schema=schema, min_size=1, max_size=1,
                                      **{which: value})  # fmt: skip
    except (ValueError, TypeError) as e:
        assert which in str(e) or "duration" in str(e) or "number" in str(e), str(e)
        return
    async with client, client.pool.acquire() as conn:
        try:
            assert await conn.fetchval("SELECT 1") == 1
        except asyncpg.QueryCanceledError:
            # PostgreSQL took the limit and applied it: a limit of a few ms may cancel
            # even this on a loaded machine.
            assert which == "statement_timeout", value
