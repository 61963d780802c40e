"""The example handlers in handlers/, tested with the testing kit as a user would test
theirs: run_job for each outcome, and pgjobd_client + pgjobd_drain for the round trip
(the plugin finds handlers/ through the ini option pgjobd_handlers in pyproject.toml)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pgjobd import Client
from pgjobd.handler_loader import Registry
from pgjobd.testing import assert_enqueued, assert_not_enqueued, run_job

pytestmark = pytest.mark.anyio


async def test_hello_greets(pgjobd_handlers: Registry) -> None:
    outcome = await run_job(pgjobd_handlers["hello"], {"name": "Ada"})
    assert (outcome.state, outcome.result) == ("completed", {"greeting": "Hello, Ada!"})
    missing = await run_job(pgjobd_handlers["hello"], {})
    assert (missing.state, missing.reason) == ("dead", "invalid_args")


async def test_build_report_runs_in_a_thread_and_checks_its_args(
    pgjobd_handlers: Registry,
) -> None:
    report = pgjobd_handlers["build_report"]
    assert not report.is_async
    assert (await run_job(report, {"scope": "today"})).result == {"scope": "today", "rows": 40}
    assert (await run_job(report, {})).result == {"scope": "all", "rows": 1000}
    wrong = await run_job(report, {"scope": "yesterday"})
    assert (wrong.state, wrong.reason) == ("dead", "invalid_args")


@pytest.mark.parametrize(
    ("status", "state", "after_s"),
    [(200, "completed", None), (429, "snoozed", 30.0), (503, "retryable", 10.0)],
)
async def test_flaky_webhook_outcomes(
    pgjobd_handlers: Registry, monkeypatch: pytest.MonkeyPatch, status: int, state: str,
    after_s: float | None,
) -> None:  # fmt: skip
    monkeypatch.setattr(random, "choice", lambda choices: status)
    hook = {"url": "https://example.org/hook", "event": "signup"}
    outcome = await run_job(pgjobd_handlers["flaky_webhook"], hook)
    assert outcome.state == state
    assert (outcome.after.total_seconds() if outcome.after else None) == after_s
    last = await run_job(pgjobd_handlers["flaky_webhook"], hook, attempt=5)
    assert last.state == ("dead" if state == "retryable" else state)


async def test_flaky_webhook_discards_a_url_it_cannot_deliver_to(
    pgjobd_handlers: Registry,
) -> None:
    outcome = await run_job(pgjobd_handlers["flaky_webhook"], {"url": "ftp://x", "event": "e"})
    assert (outcome.state, outcome.reason) == ("dead", "discarded")
    assert outcome.error == "pgjobd.Discard: not an http(s) url: ftp://x"


async def test_enqueue_and_drain_the_examples(
    pgjobd_client: Client, pgjobd_drain: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(random, "choice", lambda choices: 503)  # the webhook's end is down
    hello = await pgjobd_client.enqueue("hello", {"name": "Grace"})
    report = await pgjobd_client.enqueue("build_report", {"scope": "today"})
    hook = await pgjobd_client.enqueue("flaky_webhook", {"url": "https://h", "event": "e"})
    await assert_enqueued("build_report", args={"scope": "today"})
    outcomes = {o.job_id: o for o in await pgjobd_drain(fast_forward=True)}
    assert outcomes[hello].state == outcomes[report].state == "completed"
    # Retried (after 10 s each, fast-forwarded) until its 5 attempts were spent.
    assert (outcomes[hook].state, outcomes[hook].attempt) == ("dead", 5)
    info = await pgjobd_client.job(hook)
    assert info is not None and (info.reason, len(info.errors)) == ("attempts_exhausted", 5)
    await assert_not_enqueued("flaky_webhook")
