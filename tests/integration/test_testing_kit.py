"""pgjobd.testing against a real database: the end rule run_job applies is the
database's, and drain claims and records through the daemon's own statements."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from pgjobd import Client, Discard, JobContext, Retry, Snooze, job
from pgjobd.config import QueueConfig
from pgjobd.duration import Duration
from pgjobd.handler_loader import Registry
from pgjobd.testing import (
    _end_reason,
    all_enqueued,
    assert_enqueued,
    assert_not_enqueued,
    declare_kinds,
    drain,
)

pytestmark = pytest.mark.anyio


async def test_run_jobs_end_rule_is_the_databases(conn: Any, schema: str) -> None:
    outcomes = ("completed", "failed", "retry", "snoozed", "discarded", "invalid_args",
                "unknown_kind", "given_back")  # fmt: skip
    for outcome, attempt, max_attempts in itertools.product(outcomes, (1, 2, 3), (1, 2, 3)):
        if outcome == "completed":
            continue  # completions do not go through job_end_reason
        sql = await conn.fetchval(
            f"SELECT {schema}.job_end_reason($1, $2, $3, 0, 3, false)",
            outcome, attempt, max_attempts,
        )  # fmt: skip
        assert _end_reason(outcome, attempt, max_attempts) == sql, (outcome, attempt)


class Order(msgspec.Struct):
    order_id: int


CALLS: list[tuple[str, int]] = []


@job(queue="mail", max_attempts=2)
async def confirm(args: Order, ctx: JobContext) -> dict[str, int]:
    CALLS.append(("confirm", ctx.attempt))
    if args.order_id < 0:
        raise ValueError("bad order")
    return {"order_id": args.order_id}


@job
async def chase(args: Order, ctx: JobContext) -> None:
    CALLS.append(("chase", ctx.attempt))
    if ctx.attempt == 1:
        raise Retry(after="1h")
    if args.order_id == 0:
        raise Discard("gone")


@job
async def later(args: dict[str, Any]) -> None:
    raise Snooze("1h")


@pytest.fixture
async def client(dsn: str, schema: str) -> AsyncIterator[Client]:
    async with await Client.connect(dsn, schema=schema) as c:
        await declare_kinds(c, HANDLERS)
        yield c


HANDLERS = Registry.from_functions([confirm, chase, later])
# Failed attempts back off for hours: a drain without fast_forward never meets them again.
SLOW = {name: QueueConfig(backoff_base=Duration(hours=1)) for name in ("default", "mail")}


async def test_drain_records_outcomes_as_the_daemon_would(client: Client) -> None:
    CALLS.clear()
    ok = await client.enqueue(confirm, Order(order_id=1), queue="mail")
    bad = await client.enqueue("confirm", {"order_id": -1}, queue="mail")
    retried = await client.enqueue(chase, Order(order_id=5))
    ran = await drain(client, HANDLERS, queues=SLOW)
    assert [(o.job_id, o.state) for o in ran] == [
        (retried, "retryable"),
        (ok, "completed"),
        (bad, "retryable"),
    ]  # queue "default" drains before "mail"; the retries wait for their backoff
    info = await client.job(ok)
    assert info is not None and (info.state, info.result) == ("completed", {"order_id": 1})
    await assert_enqueued(chase, client=client)
    await assert_not_enqueued(confirm, args={"order_id": 1}, client=client)

    # fast_forward: the backoffs are skipped and every retry runs until it ends.
    ran = await drain(client, HANDLERS, fast_forward=True)
    assert sorted((o.job_id, o.state, o.reason) for o in ran) == sorted([
        (retried, "completed", None), (bad, "dead", "attempts_exhausted"),
    ])  # fmt: skip
    dead = await client.job(bad)
    assert dead is not None and (dead.state, dead.attempt, dead.reason) == (
        "dead", 2, "attempts_exhausted",
    )  # fmt: skip
    assert [e.error for e in dead.errors] == ["ValueError: bad order"] * 2
    assert await all_enqueued(client=client) == []
    assert await drain(client, HANDLERS) == []


async def test_drain_one_queue_and_a_snooze_that_never_ends(client: Client) -> None:
    mail = await client.enqueue("confirm", {"order_id": 1})  # its declared queue
    await assert_enqueued(confirm, queue="mail", client=client)
    await client.enqueue("later", {}, queue="slow")
    assert await drain(client, HANDLERS, queue="elsewhere") == []
    ran = await drain(client, HANDLERS, queue="slow")
    assert [o.state for o in ran] == ["snoozed"]
    with pytest.raises(RuntimeError, match="still due"):
        await drain(client, HANDLERS, queue="slow", fast_forward=True, max_runs=5)
    assert [o.job_id for o in await drain(client, HANDLERS, queue="mail")] == [mail]


async def test_unknown_kinds_and_assertion_messages(client: Client) -> None:
    job_id = await client.enqueue("nobody_handles", {"x": 1}, tenant="acme")
    [outcome] = await drain(client, HANDLERS, queues=SLOW)
    assert (outcome.job_id, outcome.state, outcome.verdict) == (job_id, "retryable", "unknown_kind")
    await assert_enqueued("nobody_handles", args={"x": 1}, tenant="acme", count=1, client=client)
    expected = r"expected a job enqueued matching kind='nobody_handles', args.*\n.*#\d+ nobody"
    with pytest.raises(AssertionError, match=expected):
        await assert_enqueued("nobody_handles", args={"x": 2}, client=client)
    with pytest.raises(AssertionError, match="expected no job enqueued"):
        await assert_not_enqueued("nobody_handles", tenant="acme", client=client)
    with pytest.raises(RuntimeError, match="no client"):
        await all_enqueued()


STEPS: list[int] = []
GATHERED: dict[int, Any] = {}


@job
async def step(args: dict[str, int]) -> int:
    STEPS.append(args["n"])
    return args["n"] * 10


@job
async def gather(args: dict[str, Any], ctx: JobContext) -> None:
    GATHERED.update(await ctx.results())


async def test_drain_claims_a_grouped_queue_through_the_flow_claim(dsn: str, schema: str) -> None:
    handlers = Registry.from_functions([step, gather])
    STEPS.clear()
    GATHERED.clear()
    async with await Client.connect(dsn, schema=schema) as client:
        await declare_kinds(client, handlers)
        first = await client.enqueue("step", {"n": 1}, queue="flow", group="g")
        second = await client.enqueue("step", {"n": 2}, queue="flow", group="g")
        last = await client.enqueue("gather", {}, queue="flow", depends_on=[first, second])
        async with client.pool.acquire() as conn:
            assert await client.queries.queue_flow_get(conn, "flow")  # job_claim gives nothing
        ran = await drain(client, handlers)
    assert [(o.job_id, o.state) for o in ran] == [
        (first, "completed"), (second, "completed"), (last, "completed"),
    ]  # fmt: skip
    assert STEPS == [1, 2]
    assert dict(GATHERED) == {first: 10, second: 20}  # ctx.results() in a drain
