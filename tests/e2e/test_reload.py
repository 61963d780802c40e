"""SIGHUP: a new generation of workers takes the new code and config; the old one
finishes what it holds; nothing is lost or run twice; a bad reload changes nothing."""

from __future__ import annotations

import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
import pytest

from .conftest import DEFAULT_QUEUES, MemberProcess, wait_all_final, wait_until
from .events import JSON_LOG, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]

HANDLER = """
import anyio
from pgjobd import job

VERSION = {version!r}


@job
async def which_version(args: dict) -> str:
    return VERSION


@job
async def gated(args: dict) -> str:
    await anyio.Path(args["started"]).write_text("started")
    while not await anyio.Path(args["release"]).exists():
        await anyio.sleep(0.01)
    return VERSION
"""


def write_handlers(directory: Path, version: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "versioned.py").write_text(HANDLER.format(version=version))


async def results(conn: asyncpg.Connection, schema: str) -> dict[int, object]:
    rows = await conn.fetch(f"SELECT id, result FROM {schema}.job_history")
    return {r["id"]: json.loads(r["result"]) for r in rows}


@pytest.mark.core
async def test_reload_swaps_code_and_queues_without_losing_a_job(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    handlers = tmp_path / "handlers"
    write_handlers(handlers, "v1")
    member = await start_member(daemon=JSON_LOG, handlers=handlers)
    gate = {"started": str(tmp_path / "started"), "release": str(tmp_path / "release")}
    in_flight = await conn.fetchval(
        f"SELECT {schema}.enqueue('gated', $1::jsonb)", json.dumps(gate)
    )
    await wait_until(anyio.Path(gate["started"]).exists, what="old-generation job running")

    write_handlers(handlers, "v2")
    config = tmp_path / "member0.toml"
    config.write_text(
        config.read_text().replace(DEFAULT_QUEUES, DEFAULT_QUEUES + "\n[queues.extra]\n")
    )
    member.send_signal(signal.SIGHUP)
    await wait_for_event(member, "member.reloaded", generation=2)

    new_code = await conn.fetchval(f"SELECT {schema}.enqueue('which_version')")
    new_queue = await conn.fetchval(f"SELECT {schema}.enqueue('which_version', queue => 'extra')")
    await wait_all_final(conn, schema, 2)
    await anyio.Path(gate["release"]).write_text("go")
    await wait_all_final(conn, schema, 3)

    done = await results(conn, schema)
    assert done == {in_flight: "v1", new_code: "v2", new_queue: "v2"}
    attempts = await conn.fetchval(f"SELECT max(attempt) FROM {schema}.job_history")
    assert attempts == 1  # nothing ran twice
    assert member.process.returncode is None
    assert await member.stop() == 0


@pytest.mark.parametrize("breakage", ["config", "handler"])
@pytest.mark.core
async def test_a_bad_reload_keeps_the_old_generation_serving(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path,
    breakage: str,
) -> None:  # fmt: skip
    handlers = tmp_path / "handlers"
    write_handlers(handlers, "v1")
    member = await start_member(daemon=JSON_LOG, handlers=handlers)
    if breakage == "config":
        config = tmp_path / "member0.toml"
        config.write_text(config.read_text() + "\n[daemon.oops]\n")
    else:
        (handlers / "broken.py").write_text("raise ImportError('half-deployed')\n")

    member.send_signal(signal.SIGHUP)
    rejected = await wait_for_event(member, "member.reload_rejected")
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('which_version')")

    await wait_all_final(conn, schema, 1)
    assert (await results(conn, schema))[job_id] == "v1"
    expected = "daemon" if breakage == "config" else "broken.py"
    assert expected in rejected["msg"]  # the error names what is wrong
    assert member.process.returncode is None
