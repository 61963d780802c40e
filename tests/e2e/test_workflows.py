"""The job lifecycle on real members: workflows (diamond, fan-in, a failing node, a
member killed mid-way), expiry through an outage, debounce under concurrent enqueuers
and a claiming member, and wait() on many jobs."""

from __future__ import annotations

import itertools
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from pgjobd.client import Client, JobSpec
from tests.e2e.conftest import wait_all_final, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(dsn: str, schema: str) -> AsyncIterator[Client]:
    async with await Client.connect(dsn, schema=schema) as c:
        yield c


def node(ledger: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {"ledger": str(ledger), "name": name, **extra}


def runs(ledger: Path) -> list[dict[str, Any]]:
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines() if line]


def assert_ran_after_its_dependencies(lines: list[dict[str, Any]]) -> None:
    ended = {line["id"]: line["end"] for line in lines}
    for line in lines:
        for dep in line["dependencies"]:
            assert ended[dep] <= line["start"], f"{line['name']} started before job {dep} ended"


async def test_a_diamond_and_a_fan_in_run_in_order_each_node_once(
    start_member: Any, client: Client, conn: asyncpg.Connection, schema: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    await start_member()
    a = await client.enqueue("workflow_node", node(ledger, "a"))
    b = await client.enqueue("workflow_node", node(ledger, "b"), depends_on=[a])
    c = await client.enqueue("workflow_node", node(ledger, "c"), depends_on=[a])
    d = await client.enqueue("workflow_node", node(ledger, "d"), depends_on=[b, c])
    children = await client.enqueue_many(
        [("workflow_node", node(ledger, f"child{n}")) for n in range(200)]
    )
    fan_in = await client.enqueue("workflow_node", node(ledger, "fan_in"), depends_on=children)
    info = await client.wait(fan_in, timeout=60)
    assert info.state == "completed" and info.result == {"name": "fan_in"}
    assert (await client.wait(d, timeout=60)).state == "completed"

    lines = runs(ledger)
    assert sorted(line["name"] for line in lines) == sorted(
        ["a", "b", "c", "d", "fan_in", *(f"child{n}" for n in range(200))]
    )  # each node ran exactly once
    assert_ran_after_its_dependencies(lines)
    by_name = {line["name"]: line for line in lines}
    assert by_name["d"]["results"] == {str(b): {"name": "b"}, str(c): {"name": "c"}}
    assert len(by_name["fan_in"]["results"]) == 200
    assert by_name["a"]["dependencies"] == [] and by_name["d"]["dependencies"] == [b, c]
    shown = await client.job(a)
    assert shown is not None and shown.dependants == [b, c]


async def test_a_failing_node_ends_its_dependants_dead_and_a_batch_callback_still_runs(
    start_member: Any, client: Client, conn: asyncpg.Connection, schema: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    await start_member()
    root = await client.enqueue("workflow_node", node(ledger, "root", fail=True))
    child = await client.enqueue("workflow_node", node(ledger, "child"), depends_on=[root])
    grandchild = await client.enqueue(
        "workflow_node", node(ledger, "grandchild"), depends_on=[child]
    )
    batch = await client.enqueue_batch(
        [("workflow_node", node(ledger, f"part{n}", fail=n < 2)) for n in range(5)],
        ("workflow_node", node(ledger, "callback")),
    )
    for job_id in (child, grandchild):
        info = await client.wait(job_id, timeout=60)
        assert (info.state, info.reason) == ("dead", "dependency_failed")
    assert (await client.wait(root, timeout=60)).reason == "discarded"
    assert (await client.wait(batch.callback_id, timeout=60)).state == "completed"
    lines = {line["name"]: line for line in runs(ledger)}
    assert "child" not in lines and "grandchild" not in lines
    assert lines["callback"]["batch"] == [3, 2]  # completed, failed
    assert sorted(lines["callback"]["dependencies"]) == sorted(batch.ids)


async def test_a_member_killed_mid_workflow_loses_nothing(
    start_member: Any, client: Client, conn: asyncpg.Connection, schema: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    daemon = 'lease = "2s"\n'
    first = await start_member(daemon=daemon)
    layer = [await client.enqueue("workflow_node", node(ledger, "start"))]
    for depth in range(4):
        layer = [
            await client.enqueue(
                "workflow_node", node(ledger, f"n{depth}.{i}", hold_s=0.2), depends_on=layer
            )
            for i in range(3)
        ]
    last = await client.enqueue("workflow_node", node(ledger, "last"), depends_on=layer)
    # Kill the member while the workflow is half way (some node of depth 1 has run).
    await wait_until(lambda: any(r["name"].startswith("n1.") for r in runs(ledger)), 60,
                     what="the workflow half way")  # fmt: skip
    await first.stop(signal.SIGKILL)
    await start_member(daemon=daemon)
    assert (await client.wait(last, timeout=90)).state == "completed"
    records = await wait_all_final(conn, schema, 14)
    assert {r["state"] for r in records.values()} == {"completed"}
    lines = runs(ledger)
    # At least once: a node the kill interrupted may have run twice, but each one that
    # ran completed, and none ran before what it depends on had ended.
    assert {line["name"] for line in lines} >= {"start", "last"} | {
        f"n{d}.{i}" for d in range(4) for i in range(3)
    }
    assert_ran_after_its_dependencies(
        [max((x for x in lines if x["id"] == line["id"]), key=lambda x: x["end"]) for line in lines]
    )


async def test_jobs_that_expire_during_an_outage_never_run(
    start_member: Any, client: Client, conn: asyncpg.Connection, schema: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    member = await start_member()
    assert await member.stop() == 0  # no member: an outage of the fleet
    stale = await client.enqueue_many(
        [("workflow_node", node(ledger, f"stale{n}")) for n in range(20)], ttl="200ms"
    )
    fresh = await client.enqueue("workflow_node", node(ledger, "fresh"), ttl="1h")
    await wait_until(
        lambda: conn.fetchval(
            f"SELECT bool_and(expires_at < now()) FROM {schema}.job WHERE id = ANY($1)", stale
        ), what="the jobs expired",
    )  # fmt: skip
    await start_member()
    assert (await client.wait(fresh, timeout=60)).state == "completed"
    for job_id in stale:
        info = await client.wait(job_id, timeout=60)  # swept by the leader's reaper
        assert (info.state, info.reason) == ("dead", "expired")
    assert [line["name"] for line in runs(ledger)] == ["fresh"]


async def test_debounce_under_five_concurrent_enqueuers_and_a_claiming_member(
    start_member: Any, dsn: str, schema: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    await start_member()
    returned: list[int] = []

    async def enqueuer(n: int) -> None:
        async with await Client.connect(dsn, schema=schema) as own:
            for i in range(40):
                returned.append(await own.enqueue(
                    "workflow_node", node(ledger, f"e{n}.{i}", hold_s=0.01), unique_key="key",
                    on_conflict="replace",
                ))  # fmt: skip

    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(enqueuer, n)
    async with await Client.connect(dsn, schema=schema) as own:
        sentinel = await own.enqueue("workflow_node", node(ledger, "sentinel"),
                                     unique_key="key", on_conflict="replace")  # fmt: skip
        assert (await own.wait(sentinel, timeout=60)).state == "completed"
    ids = set(returned) | {sentinel}
    records = await wait_all_final(conn, schema, len(ids))
    lines = runs(ledger)
    # The last args given are run; every job created ran at most once, none of them
    # alongside another of its key; debounce ran far fewer jobs than were enqueued.
    assert lines[-1]["name"] == "sentinel"
    ran = [line["id"] for line in lines]
    assert len(ran) == len(set(ran)) and set(ran) <= ids
    spans = sorted((line["start"], line["end"]) for line in lines)
    assert all(prev[1] <= nxt[0] for prev, nxt in itertools.pairwise(spans))
    assert len(lines) < 201
    assert {r["state"] for r in records.values()} <= {"completed", "cancelled"}
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0


async def test_wait_on_a_thousand_jobs_run_by_a_member(
    start_member: Any, client: Client, tmp_path: Path
) -> None:
    ids = await client.enqueue_many([JobSpec("echo", {"n": n}) for n in range(1000)])
    await start_member()
    infos: dict[int, Any] = {}

    async def wait_one(job_id: int) -> None:
        infos[job_id] = await client.wait(job_id, timeout=120)

    async with anyio.create_task_group() as tg:
        for job_id in ids:
            tg.start_soon(wait_one, job_id)
    assert [infos[i].result for i in ids] == [{"echo": {"n": n}} for n in range(1000)]


async def test_dead_jobs_are_grouped_by_fingerprint_and_redriven_by_it(
    start_member: Any, client: Client, dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    await start_member()
    # One error with ids varying in its message ("boom on {...}"), and another.
    same = [await client.enqueue("always_fails", {"n": n}, max_attempts=1) for n in range(4)]
    other = await client.enqueue("discards", max_attempts=1)
    for job_id in (*same, other):
        assert (await client.wait(job_id, timeout=60)).state == "dead"
    fingerprints = await conn.fetch(
        f"SELECT job_id, fingerprint FROM {schema}.job_attempt ORDER BY job_id"
    )
    by_job = {r["job_id"]: r["fingerprint"] for r in fingerprints}
    assert len({by_job[i] for i in same}) == 1 and by_job[other] != by_job[same[0]]

    listed = await _cli_json(dsn, schema, "dlq", "list")
    groups = {g["fingerprint"]: g for g in listed["groups"]}
    assert groups[by_job[same[0]]]["count"] == 4 and groups[by_job[other]]["count"] == 1
    assert groups[by_job[same[0]]]["kinds"] == ["always_fails"]
    assert {j["id"]: j["fingerprint"] for j in listed["jobs"]} == by_job
    redriven = await _cli_json(dsn, schema, "dlq", "redrive", "--fingerprint", by_job[other])
    assert redriven["ids"] == [other]


async def _cli_json(dsn: str, schema: str, *args: str) -> Any:
    result = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", *args, "--dsn", dsn, "--schema", schema, "--json"],
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


OLD_HANDLER = """
from pgjobd import job

@job(kind="versioned")
async def versioned(args: dict) -> dict:
    return {"ran": "v1", "name": args["name"]}
"""
NEW_HANDLER = """
from pgjobd import job

def _from_v1(args: dict) -> dict:
    return {"first": args["name"], "last": "(none)"}

@job(kind="versioned", args_version=2, upgraders={1: _from_v1})
async def versioned(args: dict) -> dict:
    return {"ran": "v2", "first": args["first"], "last": args["last"]}
"""


async def test_a_rolling_deploy_from_an_old_args_version_to_a_new_one(
    start_member: Any, client: Client, conn: asyncpg.Connection, schema: str, tmp_path: Path
) -> None:
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    for directory, source in ((old_dir, OLD_HANDLER), (new_dir, NEW_HANDLER)):
        directory.mkdir()
        (directory / "versioned.py").write_text(source)
    old = await start_member(handlers=old_dir)
    # Both versions queued: v1 payloads from old producers, v2 from upgraded ones.
    v1 = [await client.enqueue("versioned", {"name": f"a{n}"}) for n in range(3)]
    v2 = [await client.enqueue("versioned", {"first": f"b{n}", "last": "x",
                                             "pgjobd:version": 2}) for n in range(3)]  # fmt: skip
    for job_id in v1:
        assert (await client.wait(job_id, timeout=60)).result["ran"] == "v1"  # type: ignore[index]
    # The old member gives the v2 jobs back (no attempt charged) rather than failing them.
    await wait_until(lambda: _given_back(conn, schema, v2), 30,
                     what="the v2 jobs claimed and given back by the old member")  # fmt: skip
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history WHERE id = ANY($1)",
                               v2) == 0  # fmt: skip
    await start_member(handlers=new_dir)  # the rolling deploy: new member first,
    assert await old.stop() == 0  # then the old one drained
    late_v1 = await client.enqueue("versioned", {"name": "late"})
    for job_id in v2:
        info = await client.wait(job_id, timeout=60)
        assert info.result["ran"] == "v2" and info.attempt == 1  # type: ignore[index]
    info = await client.wait(late_v1, timeout=60)
    assert info.result == {"ran": "v2", "first": "late", "last": "(none)"}  # upgraded
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_attempt") == 0


async def _given_back(conn: asyncpg.Connection, schema: str, ids: list[int]) -> bool:
    """Every one of `ids` was claimed (attempted_at is set) and is still live, its
    attempts uncharged: given back, not failed."""
    rows = await conn.fetch(
        f"SELECT attempt, attempted_at, state::text FROM {schema}.job WHERE id = ANY($1)", ids
    )
    return len(rows) == len(ids) and all(
        r["attempted_at"] is not None and (r["attempt"] == 0 or r["state"] == "running")
        for r in rows
    )
