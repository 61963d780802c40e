"""`[daemon] middleware` on a real member: it wraps the handlers in its workers, a
SIGHUP reload takes a new middleware list (and code), one that does not import is
rejected on reload and a configuration error (78) at start."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
import pytest

from .conftest import MemberProcess, wait_all_final
from .events import JSON_LOG, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]

HANDLER = """
from pgjobd import job


@job
async def plain(args: dict) -> dict:
    return {"ran": args["n"]}
"""

MIDDLEWARE = """
VERSION = {version!r}


async def stamp(ctx, call_next):
    return {{"stamp": VERSION, "kind": ctx.kind, "value": await call_next()}}


async def outer(ctx, call_next):
    return {{"outer": await call_next()}}
"""


def write_middleware(directory: Path, version: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "stamp_mw.py").write_text(MIDDLEWARE.format(version=version))


async def result_of(conn: asyncpg.Connection, schema: str, job_id: int) -> object:
    row = await conn.fetchval(f"SELECT result FROM {schema}.job_history WHERE id = $1", job_id)
    return json.loads(row)


@pytest.fixture
def handlers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "handlers"
    directory.mkdir()
    (directory / "plain.py").write_text(HANDLER)
    write_middleware(tmp_path / "mw", "v1")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mw"))
    return directory


async def test_middleware_wraps_jobs_and_reloads_with_sighup(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path,
    handlers: Path,
) -> None:  # fmt: skip
    member = await start_member(
        daemon=JSON_LOG + '\nmiddleware = ["stamp_mw:stamp"]\n', handlers=handlers
    )
    first = await conn.fetchval(f"""SELECT {schema}.enqueue('plain', '{{"n": 1}}')""")
    await wait_all_final(conn, schema, 1)
    assert await result_of(conn, schema, first) == {
        "stamp": "v1", "kind": "plain", "value": {"ran": 1},
    }  # fmt: skip

    config = tmp_path / "member0.toml"
    good = config.read_text()
    config.write_text(good.replace('["stamp_mw:stamp"]', '["stamp_mw:missing"]'))
    member.send_signal(signal.SIGHUP)
    rejected = await wait_for_event(member, "member.reload_rejected")
    assert "stamp_mw:missing" in rejected["msg"]

    write_middleware(tmp_path / "mw", "v2")
    config.write_text(good.replace('["stamp_mw:stamp"]', '["stamp_mw:outer", "stamp_mw:stamp"]'))
    member.send_signal(signal.SIGHUP)
    await wait_for_event(member, "member.reloaded", generation=2)
    second = await conn.fetchval(f"""SELECT {schema}.enqueue('plain', '{{"n": 2}}')""")
    await wait_all_final(conn, schema, 2)
    assert await result_of(conn, schema, second) == {
        "outer": {"stamp": "v2", "kind": "plain", "value": {"ran": 2}},
    }  # fmt: skip
    assert await member.stop() == 0


async def test_a_middleware_that_does_not_import_is_a_config_error(
    schema: str, start_member: StartMember, tmp_path: Path, handlers: Path, dsn: str
) -> None:
    member = await start_member(
        daemon='middleware = ["stamp_mw:stamp", "nowhere:mw"]\n', handlers=handlers,
        wait_ready=False,
    )  # fmt: skip
    with anyio.fail_after(60):
        assert await member.process.wait() == 78
    assert "nowhere:mw" in member.log and "cannot import module 'nowhere'" in member.log

    config = str(tmp_path / "member0.toml")
    check = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "check-config", "--config", config], check=False
    )
    assert check.returncode == 78, check.stderr
    assert b"nowhere:mw" in check.stderr


def test_check_config_rejects_a_malformed_middleware_name(tmp_path: Path) -> None:
    config = tmp_path / "pgjobd.toml"
    config.write_text('[daemon]\nhandlers = []\nmiddleware = ["ok:mw", "no colon"]\n')
    check = subprocess.run(
        [sys.executable, "-m", "pgjobd", "check-config", "--config", str(config)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert check.returncode == 78
    assert "daemon.middleware[1]" in check.stderr and "module:callable" in check.stderr
