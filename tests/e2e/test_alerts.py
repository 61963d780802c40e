"""docs/alerts.yml stays quiet under a healthy load: a real member works through a burst
of jobs while /metrics is scraped, and every rule's expression, evaluated at each
scrape over the run (tests/e2e/promql.py), selects nothing. Stricter than Prometheus:
a rule's `for:` is not waited for."""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import Client

from .conftest import MemberProcess, wait_until
from .promql import Evaluator, Scrape, duration_s
from .test_metrics import scrape, start_with_metrics

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]
ALERTS = Path(__file__).parents[2] / "docs" / "alerts.yml"
JOBS = 6000


@dataclass(frozen=True)
class Rule:
    alert: str
    expr: str
    for_s: float


def rules() -> list[Rule]:
    """The rules of docs/alerts.yml (the subset of YAML it is written in)."""
    found: list[Rule] = []
    lines = ALERTS.read_text().splitlines()
    i = 0
    while i < len(lines):
        alert = re.fullmatch(r"\s*- alert: (\S+)", lines[i])
        if not alert:
            i += 1
            continue
        expr, for_s, i = "", 0.0, i + 1
        while i < len(lines) and not re.fullmatch(r"\s*- (alert|name):.*", lines[i]):
            key = re.fullmatch(r"\s*(expr|for): ?(.*)", lines[i])
            if key and key[1] == "for":
                for_s = duration_s(key[2].strip())
            elif key and key[2].strip() in (">-", ">", "|"):
                indent = len(lines[i]) - len(lines[i].lstrip())
                i += 1
                block = []
                while i < len(lines) and len(lines[i]) - len(lines[i].lstrip()) > indent:
                    block.append(lines[i].strip())
                    i += 1
                expr = " ".join(block)
                continue
            elif key:
                expr = key[2].strip()
            i += 1
        found.append(Rule(alert[1], expr, for_s))
    return found


def test_the_rules_are_read_and_every_expression_evaluates() -> None:
    found = rules()
    assert len(found) == ALERTS.read_text().count("- alert:") >= 20
    empty: Scrape = (0.0, {})
    for rule in found:
        Evaluator([empty]).evaluate(rule.expr, 0)  # parses, and only known functions


def test_a_rule_selects_what_it_should() -> None:
    gauge = ("pgjobd_xmin_horizon_age_seconds", frozenset[tuple[str, str]]())
    held = [(float(t), {gauge: 600.0 + t}) for t in range(0, 120, 30)]
    by_name = {rule.alert: rule for rule in rules()}
    assert Evaluator(held).evaluate(by_name["PgjobdXminHorizon"].expr, len(held) - 1)
    assert not Evaluator(held).evaluate(by_name["PgjobdXminHorizonCritical"].expr, len(held) - 1)


async def test_no_rule_fires_under_a_healthy_load(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    member, port = await start_with_metrics(start_member)
    await wait_until(
        lambda: _leading(port), what="the member leads, with fleet gauges", timeout_s=30
    )  # fmt: skip
    scrapes: list[Scrape] = []
    started = time.monotonic()

    async def sample() -> None:
        samples = await scrape(port)
        samples[("up", frozenset({("job", "pgjobd")}))] = 1.0
        scrapes.append((time.monotonic() - started, samples))

    await sample()
    async with await Client.connect(dsn, schema=schema) as client:
        for _ in range(JOBS // 500):
            await client.enqueue_many([("echo", {"n": i}) for i in range(500)])
            await sample()
    with anyio.fail_after(120):
        while await conn.fetchval(f"SELECT count(*) FROM {schema}.job"):
            await sample()
            await anyio.sleep(0.5)
    # And until the horizon watchdog (every 30 s) has read the table after the load:
    # the dead tuples the burst left, before autovacuum clears them, or after.
    dead = ("pgjobd_job_table_rows", frozenset({("kind", "dead")}))
    before = scrapes[0][1].get(dead)
    with anyio.fail_after(90):
        while scrapes[-1][1].get(dead) == before:
            await anyio.sleep(1)
            await sample()
    assert await conn.fetchval(
        f"SELECT count(*) FROM {schema}.job_history WHERE state = 'completed'"
    ) == JOBS  # fmt: skip

    evaluator = Evaluator(scrapes)
    fired = {
        rule.alert: (scrapes[at][0], result)
        for rule in rules()
        for at in range(len(scrapes))
        if (result := evaluator.evaluate(rule.expr, at))
    }
    assert not fired, fired
    assert member.process.returncode is None


async def _leading(port: int) -> bool:
    samples = await scrape(port)
    return samples.get(("pgjobd_leader", frozenset()), 0.0) == 1.0 and any(
        name == "pgjobd_database_wraparound_age_xids" and value > 0
        for (name, _), value in samples.items()
    )
