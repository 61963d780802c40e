"""The `pgjobd` command as a user runs it: real processes, exit statuses, output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import asyncpg
import pytest

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]


async def pgjobd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    result = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", *args], env={**clean, **(env or {})}, check=False
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


async def test_enqueue_prints_the_id_alone(dsn: str, conn: asyncpg.Connection, schema: str) -> None:
    plain = await pgjobd("enqueue", "hello", '{"name": "x"}', "--dsn", dsn, "--schema", schema)
    as_json = await pgjobd(
        "enqueue", "hello", "--queue", "email", "--delay", "5m", "--json",
        "--schema", schema, env={"PGJOBD_DSN": dsn},
    )  # fmt: skip

    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip().isdigit()
    assert as_json.returncode == 0, as_json.stderr
    job_id = json.loads(as_json.stdout)["id"]
    row = await conn.fetchrow(f"SELECT queue, state FROM {schema}.job WHERE id = $1", job_id)
    assert tuple(row) == ("email", "scheduled")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["hello", "{not json"], "JSON: not valid JSON"),
        (["hello", "[1]"], "args must be a JSON object"),
        (["hello", "{}", "--queue", "bad queue"], "invalid queue name"),
        (["hello", "{}", "--delay=-5s"], "delay must not be negative"),
        (["hello", "{}", "--at", "next tuesday"], "--at: not an ISO 8601 time"),
    ],
)
async def test_enqueue_rejects_bad_input_with_exit_2_and_writes_nothing(
    dsn: str, conn: asyncpg.Connection, schema: str, arguments: list[str], message: str
) -> None:
    result = await pgjobd("enqueue", *arguments, "--dsn", dsn, "--schema", schema)

    assert result.returncode == 2
    assert message in result.stderr
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0


async def test_commands_without_a_dsn_say_how_to_give_one(tmp_path: Path) -> None:
    result = await pgjobd("enqueue", "hello", "--config", str(tmp_path / "missing.toml"))

    assert result.returncode == 78
    assert "missing.toml" in result.stderr


async def test_unreachable_database_is_an_operational_error(tmp_path: Path) -> None:
    result = await pgjobd("migrate", "--dsn", "postgresql://nobody@127.0.0.1:1/none")

    assert result.returncode == 1
    assert "database error" in result.stderr


async def test_check_config_accepts_the_example_config() -> None:
    result = await pgjobd("check-config", "--config", str(REPO / "config/pgjobd.example.toml"))

    assert result.returncode == 0, result.stderr
    assert "hello" in result.stdout


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[daemon\n", "invalid TOML"),
        ("[daemon]\nlease_time = '30s'\n", "daemon.lease_time: unknown key"),
        ("[queues.email]\nconcurrency = 'many'\n", "queues.email.concurrency"),
        ("[daemon]\ndrain_timeout = '30 seconds'\n", "daemon.drain_timeout"),
    ],
)
async def test_check_config_exits_78_naming_the_file_and_key(
    tmp_path: Path, toml: str, message: str
) -> None:
    path = tmp_path / "pgjobd.toml"
    path.write_text(toml)

    result = await pgjobd("check-config", "--config", str(path))

    assert result.returncode == 78
    assert str(path) in result.stderr
    assert message in result.stderr


async def test_check_config_exits_78_on_a_handler_that_fails_to_import(tmp_path: Path) -> None:
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "broken.py").write_text("import no_such_module_anywhere\n")
    path = tmp_path / "pgjobd.toml"
    path.write_text('[daemon]\nhandlers = ["handlers"]\n')

    result = await pgjobd("check-config", "--config", str(path))

    assert result.returncode == 78
    assert "broken.py" in result.stderr
    assert "No module named 'no_such_module_anywhere'" in result.stderr


async def test_usage_errors_exit_2() -> None:
    result = await pgjobd("enqueue")

    assert result.returncode == 2
    assert "usage:" in result.stderr


async def test_enqueue_into_a_group(dsn: str, conn: asyncpg.Connection, schema: str) -> None:
    done = await pgjobd("enqueue", "hello", "--group", "user:7", "--dsn", dsn, "--schema", schema)
    assert done.returncode == 0, done.stderr
    row = await conn.fetchrow(f"SELECT group_key FROM {schema}.job WHERE id = $1", int(done.stdout))
    assert row["group_key"] == "user:7"
